"""Load-adaptive draft length: each step's k (0 = plain batched decoding) from measured costs and acceptance.

Speculation pays while the target's pass is nearly free to widen: one pass costs about the same for 1 token
as for 4. In a batch, every drafted token widens the target pass of every row and every draft position is
a drafter pass, so at some batch size plain decoding wins. The policy (docs/batching.md):

- cost model, refitted every step by least squares over this decoder's recent passes and its last target passes
  that fed drafts (kept however old, since at k = 0 they come only from exploring steps):
  target pass seconds = a + b * tokens fed;  drafter pass seconds = c + d * rows drafting (each fitted to the
  widths' median seconds: a drafter call that first catches a request's context up prices its passes several
  times too high; while every drafter pass has the same rows, as at one client, c follows their median with the
  last d: kept at its first sample instead, the drafter stayed priced at 0.09-0.13 s a pass against 0.035 s);
- request r accepts each drafted token with probability alpha_r, so a draft of k commits
  E_r(k) = 1 + alpha_r + ... + alpha_r^k tokens in expectation (1 for k = 0); alpha_r is the value for which
  that model gives the mean accepted tokens per draft the request's drafter drafts have had at their mean length
  (acceptance comes in runs: a per-token rate accepted / drafted would underprice long drafts), with one
  pseudo-draft at alpha = 0.5 among them (``acceptance``);
- the step's k maximises  sum_r E_r(min(k, k_r)) / (T(sum_r (1 + min(k, k_r))) + k * D(drafting rows)),
  with k_r the request's own draft length (``DraftLength``), over k = 0 .. max k_r.

Until both models have been timed at two different widths, it alternates the configured k and k = 0 to
measure them. After that an exploring step now and then drafts the configured k again, so the fit keeps two
widths and acceptance keeps being measured: EXPLORE steps apart at first, twice as far after each exploring
step that leaves the choice where it was (up to EXPLORE_MAX), EXPLORE again once the choice moves. Where no
draft pays, each exploring step is a wide pass that commits little: with one in every 8 the server reached
0.81-0.91x of plain decoding in float32 on a 2-core CPU (benchmarks/results/serve-scaling-load-adaptive-rounds-f32).
It changes which tokens are drafted, never which are output.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Sequence

import torch

WINDOW = 64  # recent passes kept for the fit
DRAFTED_KEPT = 16  # target passes that fed drafts, kept for the fit however old: at k = 0 they are rare
EXPLORE = 8  # steps between exploring steps at first and after the choice moves
EXPLORE_MAX = 128  # the longest interval, reached while the choice holds


def acceptance(accepted: int, drafted: int, drafts: int) -> float:
    """alpha with alpha + ... + alpha^k = accepted per draft, k = drafted per draft (bisection); 0.5 before any.

    One pseudo-draft of the mean length at alpha = 0.5 counts with the ``drafts`` (as the lookup's
    ``SourceTally.accepted_per_draft``): read alone, a request's first draft rejected set alpha to 0, so the
    request drafted nothing until the replica's next exploring step, up to EXPLORE_MAX steps later, i.e. for the
    rest of a 64-token request (at 1 client, mean draft length 0.06 on some requests:
    benchmarks/results/serve-scaling-cpu-env-interleaved-f32/NOTES.md)."""
    if drafts == 0 or drafted == 0:
        return 0.5
    length = drafted / drafts
    prior = sum(0.5 ** index for index in range(1, int(round(length)) + 1))
    mean_accepted = (accepted + prior) / (drafts + 1)
    low, high = 0.0, 1.0
    for _ in range(40):
        alpha = (low + high) / 2
        expected = sum(alpha ** index for index in range(1, int(round(length)) + 1))
        low, high = (alpha, high) if expected < mean_accepted else (low, alpha)
    return (low + high) / 2


def fed_tokens(drafts: list) -> int:
    """Tokens a target pass feeds to verify ``drafts``: each row's candidates (or tree) and its last committed id."""
    return sum(1 + len(draft.tree or draft.candidates) for draft in drafts)


def _fit(samples: Sequence[tuple[int, float]]) -> tuple[float, float] | None:
    """Least-squares (intercept, slope) of the widths' median seconds over width; None while the widths do not
    vary."""
    by_width: dict[int, list[float]] = {}
    for width, seconds in samples:
        by_width.setdefault(width, []).append(seconds)
    if len(by_width) < 2:
        return None
    widths = torch.tensor([[1.0, float(width)] for width in by_width])
    seconds = torch.tensor([[statistics.median(seconds)] for seconds in by_width.values()])
    intercept, slope = torch.linalg.lstsq(widths, seconds).solution[:, 0].tolist()
    return max(intercept, 0.0), max(slope, 0.0)


