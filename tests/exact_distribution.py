"""The exact output distribution of a seeded decoder, by enumerating every outcome of its random numbers.

Every number ``hetspec.sampling.uniform(seed, stream, position, draft_round)`` hands out becomes a symbolic
uniform on [0, 1): a ``Symbol`` naming its key. The two functions that read such a number, ``sample_from``
(inverse CDF) and ``accepts`` (rejection sampling's coin), branch on it instead: each outcome they can have
is the sub-interval of the number's current interval that produces it, taken with probability
(its length / the current length), and the number's interval narrows to it. A number used twice (the same
key, as the seeded hash makes it) is therefore consistent between its uses, exactly as the real hash is.
Any other use of a Symbol raises, so no random number can escape the enumeration.
The outcome intervals mirror ``hetspec.sampling.sample_from`` and ``accepts``: a change to either must be
made here too (the exact tests then fail until it is).

The decoder is re-run from the start once per path (depth first over the branch choices), so the models'
state needs no copying; the result is the probability of every outcome the run returns, summed exactly
(up to float rounding of the interval ends) over the paths that produce it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Hashable, Iterator

import hetspec.sampling as sampling
import torch

ORIGINAL = {"uniform": sampling.uniform, "sample_from": sampling.sample_from, "accepts": sampling.accepts}


@dataclass(frozen=True)
class Symbol:
    """A uniform random number on [0, 1), known only by its key (seed, stream, position, draft_round)."""

    key: tuple

    def __float__(self):
        raise TypeError("a symbolic random number was read outside sample_from/accepts")


class Enumeration:
    """Replays a decoder over every branch of its random numbers; ``distribution`` is the entry point."""

    def __init__(self) -> None:
        self.script: tuple[int, ...] = ()
        self.taken: list[int] = []
        self.pending: list[tuple[int, ...]] = []
        self.intervals: dict[tuple, tuple[float, float]] = {}
        self.weight = 1.0
        self.paths = 0

    # -- the patched functions ----------------------------------------------------------------------------

    def uniform(self, seed: int, stream, position: int, draft_round: int = 0) -> Symbol:
        return Symbol((seed, int(stream), position, draft_round))

    def sample_from(self, probs: torch.Tensor, u) -> int:
        if not isinstance(u, Symbol):
            return ORIGINAL["sample_from"](probs, u)
        cumulative = torch.cumsum(probs.double(), dim=0)
        total = float(cumulative[-1])
        ends = (cumulative / total).tolist()
        starts = [0.0] + ends[:-1]
        outcomes = [(token, starts[token], ends[token]) for token in torch.nonzero(probs > 0).flatten().tolist()]
        outcomes[-1] = (outcomes[-1][0], outcomes[-1][1], 1.0)  # the last token with mass takes the rounding
        return self._branch(u, outcomes)

    def accepts(self, coin, target_prob: float, draft_prob: float) -> bool:
        if not isinstance(coin, Symbol):
            return ORIGINAL["accepts"](coin, target_prob, draft_prob)
        if draft_prob <= 0:
            threshold = 1.0 if target_prob > 0 else 0.0
        else:
            threshold = min(1.0, target_prob / draft_prob)
        return self._branch(coin, [(True, 0.0, threshold), (False, threshold, 1.0)])

    def _branch(self, number: Symbol, outcomes: list[tuple[object, float, float]]):
        low, high = self.intervals.get(number.key, (0.0, 1.0))
        live = [(value, max(low, start), min(high, end)) for value, start, end in outcomes]
        live = [(value, start, end) for value, start, end in live if end > start]
        assert live, "a number's interval lies outside every outcome"
        depth = len(self.taken)
        if depth < len(self.script):
            choice = self.script[depth]
        else:
            choice = 0
            self.pending.extend(tuple(self.taken) + (other,) for other in range(1, len(live)))
        self.taken.append(choice)
        value, start, end = live[choice]
        self.weight *= (end - start) / (high - low)
        self.intervals[number.key] = (start, end)
        return value

    # -- driving --------------------------------------------------------------------------------------------

    def distribution(self, run: Callable[[], Hashable], max_paths: int = 200_000) -> dict[Hashable, float]:
        """Probability of each outcome of ``run()`` over all its random numbers."""
        result: dict[Hashable, float] = {}
        self.pending = [()]
        with patched(self):
            while self.pending:
                self.script, self.taken, self.intervals, self.weight = self.pending.pop(), [], {}, 1.0
                outcome = run()
                result[outcome] = result.get(outcome, 0.0) + self.weight
                self.paths += 1
                assert self.paths <= max_paths, "too many paths to enumerate"
        return result


class patched:
    """Every hetspec module's ``uniform``, ``sample_from`` and ``accepts`` replaced by the enumeration's
    (modules import them by name, so each importing module is patched)."""

    def __init__(self, enumeration: Enumeration):
        self.replacements = {name: getattr(enumeration, name) for name in ORIGINAL}
        self.undo: list[tuple[object, str, object]] = []

    def __enter__(self):
        for module in _hetspec_modules():
            for name, replacement in self.replacements.items():
                if getattr(module, name, None) is ORIGINAL[name]:
                    self.undo.append((module, name, ORIGINAL[name]))
                    setattr(module, name, replacement)
        return self

    def __exit__(self, *exc):
        for module, name, original in reversed(self.undo):
            setattr(module, name, original)


def _hetspec_modules() -> Iterator[object]:
    for name, module in list(sys.modules.items()):
        if module is not None and (name == "hetspec" or name.startswith("hetspec.")):
            yield module


def total_variation(first: dict, second: dict) -> float:
    return 0.5 * sum(abs(first.get(key, 0.0) - second.get(key, 0.0)) for key in set(first) | set(second))
