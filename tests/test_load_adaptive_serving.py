"""The load-adaptive draft length in the server (deployments/serving/load_adaptive.py): measured from the batched calls,
chosen over the replica's running requests, and lossless (a coordinator on real workers in this process)."""

from __future__ import annotations

import asyncio
from collections import deque

import pytest

from hetspec import Engine, SamplingParams, SpeculationConfig
from hetspec.algorithms import Draft

from deployments.serving.load_adaptive import ReplicaLoadAdaptive
from deployments.serving.pipeline import Phase
from deployments.workers.api import Drafted, DraftItem, OpenSession, VerifyItem, VerifyResult
from serve_fixtures import in_process_coordinator, small_app_args

PROMPTS = ["def fibonacci(n):\n", "The capital of France is", "SELECT name, COUNT(*) FROM users WHERE",
           "Once upon a time"]
NEW_TOKENS = 14


class _Request:
    """What the replica's policy reads of a request: its committed position."""

    def __init__(self) -> None:
        self.position = 0


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _replica(rows: int) -> tuple[_Clock, ReplicaLoadAdaptive, list[_Request]]:
    """A replica's policy on a fake clock with ``rows`` running requests, each drafting 5 on its own."""
    clock = _Clock()
    adaptive = ReplicaLoadAdaptive(clock)
    requests = [_Request() for _ in range(rows)]
    for request in requests:
        adaptive.join(request, lambda: 5)
    return clock, adaptive, requests


def test_rounds_are_measured_whole_and_a_round_that_fed_a_prompt_is_left_out():
    clock, adaptive, requests = _replica(4)
    assert adaptive.drafting(), "no round chosen yet"

    def round_of(seconds: float, committed: int, outcomes: tuple = ()) -> int:
        """Each request asks for the cap, its calls come back, it commits ``committed`` tokens; ``seconds`` pass."""
        caps = {adaptive.cap(request) for request in requests}
        assert len(caps) == 1, "one cap for the round of four requests, as one step in process"
        adaptive.on_batch(Phase.VERIFY, [VerifyItem("x", Draft())] * len(outcomes), list(outcomes))
        for request in requests:
            request.position += committed
        clock.now += seconds
        return caps.pop()

    first = round_of(0.9, 3)
    assert len(adaptive.policy.chosen) == 1
    assert round_of(0.5, 1) == (0 if first else 5), "the first rounds alternate"
    # the first round is measured once every request of it has asked again (its tokens reported)
    assert adaptive.policy.seconds == {(4, first > 0): deque([0.9])}
    assert list(adaptive.policy.committed[first > 0]) == [(12, 4)]
    round_of(0.5, 1, (VerifyResult([1], fed_prompt=True),))  # a pass of the round fed a prompt's chunk
    round_of(0.5, 1, (VerifyResult([], prompt_left=7),))  # an item fed a chunk of its prompt: 7 tokens left
    round_of(0.5, 1, (RuntimeError("failed"),))
    round_of(0.5, 1)  # its requests' asking closes the round before: 3 of 5 measured, 2 left out
    assert sum(map(len, adaptive.policy.seconds.values())) == 3
    newcomer = _Request()
    adaptive.join(newcomer, lambda: 5)  # joins in the round: its rows changed under it
    for request in requests[1:] + [newcomer]:
        adaptive.cap(request)
    clock.now += 9.0
    for request in requests[1:]:
        adaptive.leave(request)  # their last step's tokens are reported as they leave
    for request in (requests[0], newcomer, requests[0]):
        adaptive.cap(request)  # two rounds on
    assert sum(map(len, adaptive.policy.seconds.values())) == 4, "the round the newcomer joined is left out"
    adaptive.leave(requests[0]), adaptive.leave(newcomer)
    assert adaptive.drafting(), "nobody running: a joining request is alone and will draft"
    assert adaptive.cap(requests[0]) is None  # nobody running