def _anchored(samples: Sequence[tuple[int, float]], slope: float) -> tuple[float, float]:
    """(intercept, ``slope``) through the median of samples of one width."""
    return max(statistics.median(seconds - slope * width for width, seconds in samples), 0.0), slope


class LoadAdaptive:
    def __init__(self) -> None:
        self.plain_passes: deque = deque(maxlen=WINDOW)  # target passes that fed no draft: (tokens fed, seconds)
        self.drafted_passes: deque = deque(maxlen=DRAFTED_KEPT)  # target passes that fed drafts, the same
        self.drafter_passes: deque = deque(maxlen=WINDOW)  # (rows drafting, seconds per pass)
        self.target_cost: tuple[float, float] | None = None
        self.drafter_cost: tuple[float, float] | None = None
        self.probes = 0  # steps taken before both costs were fitted
        self.since_explore = 0  # steps since the last exploring step
        self.explore_every = EXPLORE
        self.settled: int | None = None  # the last chosen k (not an exploring step's)
        self.chosen: list[tuple[int, int]] = []  # (batch size, k) per step, for the statistics

    @property
    def target_passes(self) -> list[tuple[int, float]]:
        """Every target pass the fit reads: (tokens fed, seconds)."""
        return list(self.plain_passes) + list(self.drafted_passes)

    def choose(self, own: dict) -> int | None:
        """This step's cap on every request's draft length; None leaves the requests' own.

        ``own``: each request of the step (anything with ``stats`` and ``drafts``, a ``hetspec.decoder.Progress``)
        -> the draft length it would take on its own (0: it does not draft now)."""
        largest = max(own.values(), default=0)
        if largest == 0:
            return None
        if self.target_cost is None or self.drafter_cost is None:
            self.probes += 1
            k = largest if self.probes % 2 else 0
        else:
            self.since_explore += 1
            if self.since_explore >= self.explore_every:
                k, self.since_explore = largest, 0
                self.explore_every = min(2 * self.explore_every, EXPLORE_MAX)  # back to EXPLORE if the choice moves
            else:
                k = max(range(largest + 1), key=lambda k: self._throughput(own, k))
                if self.settled is not None and k != self.settled:
                    self.explore_every = EXPLORE
                self.settled = k
        self.chosen.append((len(own), k))
        return k

    def _throughput(self, own: dict, k: int) -> float:
        tokens, committed, drafting = 0, 0.0, 0
        for request, own_k in own.items():
            length = min(k, own_k)
            drafted = request.stats.tally("drafter")  # a lookup's drafts are the lookup's (hetspec/lookup.py)
            alpha = acceptance(drafted.accepted, drafted.drafted, drafted.drafts)
            committed += sum(alpha ** index for index in range(length + 1))
            tokens += 1 + length
            drafting += length > 0
        target_seconds = self.target_cost[0] + self.target_cost[1] * tokens
        drafter_seconds = k * (self.drafter_cost[0] + self.drafter_cost[1] * drafting) if drafting else 0.0
        return committed / max(target_seconds + drafter_seconds, 1e-9)

    def record(self, drafts: list, lengths: list[int], drafter_seconds: float, target_seconds: float) -> None:
        """One step of a batch: its drafts (one per request), the lengths they were given, both models' time."""
        self.record_target(len(drafts), fed_tokens(drafts), target_seconds)
        self.record_drafter(sum(k > 0 for k in lengths), max((draft.drafter_forwards for draft in drafts), default=0),
                            drafter_seconds)

    def record_target(self, rows: int, tokens: int, seconds: float) -> None:
        """A target pass over ``rows`` requests that fed ``tokens`` (each row's candidates and last committed id)."""
        (self.drafted_passes if tokens > rows else self.plain_passes).append((tokens, seconds))
        self.target_cost = _fit(self.target_passes) or self.target_cost

    def record_drafter(self, rows: int, passes: int, seconds: float) -> None:
        """``passes`` drafter passes, ``rows`` requests drafting in each, ``seconds`` in all."""
        if not (passes and rows):
            return
        self.drafter_passes.append((rows, seconds / passes))
        self.drafter_cost = _fit(self.drafter_passes) or _anchored(
            self.drafter_passes, self.drafter_cost[1] if self.drafter_cost else 0.0)
