"""One KV cache per model, shared by its requests: each request holds a row, batched passes feed many rows.

Layout: per layer a preallocated keys and a values buffer [rows, kv_heads, capacity, head_dim]. A request
(``KVSession``) owns one row and a length: its tokens sit in slots 0..length-1 of that row, in order, so
slot = position. Rollback to the accepted prefix only lowers the length (nothing is copied); a token
tree's accepted path is compacted inside the row (``keep``). A batched pass (``forward``) feeds a ragged
set of rows: row b's n_b new tokens are written at slots length_b.., each query attends to its row's
slots through an explicit mask, so different lengths, candidate counts and trees share one pass. The
pass is laid out padded (rows of equal width; the keys read in place) or packed (one sequence, no
padding; the keys gathered), whichever costs less: hetspec/layouts.py.

Why not transformers' ``DynamicCache`` per request (what this replaced): a batched pass needs one tensor
over all rows, so per-request caches would be stacked (copied) every step, and ``DynamicCache`` itself
concatenates (copies) the whole cache on every update. Why not transformers' paged continuous-batching
cache: it is tied to its own scheduler and attention kernels and has no rollback of rejected tokens.

Sliding-window layers (Gemma 3) keep every slot too: the mask hides keys ``sliding_window`` or more
positions behind the query, as the model's own mask does, so a rollback is possible at any length.
The price is memory that grows with the context instead of being capped at the window.

Capacity (slots per row) and rows grow by doubling (one copy, amortized), but never past the pool's
``budget_bytes`` by doubling: near it they grow to what the budget allows, beyond it exactly to what the passes
need. Every row is as wide as the widest, so a long request widens the short ones' rows too: when a session
leaves and the rows still taken need at most half the buffers (or the buffers exceed the budget), they shrink to
those rows' need (one copy of the remaining rows), and the buffers are freed when the last session closes.
Memory per token: ``bytes_per_token``; per request: ``KVSession.nbytes``; the pool's: ``reserved_bytes``.

This module is the storage alone: which row a request holds and how long it is. A pass over rows is
``hetspec.forward``, the scheduling of many computations' passes ``hetspec.passes``, a prompt's chunks
``hetspec.prefill``. The pool reads its shapes from a model's config but holds no model: a session runs its
own passes through the ``run_pass`` its model gave it (``LanguageModel.new_session``).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from transformers import DynamicCache


class _SharedExclusive:
    """Many passes at once (they write disjoint rows), or one resize alone."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._shared = 0
        self._exclusive = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._condition:
            self._condition.wait_for(lambda: not self._exclusive)
            self._shared += 1
        try:
            yield
        finally:
            with self._condition:
                self._shared -= 1
                self._condition.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._condition:
            self._condition.wait_for(lambda: not self._exclusive and self._shared == 0)
            self._exclusive = True
        try:
            yield
        finally:
            with self._condition:
                self._exclusive = False
                self._condition.notify_all()