def test_a_round_left_out_of_the_measure_still_counts_its_requests_acceptance():
    """A drafting round whose drafter caught a context up prices the catch-up, not k: its seconds are left out, but
    what the request accepted in it counts as its own (the first drafting round after a plain stretch is such a
    round: left out whole, a request's own drafts were never read)."""
    clock, adaptive, [request] = _replica(1)
    caps = []
    for _ in range(5):
        caps.append(adaptive.cap(request))
        adaptive.on_batch(Phase.DRAFT, [DraftItem("x", b"", 4, 0, 0)], [Drafted(Draft(), fed_prompt=True)])
        request.position += 3 if caps[-1] else 1
        clock.now += 0.4
    assert adaptive.policy.seconds == {} and set(caps) == {0, 5}
    assert adaptive.policy.own[request] == [3 * caps[:-1].count(5), caps[:-1].count(5)], "the rounds closed"


def test_a_dear_drafting_round_stops_drafting_at_the_replica():
    clock, adaptive, requests = _replica(8)
    for _ in range(8):  # drafting: 8 x 1.5 tokens in 1.7 s; plain: 8 tokens in 0.45 s
        caps = [adaptive.cap(request) for request in requests]
        for request in requests:
            request.position += 2 if caps[0] else 1
        clock.now += 1.7 if caps[0] else 0.45
    assert [adaptive.cap(request) for request in requests] == [0] * 8
    assert not adaptive.drafting(), "a request joining now leaves its drafter prefill to its first draft"


def _served(exit_stack, gemma, smollm, **pipeline):
    """(coordinator, target worker, drafter worker) in this process, load-adaptive SLEM, shut down after the test."""
    return exit_stack.enter_context(in_process_coordinator(
        gemma, smollm, speculation={"algorithm": "slem", "load_adaptive": True}, pipeline=pipeline))


@pytest.mark.parametrize("one_model_at_a_time", [False, True])
def test_served_requests_with_load_adaptive_equal_the_target_alone(exit_stack, gemma, smollm, one_model_at_a_time):
    from deployments.serving.request import GenerationRequest

    coordinator, target_worker, drafter_worker = _served(exit_stack, gemma, smollm,
                                                         one_model_at_a_time=one_model_at_a_time)
    assert coordinator.batches.one_model_at_a_time == one_model_at_a_time
    requests = [GenerationRequest(prompt=prompt, algorithm=algorithm, pipelined=False,
                                  params=SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
                for prompt, algorithm in zip(PROMPTS, ["slem", "tli", "slem", "slrs"])]

    async def run(request):
        events = [event async for event in coordinator.run(coordinator.prepare(request), "test")]
        return [token for event in events for token in event.token_ids], events[-1].stats

    async def all_at_once():
        served = await asyncio.gather(*(run(request) for request in requests))
        await coordinator.admission.closes_done()  # closes are fire and forget: the loop must outlive them
        return served

    served = asyncio.run(all_at_once())
    engine = Engine(gemma, smollm)
    for prompt, (token_ids, stats) in zip(PROMPTS, served):
        alone = engine.generate(prompt, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True),
                                speculation=SpeculationConfig(algorithm="ar"))
        assert token_ids == alone.token_ids, prompt
    policy = coordinator.load_adaptive.policy
    assert policy.seconds and policy.chosen, "the policy was asked and measured rounds"
    assert {k for _, k in policy.chosen} >= {0}, "it probed k = 0 (plain batched decoding)"
    assert any(stats.drafted_tokens for _, stats in served)
    # each request's statistics count the requests its verification passes fed, as the library's do (1 before)
    assert all(1 <= stats.mean_batch_size <= len(PROMPTS) for _, stats in served)
    assert max(stats.mean_batch_size for _, stats in served) > 2
    assert len(target_worker.sessions) == len(drafter_worker.sessions) == 0 and not coordinator.load_adaptive.running


