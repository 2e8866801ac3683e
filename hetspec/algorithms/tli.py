"""TLI: token-level intersection (Timor et al. 2025, Alg. 4).

The drafter's distribution is cut to the tokens whose bytes are also one target token, renormalised,
and moved onto the target vocabulary; drafts are then target tokens, verified by standard speculative
sampling against exactly that distribution, which is what keeps it lossless.
"""

from __future__ import annotations

import torch

from hetspec.algorithms.base import Algorithm, Draft, DrafterSide
from hetspec.passes import Steps
from hetspec.config import SamplingParams
from hetspec.sampling import Stream, logits_to_probs, sample_from, uniform


class TokenLevelIntersection(Algorithm):
    name = "tli"
    exact = False

    @property
    def needs_drafter(self) -> bool:
        return True

    def drafter_to_target(self) -> torch.Tensor:  # [drafter_vocab] target id or -1
        return self.maps.intersection

    def feed(self, drafter: DrafterSide, committed: bytes, target_id: int) -> bool:
        """Put the drafted target token's text into the drafter's context; False ends the draft."""
        drafter_id = int(self.maps.intersection_inverse[target_id])
        drafter.context.push(drafter_id)
        return True

    def draft(self, drafter: DrafterSide, committed: bytes, k: int, params: SamplingParams,
              first_position: int, draft_round: int) -> Steps:
        drafter.sync(committed)
        forwards_before = drafter.forwards
        mapping = self.drafter_to_target()
        mapped = mapping >= 0
        target_vocab = self.maps.target.vocab_size
        candidates: list[int] = []
        rows: list[torch.Tensor] = []
        text = committed
        for step in range(k):
            logits = (yield from drafter.next_logits()).masked_fill(~mapped, float("-inf"))
            if params.greedy:
                drafter_id = int(torch.argmax(logits))
                target_id = int(mapping[drafter_id])
                top = float(torch.softmax(logits, -1).max()) if self.speculation.confidence_threshold else 1.0
            else:
                drafter_probs = logits_to_probs(logits, params.temperature, params.top_k, params.top_p)
                # [target_vocab]: the distribution the candidate is drawn from, pushed through the map
                draft_probs = torch.zeros(target_vocab).index_add_(0, mapping[mapped], drafter_probs[mapped])
                noise = uniform(params.seed, Stream.DRAFT, first_position + step, draft_round)
                target_id = sample_from(draft_probs, noise)
                top = float(drafter_probs.max())
            if self._stop_early(top, step):
                break
            candidates.append(target_id)
            if not params.greedy:
                rows.append(draft_probs)
            spelling = self.maps.target_table[target_id]
            if spelling is None:  # EOS or another special token: the target decides; nothing follows it
                break
            text += spelling
            if step + 1 < k and not self.feed(drafter, text, target_id):
                break
        draft_probs = torch.stack(rows) if rows else None
        return Draft(candidates=candidates, draft_probs=draft_probs,
                     drafter_forwards=drafter.forwards - forwards_before)