class KVPool:
    """The buffers of one model and which rows are taken."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        """Shapes from ``model``'s config, the dtype from its embeddings; the pool keeps no reference to it."""
        config = model.config.get_text_config()
        self.layers = config.num_hidden_layers
        self.kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.dtype = model.get_input_embeddings().weight.dtype  # int8-quantized models keep float32 activations
        self.device = device
        self.layer_types: list[str] | None = getattr(config, "layer_types", None)
        self.sliding_window: int | None = getattr(config, "sliding_window", None)
        self.keys: list[torch.Tensor] = []  # per layer [rows, kv_heads, capacity, head_dim]
        self.values: list[torch.Tensor] = []
        self.rows = 0
        self.capacity = 0
        self.taken: set[int] = set()
        # per taken row, the slots its latest pass reserved (its cached tokens and that pass's writes): a shrink
        # keeps them all; a row not fed yet needs none
        self.needs: dict[int, int] = {}
        # most bytes the buffers may take by doubling (None: no bound); the server sets it from its KV budget
        self.budget_bytes: int | None = None
        self.reallocations = 0  # times the buffers were allocated anew (growth or shrink: each copies the rows held)
        self.guard = _SharedExclusive()
        self._rows_lock = threading.Lock()

    @property
    def bytes_per_token(self) -> int:
        """Keys and values of one token over all layers."""
        element = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.layers * self.kv_heads * self.head_dim * element

    @property
    def reserved_bytes(self) -> int:
        return self.rows * self.capacity * self.bytes_per_token

    def take_row(self) -> int:
        with self._rows_lock:
            row = next(index for index in range(len(self.taken) + 1) if index not in self.taken)
            self.taken.add(row)
        self.reserve(row + 1, self.capacity)
        return row

    def give_row(self, row: int) -> None:
        with self._rows_lock:
            self.taken.discard(row)
            self.needs.pop(row, None)
            resize = not self.taken or self._shrunk() is not None
        if resize:
            # the check and the resize under the rows lock too: a row taken between them (a request opening as the
            # last one closes) found the buffers still there (``reserve`` returned at once), then lost them, and its
            # pass failed with an IndexError; a pass records its needs under it (``reserve_rows``), so a shrink
            # keeps every slot a pass about to run was promised
            with self.guard.exclusive(), self._rows_lock:
                if not self.taken:  # nobody took a row meanwhile: free the memory
                    self.keys, self.values, self.rows, self.capacity = [], [], 0, 0
                elif (shape := self._shrunk()) is not None:
                    self._reallocate(*shape)

    def _shrunk(self) -> tuple[int, int] | None:
        """(rows, capacity) of the rows still taken at the widest one's need, if that at least halves the buffers
        or they exceed the budget (the longest session has left); else None. Under the rows lock."""
        rows = max(self.taken) + 1
        capacity = max(self.needs.get(row, 0) for row in self.taken)
        smaller = rows * capacity * self.bytes_per_token
        over_budget = self.budget_bytes is not None and self.reserved_bytes > self.budget_bytes
        if smaller < self.reserved_bytes and (2 * smaller <= self.reserved_bytes or over_budget):
            return rows, capacity
        return None

    def reserve_rows(self, needs: dict[int, int]) -> None:
        """Slots ``needs[row]`` in each row (row -> its cached tokens plus what the pass writes), recorded so that
        a shrink keeps them; grows the buffers where they lack (``reserve``)."""
        with self._rows_lock:
            self.needs.update(needs)
        self.reserve(max(needs) + 1, max(needs.values()))

    @torch.inference_mode()
    def reserve(self, rows: int, capacity: int) -> None:
        """At least ``rows`` rows of ``capacity`` slots. Growth doubles (one copy of the used buffers each time),
        but not past ``budget_bytes``: near it to what the budget allows, beyond it exactly to ``rows`` x
        ``capacity`` (the budget is the server's to keep, by admission; a pass never fails for it)."""
        if rows <= self.rows and capacity <= self.capacity:
            return
        with self.guard.exclusive():
            rows, capacity = max(self.rows, rows), max(self.capacity, capacity)
            if rows == self.rows and capacity == self.capacity:
                return
            new_rows = rows if rows == self.rows else max(rows, 2 * self.rows)
            new_capacity = capacity if capacity == self.capacity else max(capacity, 2 * self.capacity, 64)
            if self.budget_bytes is not None and new_rows * new_capacity * self.bytes_per_token > self.budget_bytes:
                # near the budget: rows exactly, the slots as many as the budget leaves (at least those needed)
                new_rows = rows
                allowed = self.budget_bytes // (new_rows * self.bytes_per_token)
                new_capacity = max(capacity, min(new_capacity, allowed))
            self._reallocate(new_rows, new_capacity)

    def _reallocate(self, rows: int, capacity: int) -> None:
        """Buffers of ``rows`` x ``capacity`` holding the old ones' slots that fit. Holds the guard exclusively."""
        shape = (rows, self.kv_heads, capacity, self.head_dim)
        kept_rows, kept_slots = min(rows, self.rows), min(capacity, self.capacity)
        with torch.inference_mode():
            for buffers in (self.keys, self.values):
                old = list(buffers) or [None] * self.layers
                buffers.clear()
                for previous in old:
                    grown = torch.zeros(shape, dtype=self.dtype, device=self.device)
                    if previous is not None:
                        grown[:kept_rows, :, :kept_slots] = previous[:kept_rows, :, :kept_slots]
                    buffers.append(grown)
        self.rows, self.capacity = rows, capacity
        self.reallocations += 1


