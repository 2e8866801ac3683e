"""How one batched pass lays its feeds out for the model: padded rows or one packed sequence.

Padded (``padded``): a batch of the rows, each feed at the end of its row (left padding) to the longest
feed's width. Attention reads each row's cached keys in place (a view when the rows are contiguous). The
price is the padding: a prompt chunk of 21 tokens beside seven one-token rows computes 8 x 21 positions
for 28 real ones, and the linear layers, which cost nearly all of a pass, pay for every position.

Packed (``packed``): every feed one after another in a batch of one, no padding; the linear layers see
only real tokens. Attention reads the rows' used slots through a gather (one copy of them per layer) under
a block mask, so a query sees its own row's keys only. What vLLM and transformers' continuous batching do
with varlen attention kernels; here the keys stay in the pool's rows (hetspec/kv.py), so rollback is
still a change of length. ``hetspec.forward.forward`` picks the layout by how much padding the feeds need.

A layout returns the model's inputs as plain tensors: ``visible`` [batch, queries, keys] (which key a query
sees, before the sliding window), the query and key positions, the cache the pass writes through, and
per feed the indices of its kept logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

if TYPE_CHECKING:
    from hetspec.kv import Feed, KVPool


@dataclass
class Layout:
    input_ids: torch.Tensor  # [batch, queries]
    visible: torch.Tensor  # [batch, queries, keys] bool
    query_positions: torch.Tensor  # [batch, queries]
    key_positions: torch.Tensor  # [batch, keys]
    cache: Cache
    logits_to_keep: int | torch.Tensor  # the model's argument: a count of last positions, or their indices
    kept: list[tuple[int, slice]]  # per feed: (batch index, its rows of the kept logits)


class _Layer(CacheLayerMixin):
    """One layer of one pass: writes the new keys/values into the rows' slots, returns what attention reads."""

    is_sliding = False

    def __init__(self, pool: "KVPool", index: int, pass_: "_PaddedPass | _PackedPass"):
        super().__init__()
        self.pool, self.index, self.pass_ = pool, index, pass_
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # the pool preallocates
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states: [batch, kv_heads, queries, head_dim]
        keys, values = self.pool.keys[self.index], self.pool.values[self.index]
        self.pass_.write(keys, key_states)
        self.pass_.write(values, value_states)
        return self.pass_.read(keys), self.pass_.read(values)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.pass_.keys, 0

    def get_seq_length(self) -> int:
        return self.pass_.keys - self.pass_.queries

    def get_max_length(self) -> int:
        return -1


class _PaddedPass(Cache):
    """The cache a padded pass sees: a view of some rows of the pool."""

    def __init__(self, pool: "KVPool", rows: list[int], slots: torch.Tensor, used: int):
        self.pool = pool
        self.row_index = torch.tensor(rows, dtype=torch.long, device=pool.device)[:, None]  # [batch, 1]
        self.slots = slots  # [batch, queries]
        self.queries, self.keys = slots.shape[1], used
        contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
        self.row_slice = slice(rows[0], rows[0] + len(rows)) if contiguous else None
        # a row fed alone has no padding, so its slots are a range (``padded``), written by a slice, not an index
        self.single = (rows[0], int(slots[0, 0]), int(slots[0, 0]) + slots.shape[1]) if len(rows) == 1 else None
        super().__init__(layers=[_Layer(pool, index, self) for index in range(pool.layers)])

    def write(self, buffer: torch.Tensor, states: torch.Tensor) -> None:  # states: [batch, kv_heads, queries, head_dim]
        if self.single is not None:
            row, start, end = self.single
            buffer[row, :, start:end] = states[0]
            return
        buffer[self.row_index, :, self.slots] = states.transpose(1, 2).to(buffer.dtype)

    def read(self, buffer: torch.Tensor) -> torch.Tensor:  # -> [batch, kv_heads, used, head_dim]
        if self.row_slice is not None:
            return buffer[self.row_slice, :, :self.keys]  # a view: nothing copied
        return buffer[:, :, :self.keys].index_select(0, self.row_index[:, 0])


class _PackedPass(Cache):
    """The cache a packed pass sees: the rows' used slots gathered into one sequence."""

    def __init__(self, pool: "KVPool", rows: list[int], lengths: list[int], counts: list[int]):
        self.pool = pool
        self.rows, self.lengths, self.counts = rows, lengths, counts
        self.queries, self.keys = sum(counts), sum(lengths) + sum(counts)
        super().__init__(layers=[_Layer(pool, index, self) for index in range(pool.layers)])

    def write(self, buffer: torch.Tensor, states: torch.Tensor) -> None:  # states: [1, kv_heads, queries, head_dim]
        start = 0
        for row, length, count in zip(self.rows, self.lengths, self.counts):
            buffer[row, :, length:length + count] = states[0, :, start:start + count]
            start += count

    def read(self, buffer: torch.Tensor) -> torch.Tensor:  # -> [1, kv_heads, keys, head_dim]
        # one slice a row: a copy of each row's used slots, cheaper than an index over every slot
        return torch.cat([buffer[row, :, :length + count]
                          for row, length, count in zip(self.rows, self.lengths, self.counts)], dim=1)[None]


