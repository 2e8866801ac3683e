"""Algorithms by name. ``auto`` picks SLEM (exact matching) for greedy requests and for sampled requests that carry
a seed, otherwise standard SD for identical tokenizers and TLI for different ones (``resolve_name``)."""

from __future__ import annotations

from hetspec.algorithms.ar import TargetOnly
from hetspec.algorithms.base import Algorithm, Draft, DrafterSide, PairMaps
from hetspec.algorithms.sd import StandardSpeculativeDecoding
from hetspec.algorithms.slem import StringLevelExactMatch
from hetspec.algorithms.slrs import EnumerationBudgetExceeded, StringLevelRejectionSampling
from hetspec.algorithms.tli import TokenLevelIntersection
from hetspec.config import SamplingParams, SpeculationConfig

ALGORITHM_CLASSES: dict[str, type[Algorithm]] = {
    cls.name: cls for cls in (TargetOnly, StandardSpeculativeDecoding, StringLevelExactMatch,
                              TokenLevelIntersection, StringLevelRejectionSampling)
}


def resolve_name(name: str, maps: PairMaps | None, params: SamplingParams) -> str:
    """The algorithm ``name`` runs as. ``auto``: ar without a drafter; SLEM where the output must be the target's
    own choices token for token whatever the draft (greedy, or sampling with a client's seed: SLEM verifies each
    position against the target's seeded sample, so seed s gives the target-only ``ar`` sample for seed s at any
    draft length, load or batch); otherwise (sampling with no seed given) standard SD for identical tokenizers,
    TLI for different ones, whose rejection sampling accepts more but draws a sample that depends on the draft.
    ``params.seed`` is the client's seed: resolve before ``SamplingParams.seeded`` draws one."""
    if name != "auto":
        if name not in ALGORITHM_CLASSES:
            raise ValueError(f"unknown algorithm {name!r}; choose one of auto, {', '.join(ALGORITHM_CLASSES)}")
        if name != "ar" and maps is None:
            raise ValueError(f"algorithm {name!r} needs a drafter model")
        return name
    if maps is None:
        return "ar"
    if params.seed is not None and not params.greedy:
        return "slem"
    if maps.same_vocabulary:
        return "sd"
    return "slem" if params.greedy else "tli"


def make_algorithm(name: str, maps: PairMaps | None, speculation: SpeculationConfig,
                   params: SamplingParams) -> Algorithm:
    return ALGORITHM_CLASSES[resolve_name(name, maps, params)](maps, speculation)


__all__ = ["ALGORITHM_CLASSES", "Algorithm", "Draft", "DrafterSide", "EnumerationBudgetExceeded", "PairMaps",
           "make_algorithm", "resolve_name"]
