"""``ar``: the target alone, one token per forward pass. The reference every algorithm must reproduce."""

from hetspec.algorithms.base import Algorithm


class TargetOnly(Algorithm):
    name = "ar"