@dataclass
class Feed:
    """Tokens to feed after a session's cached ones and how many of their logits to return.

    ``parents`` makes the tokens a tree (``hetspec.tree``: index of each token's parent among these tokens,
    -1 for the cache's last token); None feeds a chain. Row i of the logits predicts the token after
    ``token_ids[len(token_ids) - logits_to_keep + i]``.
    """

    session: "KVSession"
    token_ids: list[int]
    logits_to_keep: int = 1
    parents: list[int] | None = None


class KVSession:
    """One request's cache on one model: a row of the model's ``KVPool``; ``length`` tokens are cached."""

    def __init__(self, pool: KVPool, run_pass: Callable[[list[Feed]], list[torch.Tensor]]):
        """``run_pass``: one batched pass of the session's model over feeds (``hetspec.forward.forward``)."""
        self.pool = pool
        self.run_pass = run_pass
        self.row: int | None = None
        self.length = 0

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values this request's tokens hold."""
        return self.length * self.pool.bytes_per_token

    def extend(self, token_ids: list[int], logits_to_keep: int | None = None) -> torch.Tensor:
        """Feed ``token_ids`` after the cached ones (a pass of this row alone).  -> [kept, vocab] float32"""
        kept = len(token_ids) if logits_to_keep is None else logits_to_keep
        return self.run_pass([Feed(self, list(token_ids), kept)])[0]

    def extend_tree(self, token_ids: list[int], parents: list[int], logits_to_keep: int | None = None) -> torch.Tensor:
        """Feed a token tree (``Feed.parents``); its slots stay in feeding order until ``keep``.  -> [kept, vocab]"""
        if len(parents) != len(token_ids):
            raise ValueError("extend_tree needs one parent per token")
        kept = len(token_ids) if logits_to_keep is None else logits_to_keep
        return self.run_pass([Feed(self, list(token_ids), kept, list(parents))])[0]

    @torch.inference_mode()
    def keep(self, positions: list[int]) -> None:
        """Keep only the cached tokens at ``positions`` (increasing), in that order: one path of a fed tree."""
        if any(b <= a for a, b in zip(positions, positions[1:])) or (positions and positions[-1] >= self.length):
            raise ValueError(f"positions to keep must increase and lie below {self.length}")
        start = next((index for index, position in enumerate(positions) if position != index), len(positions))
        if start < len(positions):  # move only the tail that changes place, inside this row
            pool = self.pool
            index = torch.tensor(positions[start:], dtype=torch.long, device=pool.device)
            with pool.guard.shared():
                for buffer in pool.keys + pool.values:
                    buffer[self.row, :, start:len(positions)] = buffer[self.row].index_select(1, index)
        self.length = len(positions)

    def rollback(self, length: int) -> None:
        """Drop every cached token after the first ``length`` (a rejected draft's keys and values)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back a cache of {self.length} tokens to {length}")
        self.length = length

    @torch.inference_mode()
    def copy_to_dynamic_cache(self) -> DynamicCache:
        """This row's cached tokens as a transformers ``DynamicCache`` of batch 1 (a copy), for passes that
        branch the context many ways at once (SLRS's lookahead enumeration)."""
        pool = self.pool
        cache = DynamicCache()
        with pool.guard.shared():
            for layer in range(pool.layers):
                cache.update(pool.keys[layer][self.row:self.row + 1, :, :self.length].clone(),
                             pool.values[layer][self.row:self.row + 1, :, :self.length].clone(), layer)
        return cache

    def release(self) -> None:
        if self.row is not None:
            self.pool.give_row(self.row)
        self.row, self.length = None, 0

