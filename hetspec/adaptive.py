"""Load-adaptive draft length: each step drafts (the requests' own k) or not (k = 0), whichever has committed
more tokens per second at this batch size, as measured.

Speculation pays while the target's pass is nearly free to widen: one pass costs about the same for 1 token as
for 4. In a batch, every drafted token widens the target pass of every row and every draft position is a
drafter pass, so at some batch size plain decoding wins. The policy (docs/batching.md) measures, rather than
models, both choices:

- a step's rate with a choice at ``rows`` requests = rows x (tokens committed per row a step with that choice,
  over its last COMMITTED_KEPT steps at any batch size: acceptance does not depend on the batch) / (the mean
  seconds of its last SECONDS_KEPT steps at that batch size: the whole step, both models' passes and what runs
  between them; a batch size not timed with the choice is priced on the line through the two nearest that were);
- the step drafts where drafting's rate is the higher by DRAFT_MARGIN; the first steps alternate until each
  choice has been timed MIN_STEPS times; after that an exploring step now and then takes the other choice, so
  both stay measured: EXPLORE steps apart at first, twice as far after each exploring step that leaves the
  choice where it was (up to EXPLORE_MAX), EXPLORE again once the choice moves, and never so close together that
  they take more than EXPLORE_BUDGET of the time (HOPELESS_BUDGET where drafting could not pay at the best
  acceptance lately seen), a budget not spent kept for at most BUDGET_WINDOW_S seconds' worth. An exploring
  step left out of the seconds is taken again, once: in the server the first drafting round after over 32 plain
  ones catches the drafter's context up and is left out, so once exploring steps came that far apart drafting was
  never timed again and stayed priced by its earlier steps (the likely cause of a served level at 1 client
  drafting once in 64 steps: docs/decisions/load-adaptive-draft-length.md).

Why measured: a model of the passes' prices (a line fitted to the target's and the drafter's passes) and of
acceptance (a geometric rate per drafted token) settled a lone request at k = 1 or 0 on a 2-core CPU, where
drafting k = 5 gave 1.18x the target alone: the CPU's price of a pass is concave in its width, drafts cut short by
the confidence threshold left the fit without wide passes, a per-token rate from 1-token drafts undervalues long
drafts (acceptance comes in runs), and ~40 ms a step run between the passes
(docs/decisions/load-adaptive-draft-length.md). A step's committed tokens and its seconds hold all of that.
Pooled alone, tokens a row let the request before decide the next one's choice: a served level at 1 client that
followed a prompt with little accepted drafted in 0-1 steps a request, its own drafts never tried
(docs/decisions/load-adaptive-draft-length.md). So drafting's tokens a row are each running request's own
drafting steps, weighed against OWN_PRIOR_STEPS steps at the pooled figure, and a request joining brings the
exploring steps back to EXPLORE apart where its drafts could make drafting pay (were it to accept as well as the
best of the last requests), so they get tried. Not everywhere: at 2 clients, where drafting lost even so, exploring
for every newcomer cost ~5% (docs/decisions/load-adaptive-draft-length.md). A request's own tally counts its
every drafting step, measured or not (the first drafting step after a plain stretch feeds the drafter the context:
left out of the seconds, its tokens are still what the request accepted).
Only the draft length is chosen here, never what is verified: it changes speed, not the output.
"""

from __future__ import annotations

from collections import deque

