"""The load-adaptive draft length in the server: the library's (``hetspec.adaptive.LoadAdaptive`` in the replica loop's
scheduler), chosen over the replica's running requests, and lossless (a coordinator on real workers in this process)."""

from __future__ import annotations

import asyncio

from hetspec import Engine, SamplingParams, SpeculationConfig
from hetspec.algorithms import Draft

from deployments.workers.api import DraftItem, OpenSession, VerifyItem, VerifyResult
from serve_fixtures import in_process_coordinator, small_app_args

PROMPTS = ["def fibonacci(n):\n", "The capital of France is", "SELECT name, COUNT(*) FROM users WHERE",
           "Once upon a time"]
NEW_TOKENS = 14


def _served(exit_stack, gemma, smollm, **pipeline):
    """(coordinator, target worker, drafter worker) in this process, load-adaptive SLEM, shut down after the test."""
    return exit_stack.enter_context(in_process_coordinator(
        gemma, smollm, speculation={"algorithm": "slem", "load_adaptive": True}, pipeline=pipeline))


def test_served_requests_with_load_adaptive_equal_the_target_alone(exit_stack, gemma, smollm):
    from deployments.serving.request import GenerationRequest

    coordinator, target_worker, drafter_worker = _served(exit_stack, gemma, smollm)
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
    policy = coordinator.loop.scheduler.adaptive
    assert policy.seconds and policy.chosen, "the policy was asked and measured rounds"
    assert {k for _, k in policy.chosen} >= {0}, "it probed k = 0 (plain batched decoding)"
    assert any(stats.drafted_tokens for _, stats in served)
    # each request's statistics count the requests its verification passes fed, as the library's do (1 before)
    assert all(1 <= stats.mean_batch_size <= len(PROMPTS) for _, stats in served)
    assert max(stats.mean_batch_size for _, stats in served) > 2
    assert len(target_worker.sessions) == len(drafter_worker.sessions) == 0 and not len(coordinator.loop.scheduler)


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
    loop, caps = coordinator.loop, []
    loop.drafts_soon = lambda: False  # as when others run at a cap of 0
    loop.scheduler.adaptive.choose = lambda own: caps.pop(0) if caps else 0
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
    del loop.drafts_soon  # the replica's own: nobody else running, it would draft
    assert loop.drafts_soon()
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
    (deployments/serving/replica_loop.py): each chunk shares the pass of the others' verifications, and the
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
    """In step, a prompt joining while another request decodes goes a chunk per step with its verify call; until it
    is in the cache the request counts as a row being fed (None), as in process (hetspec/step.py ``Scheduler``)."""
    from deployments.serving.request import GenerationRequest

    coordinator, target_worker, _ = _served(exit_stack, gemma, smollm, pipelined=False, prefill_chunk_tokens=16)
    prompt = "def moving_average(values, window):\n    " * 5
    prompt_ids = gemma.encode_prompt(prompt)
    assert len(prompt_ids) > 3 * 16
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    prepared = coordinator.prepare(GenerationRequest(prompt=prompt, algorithm="slem", params=params))
    adaptive, seen = coordinator.loop.scheduler.adaptive, []  # per step: (its own length, its target KV length)
    choose = adaptive.choose

    def choosing(own):
        for request, length in own.items():
            if request.session_id == prepared.session_id:
                with target_worker.sessions.use(prepared.session_id) as session:
                    seen.append((length, session.side.session.length))
        return choose(own)

    adaptive.choose = choosing

    async def run():
        other = coordinator.run(coordinator.prepare(GenerationRequest(
            prompt="Once upon a time", algorithm="slem", params=SamplingParams(max_new_tokens=40, ignore_eos=True))),
            "test")
        await anext(other)  # it decodes: the long prompt joins a running batch
        joining = asyncio.ensure_future(_tokens(coordinator.run(prepared, "test")))
        [event async for event in other]
        token_ids = await joining
        await coordinator.admission.closes_done()
        return token_ids

    token_ids = asyncio.run(run())
    feeding = [cached for length, cached in seen if length is None]
    assert len(feeding) >= -(-(len(prompt_ids) - 1) // 16) and feeding == sorted(feeding), "a chunk per step"
    first_row = next(cached for length, cached in seen if length is not None)
    assert first_row == len(prompt_ids) - 1, "the whole prompt but its last token, fed before it joined"
    alone = Engine(gemma, smollm).generate(prompt, params, speculation=SpeculationConfig(algorithm="ar")).token_ids
    assert token_ids == alone


async def _tokens(events) -> list[int]:
    return [token for event in [event async for event in events] for token in event.token_ids]


def test_in_step_the_first_token_is_the_targets_own_and_waits_for_no_drafter_pass(exit_stack, gemma, smollm):
    """In step a drafter session opens without its prompt: drafted on the first step, that prefill held the first
    token (first tokens later than with speculation off: docs/decisions/load-adaptive-draft-length.md). Drafting
    starts at the second step, in process as served (``Progress.draft_length``); the output stays the target's."""
    from deployments.serving.request import GenerationRequest

    coordinator, _, drafter_worker = exit_stack.enter_context(in_process_coordinator(
        gemma, smollm, speculation={"algorithm": "slem"}, pipeline={"pipelined": False}))
    steps = []
    coordinator.loop.on_step = steps.append
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


def test_a_lone_requests_steps_price_the_draft_length_policy(exit_stack, gemma, smollm):
    """A request alone on an idle replica starts at once (its first verify pass feeds its prompt): from its second
    step on, its steps price their draft length, as in process. (Its prompt was counted as not fed for good once,
    so no step was priced: the policy explored at random for ever, half its steps plain at 1 client.)"""
    from deployments.serving.request import GenerationRequest

    coordinator, _, _ = _served(exit_stack, gemma, smollm, pipelined=False)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)

    async def run():
        events = [event async for event in coordinator.run(coordinator.prepare(
            GenerationRequest(prompt="def fibonacci(n):\n", algorithm="slem", params=params)), "test")]
        await coordinator.admission.closes_done()
        return events

    asyncio.run(run())
    adaptive = coordinator.loop.scheduler.adaptive
    assert sum(len(seconds) for seconds in adaptive.seconds.values()) >= len(adaptive.chosen) - 2
