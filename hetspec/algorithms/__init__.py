"""Algorithms by name. ``auto`` picks standard SD for identical tokenizers, else SLEM for greedy and TLI for sampling."""

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
    if name != "auto":
        if name not in ALGORITHM_CLASSES:
            raise ValueError(f"unknown algorithm {name!r}; choose one of auto, {', '.join(ALGORITHM_CLASSES)}")
        if name != "ar" and maps is None:
            raise ValueError(f"algorithm {name!r} needs a drafter model")
        return name
    if maps is None:
        return "ar"
    if maps.same_vocabulary:
        return "sd"
    return "slem" if params.greedy else "tli"


def make_algorithm(name: str, maps: PairMaps | None, speculation: SpeculationConfig,
                   params: SamplingParams) -> Algorithm:
    return ALGORITHM_CLASSES[resolve_name(name, maps, params)](maps, speculation)


__all__ = ["ALGORITHM_CLASSES", "Algorithm", "Draft", "DrafterSide", "EnumerationBudgetExceeded", "PairMaps",
           "make_algorithm", "resolve_name"]
