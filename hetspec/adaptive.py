"""Load-adaptive draft length: each step's k (0 = plain batched decoding) from measured costs and acceptance.

Speculation pays while the target's pass is nearly free to widen: one pass costs about the same for 1 token
as for 4. In a batch, every drafted token widens the target pass of every row and every draft position is
a drafter pass, so at some batch size plain decoding wins. The policy (docs/batching.md):

- cost model, refitted every step by least squares over the recent passes of this decoder:
  target pass seconds = a + b * tokens fed;  drafter pass seconds = c + d * rows drafting;
- request r accepts each drafted token with probability alpha_r, so a draft of k commits
  E_r(k) = 1 + alpha_r + ... + alpha_r^k tokens in expectation (1 for k = 0); alpha_r is the value for which
  that model gives the mean accepted tokens per draft the request has had at its mean draft length (acceptance
  comes in runs: a per-token rate accepted / drafted would underprice long drafts);
- the step's k maximises  sum_r E_r(min(k, k_r)) / (T(sum_r (1 + min(k, k_r))) + k * D(drafting rows)),
  with k_r the request's own draft length (``DraftLength``), over k = 0 .. max k_r.

Until both models have been timed at two different widths, it alternates the configured k and k = 0 to
measure them, and every EXPLORE-th step it drafts the configured k again so the fit keeps two widths. It
changes which tokens are drafted, never which are output.
"""

from __future__ import annotations

from collections import deque

import torch

WINDOW = 64  # passes kept for the fit
EXPLORE = 8  # every EXPLORE-th step drafts the requests' own k, so the costs stay measured at two widths


def acceptance(accepted: int, drafted: int, drafts: int) -> float:
    """alpha with alpha + ... + alpha^k = accepted per draft, k = drafted per draft (bisection); 0.5 before any."""
    if drafts == 0 or drafted == 0:
        return 0.5
    length, mean_accepted = drafted / drafts, accepted / drafts
    low, high = 0.0, 1.0
    for _ in range(40):
        alpha = (low + high) / 2
        expected = sum(alpha ** index for index in range(1, int(round(length)) + 1))
        low, high = (alpha, high) if expected < mean_accepted else (low, alpha)
    return (low + high) / 2


def fed_tokens(drafts: list) -> int:
    """Tokens a target pass feeds to verify ``drafts``: each row's candidates (or tree) and its last committed id."""
    return sum(1 + len(draft.tree or draft.candidates) for draft in drafts)


def _fit(samples: deque) -> tuple[float, float] | None:
    """Least-squares (intercept, slope) of seconds over width; None while the widths do not vary."""
    if len({width for width, _ in samples}) < 2:
        return None
    widths = torch.tensor([[1.0, float(width)] for width, _ in samples])
    seconds = torch.tensor([[seconds] for _, seconds in samples])
    intercept, slope = torch.linalg.lstsq(widths, seconds).solution[:, 0].tolist()
    return max(intercept, 0.0), max(slope, 0.0)


class LoadAdaptive:
    def __init__(self) -> None:
        self.target_passes: deque = deque(maxlen=WINDOW)  # (tokens fed, seconds)
        self.drafter_passes: deque = deque(maxlen=WINDOW)  # (rows drafting, seconds per pass)
        self.target_cost: tuple[float, float] | None = None
        self.drafter_cost: tuple[float, float] | None = None
        self.probing = 0
        self.chosen: list[tuple[int, int]] = []  # (batch size, k) per step, for the statistics

    def choose(self, own: dict) -> int | None:
        """This step's cap on every request's draft length; None leaves the requests' own.

        ``own``: each request of the step (anything with ``stats`` and ``drafts``, a ``hetspec.decoder.Progress``)
        -> the draft length it would take on its own (0: it does not draft now)."""
        largest = max(own.values(), default=0)
        if largest == 0:
            return None
        self.probing += 1
        if self.target_cost is None or self.drafter_cost is None:
            k = largest if self.probing % 2 else 0
        elif self.probing % EXPLORE == 0:
            k = largest
        else:
            k = max(range(largest + 1), key=lambda k: self._throughput(own, k))
        self.chosen.append((len(own), k))
        return k

    def _throughput(self, own: dict, k: int) -> float:
        tokens, committed, drafting = 0, 0.0, 0
        for request, own_k in own.items():
            length = min(k, own_k)
            alpha = acceptance(request.stats.accepted_tokens, request.stats.drafted_tokens, request.drafts)
            committed += sum(alpha ** index for index in range(length + 1))
            tokens += 1 + length
            drafting += length > 0
        target_seconds = self.target_cost[0] + self.target_cost[1] * tokens
        drafter_seconds = k * (self.drafter_cost[0] + self.drafter_cost[1] * drafting) if drafting else 0.0
        return committed / max(target_seconds + drafter_seconds, 1e-9)

    def record(self, drafts: list, lengths: list[int], drafter_seconds: float, target_seconds: float) -> None:
        """One step of a batch: its drafts (one per request), the lengths they were given, both models' time."""
        self.record_target(fed_tokens(drafts), target_seconds)
        self.record_drafter(sum(k > 0 for k in lengths), max((draft.drafter_forwards for draft in drafts), default=0),
                            drafter_seconds)

    def record_target(self, tokens: int, seconds: float) -> None:
        """A target pass that fed ``tokens`` (every row's candidates and its last committed token)."""
        self.target_passes.append((tokens, seconds))
        self.target_cost = _fit(self.target_passes) or self.target_cost

    def record_drafter(self, rows: int, passes: int, seconds: float) -> None:
        """``passes`` drafter passes, ``rows`` requests drafting in each, ``seconds`` in all."""
        if not (passes and rows):
            return
        self.drafter_passes.append((rows, seconds / passes))
        fitted = _fit(self.drafter_passes)
        mean = sum(seconds for _, seconds in self.drafter_passes) / len(self.drafter_passes)
        self.drafter_cost = fitted or self.drafter_cost or (mean, 0.0)