MIN_STEPS = 2  # steps timed of each choice before choosing on the measure
SECONDS_KEPT = 16  # recent steps' seconds kept per (batch size, choice)
COMMITTED_KEPT = 64  # recent steps' committed tokens kept per choice
# Drafting's tokens a row start from PRIOR_ROWS pseudo-rows at PRIOR_TOKENS (a draft of 5 at acceptance 0.5 a
# token commits 1.97): read from its first two steps alone, a code prompt's first drafts rejected kept a lone
# request at k = 0 for the rest of its 64 tokens (3.81 tokens/s, fixed k = 5 4.74; a batch_bench probe, not committed)
PRIOR_ROWS, PRIOR_TOKENS = 4, 2.0
# Drafting is chosen only where its rate beats plain decoding's by this fraction: near a tie what the step measure
# leaves out decides, and it goes against drafting. Requests that draft finish apart, so a batch that no new request
# refills runs underfull at its end, and drafting adds side costs (the drafter catching up a context, its sessions).
# Without it, at 8 clients each sending one request, a measured near-tie (~16 tokens/s either way at 8 rows) chose
# drafting and the level ran at 0.82x of speculation off, its batch underfull for its last 16 s of 40 (a served run:
# docs/decisions/load-adaptive-draft-length.md)
DRAFT_MARGIN = 0.1
# A request's own drafting steps weigh against this many steps at the pooled figure: on its first exploring step a
# request accepting 3 tokens a step where the one before accepted 1.56 reads 1.85, enough to draft again on this CPU
OWN_PRIOR_STEPS = 4
ACCEPTED_KEPT = 8  # requests gone whose tokens a drafting step say what a newcomer may accept at best
EXPLORE = 8  # steps between exploring steps at first and after the choice moves
EXPLORE_MAX = 128  # the longest interval, reached while the choice holds
# Exploring steps wait while what they took beyond a step of the settled choice (measured: the step's own seconds,
# a catch-up and a retried step included) exceeds this fraction of the time recorded: at 8 clients on this CPU an
# exploring drafting round with its catch-up took ~1.7 s and its retry ~1.0 s against plain decoding's ~0.44, and
# on the schedule alone (each request drafting in 3-5 rounds of its 64) 8 clients ran at 0.89x of speculation off
# (docs/decisions/load-adaptive-draft-length.md); at 1 client a drafting step costs ~0.17 s more
EXPLORE_BUDGET = 0.05
# Exploring a draft that could not pay even at the best acceptance lately seen, priced at the batch size's measured
# (or interpolated) seconds, waits for this smaller budget: at 8 clients such a round and its retry cost ~1.8 s more
# than plain decoding and left the level at 0.90x of speculation off (docs/decisions/load-adaptive-draft-length.md).
# Not never: it is what re-measures a batch size whose seconds, or a workload whose acceptance, changed.
HOPELESS_BUDGET = 0.01
# A budget not spent is kept for at most this many seconds' worth (a token bucket, one a budget: each accrues its
# fraction of every step's seconds, every exploring step's extra is taken from both). Kept without a bound, the budget
# saved over ~7 minutes at 1-4 clients (exploring there cheap or free), up to ~20 s, was spent at once by the first
# minute at 8 clients, exploring rounds of 2-6 s as often as the schedule said: that served level ran 8% below
# speculation off (docs/decisions/load-adaptive-draft-length.md)
BUDGET_WINDOW_S = 60.0


