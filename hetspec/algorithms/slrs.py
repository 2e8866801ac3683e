"""SLRS: string-level rejection sampling (Timor et al. 2025, Alg. 3), one-drafter-token stopping rule.

The drafter proposes one of its tokens d; the candidate is t(d), the first target token of d's string.
psi(t), the probability of proposing t, is the scatter-add of the drafter distribution over
{d : t(d) = t}: exact, never approximated. Drafter tokens that stand for no valid string on their own
are excluded and the distribution renormalised, so psi is exactly what candidates are drawn from.
Verification is speculative sampling against psi (accept min(1, target/psi), residual max(0, target - psi)).

Lookahead over several drafter tokens needs psi summed over every drafter sequence: that enumeration is
done exactly for small vocabularies and refused above ``slrs_enumeration_budget``.
"""

from __future__ import annotations

import torch

from hetspec.algorithms.base import DrafterSide
from hetspec.algorithms.tli import TokenLevelIntersection
from hetspec.align import complete_utf8_length


class EnumerationBudgetExceeded(ValueError):
    """Exact psi would need more drafter sequences than the configured budget."""


class StringLevelRejectionSampling(TokenLevelIntersection):
    name = "slrs"

    def __init__(self, maps, speculation):
        super().__init__(maps, speculation)
        if speculation.slrs_lookahead > 1 and maps is not None:
            sequences = maps.drafter.vocab_size ** speculation.slrs_lookahead
            if sequences > speculation.slrs_enumeration_budget:
                raise EnumerationBudgetExceeded(
                    f"SLRS with slrs_lookahead={speculation.slrs_lookahead} must enumerate "
                    f"{maps.drafter.vocab_size}^{speculation.slrs_lookahead} = {sequences:,} drafter sequences "
                    f"to compute psi exactly, above slrs_enumeration_budget={speculation.slrs_enumeration_budget:,}; "
                    "use slrs_lookahead=1 or a drafter with a smaller vocabulary")
            raise NotImplementedError("slrs_lookahead > 1 within the budget is not implemented yet")

    def drafter_to_target(self) -> torch.Tensor:
        return self.maps.first_target_token

    def feed(self, drafter: DrafterSide, committed: bytes, target_id: int) -> bool:
        drafter_id = int(self.maps.intersection_inverse[target_id])
        if drafter_id >= 0:
            drafter.context.push(drafter_id)
            return True
        if complete_utf8_length(committed) != len(committed):
            return False  # the candidate ends inside a character: the drafter cannot continue from it
        drafter.sync(committed)  # t is a prefix of the drafter token's string: re-tokenize that text
        return True
