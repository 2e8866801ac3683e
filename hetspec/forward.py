"""One batched pass of a model over a ragged set of KV rows (``hetspec.kv``), and the choice of its layout.

The pass is laid out padded (rows of equal width; the keys read in place) or packed (one sequence, no padding;
the keys gathered), whichever costs less: hetspec/layouts.py.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from hetspec import layouts
from hetspec.kv import Feed, KVPool


class PassModel(Protocol):
    """What a pass needs of a model (``hetspec.models.LanguageModel`` is one)."""

    model: Any  # a transformers causal LM
    lean: Any  # a hetspec.lean.LeanDecoder (it imports hetspec.exact, which runs passes: no import here), or None

    @property
    def kv_pool(self) -> KVPool: ...


# A padded pass of more than this many times the feeds' real tokens is run packed (hetspec/layouts.py): the
# gather that packing costs is small beside linear layers computing that much padding.
PACK_ABOVE_PADDING = 1.5


@torch.inference_mode()
def forward(language_model: PassModel, feeds: list[Feed], packed: bool | None = None) -> list[torch.Tensor]:
    """One batched pass over the feeds' sessions (distinct) of ``language_model``; ``packed``: the layout
    (hetspec/layouts.py), None picks packed where padding would cost more than ``PACK_ABOVE_PADDING`` times
    the real tokens. Returns per feed its float32 logits  # [logits_to_keep, vocab]
    """
    if not feeds or any(not feed.token_ids for feed in feeds):
        raise ValueError("every feed needs at least one token")
    if len({id(feed.session) for feed in feeds}) != len(feeds):
        raise ValueError("a pass feeds each session at most once")
    pool = language_model.kv_pool
    for feed in feeds:
        if feed.session.row is None:
            feed.session.row = pool.take_row()
    order = sorted(range(len(feeds)), key=lambda index: feeds[index].session.row)  # contiguous rows read as a view
    feeds = [feeds[index] for index in order]
    counts = [len(feed.token_ids) for feed in feeds]
    if packed is None:
        packed = len(feeds) * max(counts) > PACK_ABOVE_PADDING * sum(counts)
    # each row's cached tokens and the pass's widest feed: a padded pass writes that far in every row (padding)
    pool.reserve_rows({feed.session.row: feed.session.length + max(counts) for feed in feeds})
    layout = (layouts.packed if packed else layouts.padded)(pool, feeds)
    device = pool.device
    kept = layout.logits_to_keep if isinstance(layout.logits_to_keep, int) else layout.logits_to_keep.to(device)
    lean = language_model.lean
    # the lean forward needs no mask where every query sees every key (a request alone, one token)
    masks = None if lean is not None and layout.visible.all() else layouts.attention_masks(pool, layout)
    with pool.guard.shared():
        if lean is not None:
            logits = lean(input_ids=layout.input_ids.to(device), position_ids=layout.query_positions.to(device),
                          attention_mask=masks and masks["full_attention"], cache=layout.cache, logits_to_keep=kept)
        else:
            logits = language_model.model(
                input_ids=layout.input_ids.to(device), cache=layout.cache, use_cache=True,
                position_ids=layout.query_positions.to(device),
                attention_mask=masks if pool.layer_types else masks["full_attention"], logits_to_keep=kept).logits
    # logits: [batch, kept, vocab]
    results: list[torch.Tensor] = [None] * len(feeds)  # type: ignore[list-item]
    for (b, rows), feed, index in zip(layout.kept, feeds, order):
        feed.session.length += len(feed.token_ids)
        results[index] = logits[b, rows].float()
    return results