class LoadAdaptive:
    def __init__(self) -> None:
        self.seconds: dict[tuple[int, bool], deque] = {}  # (rows, drafting) -> recent steps' seconds
        self.committed: dict[bool, deque] = {True: deque(maxlen=COMMITTED_KEPT), False: deque(maxlen=COMMITTED_KEPT)}
        self.own: dict = {}  # a running request -> [tokens, steps] of its drafting steps
        self.members: set = set()  # the requests of the step before
        self.accepted = deque(maxlen=ACCEPTED_KEPT)  # the last requests' tokens a drafting step (those that drafted)
        self.since_explore = 0  # steps since the last exploring step
        self.explore_every = EXPLORE
        self.settled: bool | None = None  # the last choice made on the measure (not an exploring step's)
        self.exploring: bool | None = None  # the last exploring step's choice, until its step is recorded
        self.retry: bool | None = None  # that choice again: its step was left out of the seconds
        # each budget's seconds not spent, from the steps recorded since the first choice on the measure: what exploring
        # steps took beyond a step of the settled choice is taken from it (below 0: spent ahead)
        self.unspent = {EXPLORE_BUDGET: 0.0, HOPELESS_BUDGET: 0.0}
        self.chosen: list[tuple[int, int]] = []  # (batch size, k) per step, for the statistics

    def choose(self, own: dict) -> int | None:
        """This step's cap on every request's draft length: 0 or the largest own k; None when nobody drafts.

        ``own``: each request of the step -> the draft length it would take on its own (0: it does not draft
        now; None: its prompt is being fed, a row within a few steps). While a prompt is fed no exploring step is
        taken: such a step is left out of the seconds (it prices the prompt), so it would buy no measure, and,
        one model at a time in the server, its drafter catch-ups would hold the pass that carries the prompt."""
        largest = max((length for length in own.values() if length), default=0)
        if largest == 0:
            return None
        feeding = None in own.values()
        rows = len(own)
        for request in self.own.keys() - own.keys():
            tokens, steps = self.own.pop(request)
            if steps >= OWN_PRIOR_STEPS:
                self.accepted.append(tokens / steps)
        joined, self.members = own.keys() - self.members, set(own)
        timed = {drafting: sum(len(seconds) for (_, choice), seconds in self.seconds.items() if choice == drafting)
                 for drafting in (False, True)}
        if min(timed.values()) < MIN_STEPS:  # the less timed; alternating while even (a server's round is timed late)
            drafting = timed[True] < timed[False] or (timed[True] == timed[False]
                                                      and not (self.chosen and self.chosen[-1][1] > 0))
        else:
            self.since_explore += 1
            bar = (1 + DRAFT_MARGIN) * self.rate(rows, False)  # drafting's rate must pass it
            best = self.rate(rows, True, own) > bar
            if joined and not best and self.rate(rows, True, own, hopeful=joined) > bar:
                self.explore_every = EXPLORE  # the newcomers' own drafts could make drafting pay: try them soon
            if self.retry is not None and not feeding:  # once: a server's exploring draft after a plain stretch
                drafting, self.retry, self.since_explore = self.retry, None, 0  # catches a context up
            elif not feeding and self.since_explore >= self.explore_every and self._may_explore(rows, best, own, bar):
                drafting = self.exploring = not best
                self.since_explore = 0
                self.explore_every = min(2 * self.explore_every, EXPLORE_MAX)  # back to EXPLORE if the choice moves
            else:
                if self.settled is not None and best != self.settled:
                    self.explore_every = EXPLORE
                drafting = self.settled = best
        k = largest if drafting else 0
        self.chosen.append((rows, k))
        return k

    def _may_explore(self, rows: int, best: bool, own: dict, bar: float) -> bool:
        """Whether an exploring step (the choice other than ``best``) is within its budget now: EXPLORE_BUDGET of the
        time, or HOPELESS_BUDGET where drafting would not pay even were every request to accept as well as the best
        of the last requests; free where it is no dearer than the settled choice."""
        if self.step_seconds(rows, not best) <= self.step_seconds(rows, best):
            return True
        could_pay = best or self.rate(rows, True, own, hopeful=own.keys()) > bar
        return self.unspent[EXPLORE_BUDGET if could_pay else HOPELESS_BUDGET] >= 0

    def rate(self, rows: int, drafting: bool, requests=(), hopeful=()) -> float:
        """Tokens a second a step with this choice commits at ``rows`` requests, as measured; drafting's tokens a row
        are ``requests``' own where given (each weighed against OWN_PRIOR_STEPS steps at the pooled figure; plain
        decoding commits one token a row whoever runs), those of ``hopeful`` ones the best of the last requests'
        (at least PRIOR_TOKENS)."""
        committed = self.committed[drafting]
        prior_rows = PRIOR_ROWS if drafting else 0
        per_row = ((sum(tokens for tokens, _ in committed) + prior_rows * PRIOR_TOKENS)
                   / max(sum(rows for _, rows in committed) + prior_rows, 1))
        if drafting and requests:
            best = max([PRIOR_TOKENS, *self.accepted])
            per_row = sum(best if request in hopeful else self._own_per_row(request, per_row)
                          for request in requests) / len(requests)
        return rows * per_row / max(self.step_seconds(rows, drafting), 1e-9)

    def _own_per_row(self, request, pooled: float) -> float:
        tokens, steps = self.own.get(request, (0, 0))
        return (tokens + OWN_PRIOR_STEPS * pooled) / (steps + OWN_PRIOR_STEPS)

    def step_seconds(self, rows: int, drafting: bool) -> float:
        """Mean seconds of a step with this choice at ``rows`` requests: its steps' there, else on the line through
        the two nearest batch sizes timed (not falling with rows; the one timed alone: its seconds). Timed
        again at every batch size, a batch finishing one request at a time probed drafting at 7, 6, ... rows
        (0.86x of plain decoding at 8 requests in one process; a batch_bench probe, not committed); priced flat
        beyond the largest timed, drafting at 8 clients looked as cheap as at 4 until it ran (a served run, its
        numbers in docs/decisions/load-adaptive-draft-length.md)."""
        means = {timed_rows: sum(seconds) / len(seconds) for (timed_rows, choice), seconds in self.seconds.items()
                 if choice == drafting and seconds}
        if rows in means:
            return means[rows]
        below = sorted((timed_rows for timed_rows in means if timed_rows < rows), reverse=True)
        above = sorted(timed_rows for timed_rows in means if timed_rows > rows)
        near = below[:1] + above[:1] if below and above else (below or above)[:2]
        if len(near) == 1:
            return means[near[0]]
        low, high = sorted(near)
        slope = max((means[high] - means[low]) / (high - low), 0.0)
        nearest = min(near, key=lambda timed_rows: abs(timed_rows - rows))
        return max(means[nearest] + slope * (rows - nearest), 0.0)

    def record(self, k: int, committed: dict, seconds: float, priced: bool = True) -> None:
        """A step at the cap ``k`` this policy chose: each of its requests committed ``committed[request]`` tokens,
        in ``seconds`` (the whole step). Not ``priced``: a step that also fed a prompt, its seconds price the
        prompt, not k. A request that committed nothing fed its prompt in the step: its tokens say nothing of k."""
        drafting, rows = k > 0, len(committed)
        if self.settled is not None:
            extra = 0.0
            if drafting != self.settled:  # an exploring step or its retry
                extra = max(seconds - self.step_seconds(rows, self.settled), 0.0)
            for budget, left in self.unspent.items():
                self.unspent[budget] = min(left + budget * seconds, budget * BUDGET_WINDOW_S) - extra
        if drafting == self.exploring:
            self.retry, self.exploring = (None if priced else drafting), None
        if priced:
            self.seconds.setdefault((rows, drafting), deque(maxlen=SECONDS_KEPT)).append(seconds)
        stepped = {request: tokens for request, tokens in committed.items() if tokens > 0}
        if stepped:
            self.committed[drafting].append((sum(stepped.values()), len(stepped)))
        for request, tokens in stepped.items() if drafting else ():
            tally = self.own.setdefault(request, [0, 0])
            tally[0], tally[1] = tally[0] + tokens, tally[1] + 1