def ancestors(parents: Sequence[int]) -> torch.Tensor:
    """[count, count] bool: token i sees token j (j is i or an ancestor of i among the fed tokens)."""
    seen = torch.eye(len(parents), dtype=torch.bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            seen[node] |= seen[parent]
    return seen


def depths(parents: Sequence[int]) -> torch.Tensor:  # [count] offset of each fed token from the first
    depth = torch.zeros(len(parents), dtype=torch.long)
    for node, parent in enumerate(parents):
        depth[node] = depth[parent] + 1 if parent >= 0 else 0
    return depth


def padded(pool: "KVPool", feeds: Sequence["Feed"]) -> Layout:
    """Each feed at the end of its row. Padding queries see only their own slot, past the row's length (a
    scratch slot), so they change nothing; a row's kept logits are then the pass's last ones."""
    fed = max(len(feed.token_ids) for feed in feeds)
    lengths = torch.tensor([feed.session.length for feed in feeds])  # [batch]
    used = int(lengths.max()) + fed
    counts = torch.tensor([len(feed.token_ids) for feed in feeds])  # [batch]
    input_ids = torch.tensor([[0] * (fed - len(feed.token_ids)) + feed.token_ids for feed in feeds])  # [batch, fed]
    query = torch.arange(fed)[None, :]
    pad = (fed - counts)[:, None]
    real = query >= pad  # [batch, fed]; padding queries come first
    # a real query's slot follows the row's tokens; a padding query writes a scratch slot past them
    slots = torch.where(real, lengths[:, None] + query - pad, lengths[:, None] + counts[:, None] + query)
    keys = torch.arange(used)
    # a chain query sees every slot up to its own; a padding query only its own
    visible = torch.where(real[:, :, None], keys <= slots[:, :, None], keys == slots[:, :, None])  # [batch, fed, used]
    query_positions = slots.clone()  # slot = position, except inside a tree
    key_positions = keys.repeat(len(feeds), 1)  # [batch, used]
    for b, feed in enumerate(feeds):
        if feed.parents is None:
            continue
        count, length, first = len(feed.token_ids), int(lengths[b]), fed - len(feed.token_ids)
        tree_positions = length + depths(feed.parents)
        query_positions[b, first:] = tree_positions
        key_positions[b, length:length + count] = tree_positions
        visible[b, first:, length:length + count] = ancestors(feed.parents)
    kept = max(feed.logits_to_keep for feed in feeds)
    cache = _PaddedPass(pool, [feed.session.row for feed in feeds], slots.to(pool.device), used)
    return Layout(input_ids, visible, query_positions, key_positions, cache, kept,
                  [(b, slice(kept - feed.logits_to_keep, kept)) for b, feed in enumerate(feeds)])


def packed(pool: "KVPool", feeds: Sequence["Feed"]) -> Layout:
    """The feeds one after another in a batch of one; each row's keys (its used slots) one after another too."""
    lengths = [feed.session.length for feed in feeds]
    counts = [len(feed.token_ids) for feed in feeds]
    used = [length + count for length, count in zip(lengths, counts)]
    batch = torch.arange(len(feeds))
    query_batch = batch.repeat_interleave(torch.tensor(counts))  # [queries] which feed a query is
    key_batch = batch.repeat_interleave(torch.tensor(used))  # [keys] whose key
    query_slots = torch.cat([torch.arange(length, end) for length, end in zip(lengths, used)])  # [queries]
    key_slots = torch.cat([torch.arange(end) for end in used])  # [keys]
    query_positions, key_positions = query_slots.clone(), key_slots.clone()  # slot = position, except in a tree
    visible = (query_batch[:, None] == key_batch[None, :]) & (key_slots[None, :] <= query_slots[:, None])
    kept, kept_indices = [], []
    query_start = key_start = 0
    for feed, length, count, end in zip(feeds, lengths, counts, used):
        if feed.parents is not None:
            tree_positions = length + depths(feed.parents)
            query_positions[query_start:query_start + count] = tree_positions
            key_positions[key_start + length:key_start + end] = tree_positions
            visible[query_start:query_start + count, key_start + length:key_start + end] = ancestors(feed.parents)
        kept.append((0, slice(len(kept_indices), len(kept_indices) + feed.logits_to_keep)))
        kept_indices += range(query_start + count - feed.logits_to_keep, query_start + count)
        query_start += count
        key_start += end
    cache = _PackedPass(pool, [feed.session.row for feed in feeds], lengths, counts)
    input_ids = torch.tensor([[token for feed in feeds for token in feed.token_ids]])  # [1, queries]
    return Layout(input_ids, visible[None], query_positions[None], key_positions[None], cache,
                  torch.tensor(kept_indices), kept)


def attention_masks(pool: "KVPool", layout: Layout) -> dict[str, Any]:
    """Additive masks [batch, 1, queries, keys] by layer type; sliding-window layers also hide keys
    ``sliding_window`` or more positions behind the query."""
    masks = {}
    for layer_type in set(pool.layer_types or ["full_attention"]):
        allowed = layout.visible
        if layer_type == "sliding_attention" and pool.sliding_window:
            # a query sees itself: its key's position is its own, always inside the window
            allowed = allowed & (layout.key_positions[:, None, :] > layout.query_positions[:, :, None] - pool.sliding_window)
        mask = torch.zeros(allowed.shape, dtype=pool.dtype).masked_fill_(~allowed, torch.finfo(pool.dtype).min)
        masks[layer_type] = mask[:, None].to(pool.device)
    return masks
