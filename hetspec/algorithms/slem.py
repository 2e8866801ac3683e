"""SLEM: string-level exact match (Timor et al. 2025, Alg. 2).

The drafter writes k of its own tokens; their string is re-tokenized by the target tokenizer together
with a window of committed target tokens (``align.target_candidates``); the target keeps the longest
prefix equal to its own choices (argmax, or its seeded sample). Lossless for any draft: only tokens the
target itself would have chosen are ever kept.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hetspec.algorithms.base import Algorithm, Draft, DrafterSide
from hetspec.align import complete_utf8_length, target_candidates
from hetspec.config import SamplingParams
from hetspec.sampling import Stream, logits_to_probs, sample_from, uniform


class StringLevelExactMatch(Algorithm):
    name = "slem"
    exact = True

    @property
    def needs_drafter(self) -> bool:
        return True

    def draft(self, drafter: DrafterSide, committed: bytes, k: int, params: SamplingParams,
              first_position: int) -> Draft:
        drafter.sync(committed)
        forwards_before = drafter.forwards
        table = drafter.context.table
        drafted = bytearray()
        for step in range(k):
            logits = drafter.next_logits()
            if params.greedy:
                probs = torch.softmax(logits, dim=-1) if self.speculation.confidence_threshold else None
                token = int(torch.argmax(logits))
            else:
                probs = logits_to_probs(logits, params.temperature, params.top_k, params.top_p)
                # Any draft is lossless here. Drawing with the target's own numbers for these positions makes a
                # drafter that agrees with the target draw the very token the target will draw.
                token = sample_from(probs, uniform(params.seed, Stream.TARGET, first_position + step))
            if probs is not None and self._stop_early(float(probs.max()), step):
                break
            if table[token] is None:  # EOS or another special token: the string ends here
                break
            drafter.context.push(token)
            drafted += table[token]
        usable = bytes(drafted[:complete_utf8_length(bytes(drafted))])
        return Draft(text=usable, drafter_forwards=drafter.forwards - forwards_before)

    def align(self, draft: Draft, committed_target_ids: Sequence[int]) -> Draft:
        if draft.text:
            draft.candidates = target_candidates(self.maps.encode_target, self.maps.target_table,
                                                 committed_target_ids, draft.text.decode("utf-8"),
                                                 self.speculation.alignment_window)
        return draft
