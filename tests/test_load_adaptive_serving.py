"""The load-adaptive draft length in the server (deployments/load_adaptive.py): measured from the batched calls,
chosen over the replica's running requests, and lossless (a coordinator on real workers in this process)."""

from __future__ import annotations

import asyncio

import pytest

from hetspec import Engine, SamplingParams, SpeculationConfig
from hetspec.algorithms import Draft
from hetspec.output import Stats

from deployments.load_adaptive import ReplicaLoadAdaptive
from deployments.workers import VerifyResult
from serve_fixtures import in_process_coordinator, small_app_args

PROMPTS = ["def fibonacci(n):\n", "The capital of France is", "SELECT name, COUNT(*) FROM users WHERE",
           "Once upon a time"]
NEW_TOKENS = 14


class _Request:
    """What the policy reads of a request: its drafter drafts' record (2 of each draft of 5 accepted)."""

    def __init__(self) -> None:
        self.stats = Stats(drafter_drafts=5, drafter_drafted_tokens=25, drafter_accepted_tokens=10)


def test_costs_are_measured_from_the_batched_calls_and_a_dear_wide_pass_stops_drafting():
    adaptive = ReplicaLoadAdaptive()
    requests = [_Request() for _ in range(8)]
    for request in requests:
        adaptive.join(request, lambda: 5)
    # verify batches of 8 rows: 8 tokens fed (no drafts) cost 0.2 s, 48 tokens (k = 5) 5.4 s: compute-bound. The
    # calls took longer (a prompt's chunk was fed meanwhile): the prices are the passes', which the first result carries
    for drafted, seconds in ((0, 0.2), (5, 5.4), (0, 0.2), (5, 5.4)):
        items = [(str(index), Draft(candidates=[1] * drafted)) for index in range(8)]
        results = [VerifyResult([1], seconds + 2.5, passes=[(8, 8 * (1 + drafted), seconds)])]
        adaptive.on_batch("verify_many", items, results + [VerifyResult([1], seconds + 2.5)] * 7)
    for rows, seconds in ((8, 0.5), (2, 0.3)):  # draft_many of 5 positions; the call took longer (a catch-up)
        items = [(str(index), b"", 5, 0, 0) for index in range(rows)]
        drafts = [Draft(candidates=[1] * 5, drafter_forwards=5, seconds=seconds + 2, passes=[(rows, rows, seconds / 5)] * 5)]
        adaptive.on_batch("draft_many", items, drafts + [Draft(candidates=[1] * 5, seconds=seconds + 2)] * (rows - 1))
    assert adaptive.policy.target_passes == [(8, 0.2), (8, 0.2), (48, 5.4), (48, 5.4)]
    assert adaptive.policy.target_cost[1] > 0.1
    assert adaptive.policy.drafter_cost == pytest.approx((0.14 / 3, 0.02 / 3)), "the passes' prices, not the calls'"
    assert adaptive.drafting(), "no round chosen yet"
    assert [adaptive.cap(request) for request in requests] == [0] * 8
    assert not adaptive.drafting(), "a request joining now leaves its drafter prefill to its first draft"
    assert len(adaptive.policy.chosen) == 1, "one choice for the round of eight requests, as one step in process"
    adaptive.cap(requests[0])  # asks again: a new round
    assert len(adaptive.policy.chosen) == 2
    adaptive.on_batch("verify_many", [("x", Draft())], [RuntimeError("failed")])  # a failed call measures nothing
    assert len(adaptive.policy.target_passes) == 4
    for request in requests[1:]:
        adaptive.leave(request)
    assert adaptive.cap(requests[0]) == 0 and len(adaptive.policy.chosen) == 3  # alone: every step is a round
    adaptive.leave(requests[0])
    assert adaptive.drafting(), "nobody running: a joining request is alone and will draft"
    assert adaptive.cap(requests[0]) is None  # nobody running


def _served(gemma, smollm, **pipeline):
    """(coordinator, target worker, drafter worker) in this process, load-adaptive SLEM."""
    return in_process_coordinator(gemma, smollm, speculation={"algorithm": "slem", "load_adaptive": True},
                                  pipeline=pipeline)


