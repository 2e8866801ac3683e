"""Bit-exact passes: a position's logits do not depend on what else shares its pass (``bit_exact: true``).

The promise is "exactly what the target alone would produce". A pass computes many positions at once (a draft's
tokens, a tree's nodes, other requests' rows, a prompt's chunk); in bfloat16 a position's logits could differ in
the last bit from those of a pass that feeds that position alone after the same committed tokens, and at a
near-tie that flips a greedy token or a seeded sample. Sources of difference, each measured on this project's
CPU (AMD EPYC, AVX512-BF16, no AMX; torch 2.13; docs/losslessness.md, "Bit-exact passes"):

1. The attention kernel. ``scaled_dot_product_attention`` (torch's CPU flash kernel) splits queries into blocks
   by the query count and reduces over key blocks with vectorized sums whose grouping depends on the key count:
   the same query with the same keys gives other bits when it shares the call with more queries, or when more
   (masked) keys are read, i.e. in a padded pass beside a longer row, in a chunk of a prompt, in a packed pass.
   transformers' eager attention (two bfloat16 matmuls) is the same up to about 1,000 keys and then not: the
   probabilities-times-values matmul changes its reduction over keys with the query count.
   Fix: ``exact_attention`` computes each query alone, over exactly the keys it sees, in their order (a slice of
   the row, or a gather of a tree's ancestors): the very call a one-position pass makes.
2. Linear layers. bfloat16 ``F.linear`` gives a row the same bits among any number of rows from 2 up (checked
   2 to 513 rows on every layer shape of Qwen2.5-Coder-1.5B and Gemma-3-270M, to 2,048 on random weights, 1 or 2
   threads), but other bits for a row alone in some layers (Qwen's q and gate projections and its output layer):
   a matrix-vector kernel.
   Fix: ``NoLoneRowLinear`` computes a lone row as a pair (the row twice) and keeps one, so every row gets the
   many-rows bits; the pair costs about what the lone row did (the weights are read once either way). float32
   Linear layers differ at every width (MKL/oneDNN pick other kernels by the row count; not fixed here), so
   float32 passes are not bit-exact, and the self-check says so.
3. Everything else of a decoder layer (norms, rotary embedding, activations, residuals) is per row.

``exact_attention`` is registered as transformers attention ``"hetspec_exact"`` (with eager's masks), so a
model loaded with ``bit_exact=True`` runs it in hetspec's passes and in transformers' own ``generate`` alike.
Cost: one attention call per query and layer instead of one per layer (Python and dispatch, no extra
arithmetic); a lone row's Linear layers a second row of arithmetic: hence a switch, off by default, with the
benchmark for a quiet machine in docs/losslessness.md.

``self_check`` decides ``bit_exact`` at load: a few positions in every pass layout against one-position passes.
"""

from __future__ import annotations

import logging
import threading

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

log = logging.getLogger(__name__)

ATTENTION = "hetspec_exact"

# A query's keys: a slice of its row (start, end), or the indices of a tree's ancestors and itself, in order.
Keys = tuple[int, int] | torch.Tensor


class _LastMask(threading.local):
    """Every layer of a pass gets the same mask object: its keys per query are worked out once a pass."""

    mask: torch.Tensor | None = None
    keys: list[list[Keys | None]] = []


_last = _LastMask()


def query_keys(attention_mask: torch.Tensor | None, batch: int, queries: int, keys: int) -> list[list[Keys | None]]:
    """Per batch row and query, the keys it sees (None: none, a padding position). attention_mask:
    [batch, 1, queries, keys] bool (True: seen) or additive (0: seen, the dtype's minimum or -inf: hidden), or None
    (causal, the queries the last keys)."""
    if attention_mask is None:
        return [[(0, keys - queries + query + 1) for query in range(queries)] for _ in range(batch)]
    if attention_mask is _last.mask:
        return _last.keys
    mask = attention_mask[:, 0].expand(batch, queries, keys)  # [batch, queries, keys]
    if mask.dtype == torch.bool:
        visible = mask
    else:
        visible = mask > torch.finfo(mask.dtype).min / 2
        if not bool((mask[visible] == 0).all()):
            raise ValueError("exact attention takes masks that only hide keys (0 or the minimum), not biases")
    counts = visible.sum(-1)  # [batch, queries]
    first = visible.int().argmax(-1)
    last = keys - 1 - visible.flip(-1).int().argmax(-1)
    contiguous = (last - first + 1 == counts).tolist()
    first, last, counts = first.tolist(), last.tolist(), counts.tolist()
    result: list[list[Keys]] = []
    for row in range(batch):
        # a query that sees no key (a left-padding position of a padded batch) has no output worth computing: None
        result.append([None if not counts[row][query] else (first[row][query], last[row][query] + 1)
                       if contiguous[row][query] else visible[row, query].nonzero()[:, 0] for query in range(queries)])
    _last.mask, _last.keys = attention_mask, result
    return result