def test_the_target_worker_says_when_a_pass_fed_a_prompt_chunk(exit_stack, gemma):
    """A step whose passes fed a prompt's chunk prices the prompt: the verify call after such a pass says so (the
    prefill at open here), the next one does not."""
    from deployments.config import AppConfig
    from deployments.workers.model_workers import TargetWorker

    config = AppConfig.model_validate(small_app_args())
    worker = exit_stack.enter_context(TargetWorker(gemma, config.pipeline))
    prompt_ids = gemma.encode_prompt("def fibonacci(n):\n    " * 12)  # a chunk above 32 tokens: a prompt's chunk
    assert len(prompt_ids) > 40
    worker.open(OpenSession("a", prompt_ids, "slem", SpeculationConfig(), SamplingParams(max_new_tokens=4)))
    try:
        [first] = worker.verify([VerifyItem("a", Draft(candidates=[5, 6]))])
        assert first.fed_prompt
        [second] = worker.verify([VerifyItem("a", Draft())])
        assert not second.fed_prompt
    finally:
        worker.close("a")


def test_at_a_cap_of_zero_the_drafter_neither_prefills_nor_drafts_ahead(exit_stack, gemma, smollm):
    """While the replica drafts nothing (cap 0), a joining request's drafter session opens without its prompt and a
    pipelined request drafts nothing ahead (the next step would drop it); a request in step (not pipelined) always
    leaves the drafter's prefill to its first draft; the first draft prefills the prompt in chunks. The output
    stays the target's."""
    from deployments.serving.request import GenerationRequest

    coordinator, target_worker, drafter_worker = _served(exit_stack, gemma, smollm, pipelined=True,
                                                         prefill_chunk_tokens=16)
    adaptive, caps = coordinator.load_adaptive, []
    adaptive.drafting = lambda: False  # as when others run at a cap of 0
    adaptive.cap = lambda progress: caps.pop(0) if caps else 0
    prompt = "def moving_average(values, window):\n    " * 5
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    alone = Engine(gemma, smollm).generate(prompt, params, speculation=SpeculationConfig(algorithm="ar")).token_ids

    async def run(pipelined: bool = True):
        events = [event async for event in coordinator.run(coordinator.prepare(
            GenerationRequest(prompt=prompt, algorithm="slem", params=params, pipelined=pipelined)), "test")]
        await coordinator.admission.closes_done()
        return [token for event in events for token in event.token_ids], events[-1].stats

    token_ids, stats = asyncio.run(run())
    assert token_ids == alone
    assert stats.drafter_forwards == stats.pipeline_hits == stats.pipeline_misses == 0
    assert drafter_worker.passes.passes == 0, "neither a prefill nor a draft ran in the drafter"
    del adaptive.drafting  # the replica's own: nobody else running, it would draft
    assert adaptive.drafting()
    token_ids, _ = asyncio.run(run(pipelined=False))
    assert token_ids == alone and drafter_worker.passes.passes == 0, "in step, the prefill waits for a draft"

    caps[:] = [0, 0, 3]  # drafting from the third step on: its first draft prefills the prompt first
    drafter_prompt = len(smollm.encode_prompt(prompt))
    assert drafter_prompt > 2 * 16
    token_ids, stats = asyncio.run(run(pipelined=False))
    assert token_ids == alone
    assert stats.drafted_tokens > 0
    # chunks of 16 until at most 16 tokens are left (they ride with the draft's first pass), then the drafts'
    assert drafter_worker.passes.passes == -(-(drafter_prompt - 16) // 16) + stats.drafter_forwards
    assert len(target_worker.sessions) == len(drafter_worker.sessions) == 0


def test_a_drafter_session_opened_without_its_prompt_drafts_what_a_prefilled_one_does(exit_stack, gemma, smollm):
    _, _, worker = exit_stack.enter_context(
        in_process_coordinator(gemma, smollm, pipeline={"prefill_chunk_tokens": 16}))
    prompt_ids = smollm.encode_prompt("class Stack:\n    def push(self, item):\n        " * 2)
    speculation, params = SpeculationConfig(algorithm="slem"), SamplingParams(max_new_tokens=8)
    worker.open(OpenSession("eager", prompt_ids, "slem", speculation, params))
    opened = worker.passes.passes
    assert opened == -(-(len(prompt_ids) - 1) // 16)  # the prompt but its last token, 16 at a time
    worker.open(OpenSession("lazy", prompt_ids, "slem", speculation, params, False))
    assert worker.passes.passes == opened
    try:
        eager, lazy = worker.draft([DraftItem("eager", b"", 4, 0, 0), DraftItem("lazy", b"", 4, 0, 0)])
        eager, lazy = eager.draft, lazy.draft
        assert (lazy.candidates, lazy.text) == (eager.candidates, eager.text) and eager.text
    finally:
        worker.close("eager"), worker.close("lazy")


def test_a_target_session_opened_without_its_prompt_feeds_a_chunk_per_call_in_the_others_verify_pass(exit_stack, gemma):
    """In step the coordinator opens the target's session without its prompt and sends a chunk per verify call
    (deployments/serving/pipeline.py DecodeLoop): each chunk shares the pass of the others' verifications, and the
    session then verifies what a session prefilled at open does."""
    from deployments.config import AppConfig
    from deployments.workers.model_workers import TargetWorker

    config = AppConfig.model_validate(small_app_args(pipeline={"prefill_chunk_tokens": 16}))
    worker = exit_stack.enter_context(TargetWorker(gemma, config.pipeline))
    prompt_ids = gemma.encode_prompt("def fibonacci(n):\n    " * 4)
    params = SamplingParams(max_new_tokens=4)
    worker.open(OpenSession("eager", prompt_ids, "slem", SpeculationConfig(), params))
    worker.open(OpenSession("lazy", prompt_ids, "slem", SpeculationConfig(), params, False))
    try:
        chunks, left, committed = 0, len(prompt_ids) - 1, []
        while left:
            passes = worker.passes.passes
            eager, left_now = worker.verify([VerifyItem("eager", Draft()), VerifyItem("lazy", None)])
            assert worker.passes.passes == passes + 1, "the chunk rode in the eager session's verify pass"
            assert isinstance(eager, VerifyResult) and left_now.prompt_left == max(left - 16, 0)
            chunks, left, committed = chunks + 1, left_now.prompt_left, committed + eager.new_ids
        assert chunks == -(-(len(prompt_ids) - 1) // 16)
        # the eager session committed `chunks` ids meanwhile: the lazy one now verifies them as a draft
        [lazy] = worker.verify([VerifyItem("lazy", Draft(candidates=committed))])
        assert lazy.new_ids[:-1] == committed
        [eager] = worker.verify([VerifyItem("eager", Draft())])
        assert lazy.new_ids[-1] == eager.new_ids[0]
    finally:
        worker.close("eager"), worker.close("lazy")


def test_the_drafter_worker_says_when_a_draft_caught_a_context_up(exit_stack, gemma, smollm):
    """A first draft that feeds the whole prompt (the session opened without it) prices the catch-up, not the
    draft length: it says so, the next draft does not."""
    _, _, worker = exit_stack.enter_context(in_process_coordinator(gemma, smollm))
    prompt_ids = smollm.encode_prompt("class Stack:\n    def push(self, item):\n        " * 3)
    assert 33 < len(prompt_ids) < 128  # one feed with the draft's first pass, long enough to count as a prompt's
    speculation, params = SpeculationConfig(algorithm="slem"), SamplingParams(max_new_tokens=8)
    worker.open(OpenSession("lazy", prompt_ids, "slem", speculation, params, False))
    try:
        [draft] = worker.draft([DraftItem("lazy", b"", 4, 0, 0)])
        assert draft.fed_prompt and draft.draft.drafter_forwards >= 2
        [draft] = worker.draft([DraftItem("lazy", draft.draft.text, 4, 4, 1)])
        assert not draft.fed_prompt
    finally:
        worker.close("lazy")


def test_a_request_in_step_joins_the_draft_length_policy_once_its_prompt_is_fed(exit_stack, gemma, smollm):
    """In step, the target's prompt goes a chunk per verify call; until it is in the cache the request is not in
    the policy's round (in process, ``BatchDecoder`` keeps a joining request out of ``running`` the same way)."""
    from deployments.serving.request import GenerationRequest

    coordinator, target_worker, _ = _served(exit_stack, gemma, smollm, pipelined=False, prefill_chunk_tokens=16)
    prompt = "def moving_average(values, window):\n    " * 5
    prompt_ids = gemma.encode_prompt(prompt)
    assert len(prompt_ids) > 3 * 16
    cached_at_join, join = [], coordinator.load_adaptive.join

    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    prepared = coordinator.prepare(GenerationRequest(prompt=prompt, algorithm="slem", params=params))

    def joining(progress, own_length):
        with target_worker.sessions.use(prepared.session_id) as session:
            cached_at_join.append(session.side.session.length)
        join(progress, own_length)

    coordinator.load_adaptive.join = joining

    async def run():
        events = [event async for event in coordinator.run(prepared, "test")]
        await coordinator.admission.closes_done()
        return [token for event in events for token in event.token_ids]

    passes = target_worker.passes.passes
    token_ids = asyncio.run(run())
    assert cached_at_join == [len(prompt_ids) - 1], "the whole prompt but its last token, fed before it joined"
    assert target_worker.passes.passes - passes >= -(-(len(prompt_ids) - 1) // 16), "a pass per chunk"
    alone = Engine(gemma, smollm).generate(prompt, params, speculation=SpeculationConfig(algorithm="ar")).token_ids
    assert token_ids == alone


def test_requests_whose_prompts_are_being_fed_count_in_the_load_the_cap_is_chosen_at():
    """At a wave's start of 8 clients the first request to step chose drafting at 1 row while the others' prompts
    waited their turn: a ~1.1 s round against a plain one's 0.44 (docs/decisions/load-adaptive-draft-length.md)."""
    clock, adaptive, [first] = _replica(1)
    for rows, seconds_by_cap in ((1, {True: 0.4, False: 0.25}), (8, {True: 1.7, False: 0.45})):
        for drafting in (True, False):
            for _ in range(4):
                adaptive.policy.record(5 if drafting else 0, {object(): 3 if drafting else 1 for _ in range(rows)},
                                       seconds_by_cap[drafting])
    assert adaptive.cap(first) == 5, "alone: drafting pays"
    feeding = [_Request() for _ in range(7)]
    for request in feeding:
        adaptive.arrive(request)
    first.position += 3
    clock.now += 0.4
    assert adaptive.cap(first) == 0, "at the replica's 8 rows it does not"
    assert adaptive.policy.chosen[-1] == (8, 0)
    for request in feeding:
        adaptive.leave(request)  # (cancelled before their prompts were in)
    first.position += 1
    clock.now += 0.25
    assert adaptive.cap(first) == 5 and set(adaptive.running) == {first}


def test_in_step_the_first_token_is_the_targets_own_and_waits_for_no_drafter_pass(exit_stack, gemma, smollm):
    """In step a drafter session opens without its prompt: drafted on the first step, that prefill held the first
    token (first tokens later than with speculation off: docs/decisions/load-adaptive-draft-length.md). Drafting
    starts at the second step, in process as served (``Progress.draft_length``); the output stays the target's."""
    from deployments.serving.request import GenerationRequest

    coordinator, _, drafter_worker = exit_stack.enter_context(in_process_coordinator(
        gemma, smollm, speculation={"algorithm": "slem"}, pipeline={"pipelined": False}))
    steps = []
    coordinator._record_step = lambda algorithm, step: steps.append(step)
    prompt = "def moving_average(values, window):\n    "
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    alone = Engine(gemma, smollm).generate(prompt, params, speculation=SpeculationConfig(algorithm="ar")).token_ids

    async def run():
        token_ids, drafter_passes_at_first = [], None
        async for event in coordinator.run(coordinator.prepare(
                GenerationRequest(prompt=prompt, algorithm="slem", params=params)), "test"):
            if drafter_passes_at_first is None and event.token_ids:
                drafter_passes_at_first = drafter_worker.passes.passes
            token_ids += event.token_ids
        await coordinator.admission.closes_done()
        return token_ids, drafter_passes_at_first

    token_ids, drafter_passes_at_first = asyncio.run(run())
    assert token_ids == alone
    assert drafter_passes_at_first == 0 and steps[0].drafted == 0
    assert steps[1].drafted > 0 and drafter_worker.passes.passes > 0, "drafting from the second step on"