@pytest.mark.parametrize("one_model_at_a_time", [False, True])
def test_served_requests_with_load_adaptive_equal_the_target_alone(gemma, smollm, one_model_at_a_time):
    from deployments.coordinator import GenerationRequest

    coordinator, target_worker, drafter_worker = _served(gemma, smollm, one_model_at_a_time=one_model_at_a_time)
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
    assert policy.target_passes and policy.chosen, "the policy was asked and measured the passes"
    assert {k for _, k in policy.chosen} >= {0}, "it probed k = 0 (plain batched decoding)"
    assert any(stats.drafted_tokens for _, stats in served)
    # each request's statistics count the requests its verification passes fed, as the library's do (1 before)
    assert all(1 <= stats.mean_batch_size <= len(PROMPTS) for _, stats in served)
    assert max(stats.mean_batch_size for _, stats in served) > 2
    assert len(target_worker.sessions) == len(drafter_worker.sessions) == 0 and not coordinator.load_adaptive.running


def test_the_target_worker_hands_back_its_step_passes_not_a_prompt_chunks(gemma):
    """The prices come from passes: a verify call returns the target's passes since the last call, each timed, and
    leaves out a pass that fed a prompt's chunk (it costs what its chunk costs, not what a draft length does)."""
    from deployments.config import AppConfig
    from deployments.workers import TargetWorker

    config = AppConfig.model_validate(small_app_args())
    worker = TargetWorker(gemma, config.pipeline)
    prompt_ids = gemma.encode_prompt("def fibonacci(n):\n    " * 12)  # a chunk above 32 tokens: a prompt's chunk
    assert len(prompt_ids) > 40
    worker.open("a", prompt_ids, "slem", SpeculationConfig(), SamplingParams(max_new_tokens=4))
    try:
        [first] = worker.verify_many([("a", Draft(candidates=[5, 6]))])
        assert [(rows, tokens) for rows, tokens, _ in first.passes] == [(1, 3)]  # the prefill's pass left out
        assert first.passes[0][2] > 0
        [second] = worker.verify_many([("a", Draft())])
        assert [(rows, tokens) for rows, tokens, _ in second.passes] == [(1, 1)]  # drained by the first call
    finally:
        worker.close("a")


def test_at_a_cap_of_zero_the_drafter_neither_prefills_nor_drafts_ahead(gemma, smollm):
    """While the replica drafts nothing (cap 0), a joining request's drafter session opens without its prompt and a
    pipelined request drafts nothing ahead (the next step would drop it); a request in step (not pipelined) always
    leaves the drafter's prefill to its first draft; the first draft prefills the prompt in chunks. The output
    stays the target's."""
    from deployments.coordinator import GenerationRequest

    coordinator, target_worker, drafter_worker = _served(gemma, smollm, pipelined=True, prefill_chunk_tokens=16)
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