def exact_attention(module: torch.nn.Module | None, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    softcap: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention with each query computed alone over exactly the keys it sees: the bits a one-position pass
    gives it. query: [batch, heads, queries, head_dim]; key, value: [batch, kv_heads, keys, head_dim];
    -> ([batch, queries, heads, head_dim], None), transformers' attention interface."""
    if softcap is not None:
        raise NotImplementedError("exact attention has no logit soft-capping")
    if dropout:
        raise NotImplementedError("exact attention is for inference (no dropout)")
    batch, heads, queries, head_dim = query.shape
    gqa = key.shape[1] != heads
    output = query.new_empty(batch, heads, queries, value.shape[-1])
    for row, row_keys in enumerate(query_keys(attention_mask, batch, queries, key.shape[2])):
        for index, seen in enumerate(row_keys):
            if seen is None:  # sees no key (padding): zeros, where a fused kernel would give NaN or zeros
                output[row, :, index] = 0
                continue
            if isinstance(seen, tuple):
                row_key, row_value = key[row:row + 1, :, seen[0]:seen[1]], value[row:row + 1, :, seen[0]:seen[1]]
            else:  # a tree: the ancestors' keys gathered, in order, as a chain would hold them
                row_key, row_value = key[row:row + 1].index_select(2, seen), value[row:row + 1].index_select(2, seen)
            output[row:row + 1, :, index:index + 1] = F.scaled_dot_product_attention(
                query[row:row + 1, :, index:index + 1], row_key, row_value, scale=scaling, enable_gqa=gqa)
    return output.transpose(1, 2).contiguous(), None


class NoLoneRowLinear(torch.nn.Module):
    """A ``torch.nn.Linear`` that never computes a row alone: a lone row goes as a pair (itself twice), so it gets
    the bits it gets among other rows. Holds the layer's own weight (no copy)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., in_features] -> [..., out_features]
        rows = hidden.reshape(-1, self.in_features).contiguous()
        if rows.shape[0] == 1:
            output = F.linear(rows.expand(2, -1).contiguous(), self.weight, self.bias)[:1]
        else:
            output = F.linear(rows, self.weight, self.bias)
        return output.reshape(*hidden.shape[:-1], self.out_features)


def no_lone_row_linear_layers(model: torch.nn.Module) -> int:
    """Replace each ``torch.nn.Linear`` of ``model`` by a ``NoLoneRowLinear``; returns how many."""
    linears = [(name, module) for name, module in model.named_modules() if type(module) is torch.nn.Linear]
    for name, module in linears:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, NoLoneRowLinear(module))
    return len(linears)


# Row counts at which a row's bits are compared with its bits among 2 rows (the self-check's "linear rows").
ROW_COUNTS = (3, 8, 64, 257)


@torch.inference_mode()
def linear_rows_invariant(model: torch.nn.Module) -> bool:
    """Whether every distinct Linear layer of ``model`` (by shape and bias) gives a row the same bits among
    each of ``ROW_COUNTS`` rows as among 2, the row placed anywhere (the premise of ``NoLoneRowLinear``)."""
    seen: set[tuple[int, int, bool]] = set()
    generator = torch.Generator().manual_seed(0)
    for module in model.modules():
        if not isinstance(module, (torch.nn.Linear, NoLoneRowLinear)):
            continue
        shape = (module.in_features, module.out_features, module.bias is not None)
        if shape in seen:
            continue
        seen.add(shape)
        weight = module.weight
        rows = torch.randn(max(ROW_COUNTS), module.in_features, generator=generator).to(weight.dtype)
        pair = F.linear(rows[:2], weight, module.bias)[1]
        for count in ROW_COUNTS:
            block = rows[1:count + 1].clone()  # row 1 first here, so it moves within the block
            block[[0, count // 2]] = block[[count // 2, 0]]
            if not torch.equal(F.linear(block, weight, module.bias)[count // 2], pair):
                return False
    return True


AttentionInterface.register(ATTENTION, exact_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, eager_mask)


def make_exact(model: torch.nn.Module) -> None:
    """Run ``model``'s attention through ``exact_attention`` and its Linear layers as ``NoLoneRowLinear``, in
    transformers' forward, its ``generate`` and hetspec's passes alike."""
    model.set_attn_implementation(ATTENTION)
    no_lone_row_linear_layers(model)


def uses_exact_attention(model: torch.nn.Module) -> bool:
    return getattr(model.config, "_attn_implementation", None) == ATTENTION


LAYOUTS = ("chunked prompt", "lone row", "padded", "packed", "tree", "linear rows")


@torch.inference_mode()
def compare_layouts(language_model, length: int = 10) -> dict[str, bool]:
    """Per pass layout, whether each position's logits equal (``torch.equal``) those of a one-position pass after
    the same tokens. ``length`` token ids (fixed, spread over the vocabulary) are first fed one pass a position
    (the reference, and the cache every other layout starts from); then the layouts: a prompt in two chunks, a
    lone row's draft of 3, a padded and a packed pass of that draft beside a row fed 1 token, a tree of 4 nodes
    (two branches) whose path nodes are checked. Uses and frees a few rows of the model's KV pool."""
    from hetspec.forward import forward  # neither imports this module; loaded lazily all the same
    from hetspec.kv import Feed

    vocab = language_model.vocab_size
    ids = [(7919 * (index + 1)) % (vocab - 2) + 1 for index in range(length)]
    other_ids = [(104729 * (index + 3)) % (vocab - 2) + 1 for index in range(length)]
    sessions = []

    def session(prefix: list[int]):
        """A session with ``prefix`` cached, fed one position a pass."""
        new = language_model.new_session()
        sessions.append(new)
        for token in prefix:
            new.extend([token])
        return new

    def same(logits: torch.Tensor, first: int) -> bool:  # logits: [kept, vocab] of positions first..
        return all(torch.equal(row, reference[first + index]) for index, row in enumerate(logits))

    try:
        lone = session([])
        reference = [lone.extend([token])[0] for token in ids]  # each: [vocab], position index's logits
        split = length // 2
        chunked = session([])
        results = {"chunked prompt": same(chunked.extend(ids[:split]), 0) and same(chunked.extend(ids[split:]), split)}
        start = length - 4
        results["lone row"] = same(session(ids[:start]).extend(ids[start:start + 3]), start)
        for name, packed in (("padded", False), ("packed", True)):
            row, beside = session(ids[:start]), session(other_ids[:length - 2])
            feeds = [Feed(beside, [other_ids[length - 2]], 1), Feed(row, ids[start:start + 3], 3)]
            logits = forward(language_model, feeds, packed=packed)
            results[name] = same(logits[1], start)
        # nodes: ids[start] (root), a sibling, ids[start + 1] under the root, ids[start + 2] under that
        tree = session(ids[:start])
        logits = tree.extend_tree([ids[start], other_ids[0], ids[start + 1], ids[start + 2]], [-1, -1, 0, 2])
        results["tree"] = same(logits[[0, 2, 3]], start)
        results["linear rows"] = linear_rows_invariant(language_model.model)
        return results
    finally:
        for used in sessions:
            used.release()


def self_check(language_model) -> bool:
    """``compare_layouts`` at load: True when every layout gives every position a one-position pass's bits.
    Logged either way; a False names the layouts that differ."""
    results = compare_layouts(language_model)
    differ = [name for name, equal in results.items() if not equal]
    if differ:
        log.warning("hetspec: %s: passes are not bit-exact here (%s differ from one-position passes); outputs are "
                    "exact up to ties at the last bit (docs/losslessness.md)", language_model.name, ", ".join(differ))
    else:
        log.info("hetspec: %s: bit_exact: every pass layout gives a position the bits of a one-position pass",
                 language_model.name)
    return not differ