def test_a_drafter_session_opened_without_its_prompt_drafts_what_a_prefilled_one_does(gemma, smollm):
    _, _, worker = in_process_coordinator(gemma, smollm, pipeline={"prefill_chunk_tokens": 16})
    prompt_ids = smollm.encode_prompt("class Stack:\n    def push(self, item):\n        " * 2)
    speculation, params = SpeculationConfig(algorithm="slem"), SamplingParams(max_new_tokens=8)
    worker.open("eager", prompt_ids, "slem", speculation, params)
    opened = worker.passes.passes
    assert opened == -(-(len(prompt_ids) - 1) // 16)  # the prompt but its last token, 16 at a time
    worker.open("lazy", prompt_ids, "slem", speculation, params, False)
    assert worker.passes.passes == opened
    try:
        eager, lazy = worker.draft_many([("eager", b"", 4, 0, 0), ("lazy", b"", 4, 0, 0)])
        assert (lazy.candidates, lazy.text) == (eager.candidates, eager.text) and eager.text
    finally:
        worker.close("eager"), worker.close("lazy")


def test_a_target_session_opened_without_its_prompt_feeds_a_chunk_per_call_in_the_others_verify_pass(gemma):
    """In step the coordinator opens the target's session without its prompt and sends a chunk per verify call
    (deployments/pipeline.py DecodeLoop): each chunk shares the pass of the others' verifications, and the session
    then verifies what a session prefilled at open does."""
    from deployments.config import AppConfig
    from deployments.workers import TargetWorker

    config = AppConfig.model_validate(small_app_args(pipeline={"prefill_chunk_tokens": 16}))
    worker = TargetWorker(gemma, config.pipeline)
    prompt_ids = gemma.encode_prompt("def fibonacci(n):\n    " * 4)
    params = SamplingParams(max_new_tokens=4)
    worker.open("eager", prompt_ids, "slem", SpeculationConfig(), params)
    worker.open("lazy", prompt_ids, "slem", SpeculationConfig(), params, False)
    try:
        chunks, left, committed = 0, len(prompt_ids) - 1, []
        while left:
            passes = worker.passes.passes
            eager, left_now = worker.verify_many([("eager", Draft()), ("lazy", None)])
            assert worker.passes.passes == passes + 1, "the chunk rode in the eager session's verify pass"
            assert isinstance(eager, VerifyResult) and left_now == max(left - 16, 0)
            chunks, left, committed = chunks + 1, left_now, committed + eager.new_ids
        assert chunks == -(-(len(prompt_ids) - 1) // 16)
        # the eager session committed `chunks` ids meanwhile: the lazy one now verifies them as a draft
        [lazy] = worker.verify_many([("lazy", Draft(candidates=committed))])
        assert lazy.new_ids[:-1] == committed
        [eager] = worker.verify_many([("eager", Draft())])
        assert lazy.new_ids[-1] == eager.new_ids[0]
    finally:
        worker.close("eager"), worker.close("lazy")


def test_the_drafter_worker_hands_back_its_draft_passes_not_a_catch_up(gemma, smollm):
    """The drafter's price comes from its passes too: a first draft that feeds the whole prompt (the session opened
    without it) leaves that pass out, so a catch-up does not make drafting look dear."""
    _, _, worker = in_process_coordinator(gemma, smollm)
    prompt_ids = smollm.encode_prompt("class Stack:\n    def push(self, item):\n        " * 3)
    assert 33 < len(prompt_ids) < 128  # one feed with the draft's first pass, long enough to count as a prompt's
    speculation, params = SpeculationConfig(algorithm="slem"), SamplingParams(max_new_tokens=8)
    worker.open("lazy", prompt_ids, "slem", speculation, params, False)
    try:
        [draft] = worker.draft_many([("lazy", b"", 4, 0, 0)])
        assert draft.drafter_forwards >= 2 and draft.seconds > 0
        assert [(rows, tokens) for rows, tokens, _ in draft.passes] == [(1, 1)] * (draft.drafter_forwards - 1)
        assert sum(seconds for _, _, seconds in draft.passes) < draft.seconds
    finally:
        worker.close("lazy")


def test_a_request_in_step_joins_the_draft_length_policy_once_its_prompt_is_fed(gemma, smollm):
    """In step, the target's prompt goes a chunk per verify call; until it is in the cache the request is not in
    the policy's round (in process, ``BatchDecoder`` keeps a joining request out of ``running`` the same way)."""
    from deployments.coordinator import GenerationRequest

    coordinator, target_worker, _ = _served(gemma, smollm, pipelined=False, prefill_chunk_tokens=16)
    prompt = "def moving_average(values, window):\n    " * 5
    prompt_ids = gemma.encode_prompt(prompt)
    assert len(prompt_ids) > 3 * 16
    cached_at_join, join = [], coordinator.load_adaptive.join

    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    prepared = coordinator.prepare(GenerationRequest(prompt=prompt, algorithm="slem", params=params))

    def joining(progress, own_length):
        with target_worker.sessions.use(prepared.request_id) as session:
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
