"""The replica's one decode loop (deployments/serving/replica_loop.py): the library's scheduler and step, the passes in
the drafter and target workers (in this process, on the small pair's real models). Served, a request takes the
steps the library gives it; requests leave at step boundaries without harming the others."""

from __future__ import annotations

import asyncio

import pytest

from hetspec import Engine, SamplingParams, SpeculationConfig

from serve_fixtures import in_process_coordinator

PROMPT = "def fibonacci(n):\n    "


def _fixed(exit_stack, gemma, smollm, **pipeline):
    """A coordinator whose draft length is fixed (load-adaptive off), in step unless ``pipeline`` says otherwise."""
    return exit_stack.enter_context(in_process_coordinator(
        gemma, smollm, speculation={"algorithm": "slem", "draft_tokens": 3, "load_adaptive": False},
        pipeline={"pipelined": False, **pipeline}))


async def _run(coordinator, request) -> tuple[list[int], object]:
    events = [event async for event in coordinator.run(coordinator.prepare(request), "test")]
    return [token for event in events for token in event.token_ids], events[-1].stats


@pytest.mark.parametrize("algorithm, sampling", [("slem", {}), ("tli", {}), ("tli", {"temperature": 0.8, "seed": 5}),
                                                 ("slrs", {"temperature": 1.0, "seed": 2})])
def test_a_served_request_takes_the_target_passes_the_library_gives_it_alone(exit_stack, gemma, smollm, algorithm,
                                                                             sampling):
    """Same tokens and the same number of target passes (and drafter passes) served as in process, alone, at a
    fixed draft length: the replica runs the library's step, not a copy of it."""
    from deployments.serving.request import GenerationRequest

    coordinator, target_worker, drafter_worker = _fixed(exit_stack, gemma, smollm)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True, **sampling)
    speculation = SpeculationConfig(algorithm=algorithm, draft_tokens=3)
    library = Engine(gemma, smollm, speculation=speculation).generate(PROMPT, params)

    async def served():
        result = await _run(coordinator, GenerationRequest(prompt=PROMPT, algorithm=algorithm, params=params))
        await coordinator.admission.closes_done()
        return result

    token_ids, stats = asyncio.run(served())
    assert token_ids == library.token_ids
    assert stats.target_forwards == library.stats.target_forwards
    assert stats.drafted_tokens == library.stats.drafted_tokens
    assert stats.accepted_tokens == library.stats.accepted_tokens
    assert len(target_worker.sessions) == len(drafter_worker.sessions) == 0


def test_a_request_leaving_mid_batch_frees_its_sessions_and_the_others_go_on(exit_stack, gemma, smollm):
    """Three requests step together; one consumer stops after its first tokens (a client gone): it leaves at the
    next step boundary, its sessions are closed, and the other two finish with the library's tokens."""
    from deployments.serving.request import GenerationRequest

    coordinator, target_worker, drafter_worker = _fixed(exit_stack, gemma, smollm)
    prompts = [PROMPT, "The capital of France is", "Once upon a time"]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    library = Engine(gemma, smollm, speculation=SpeculationConfig(algorithm="slem", draft_tokens=3))

    async def leaving():
        events = coordinator.run(coordinator.prepare(GenerationRequest(prompt=prompts[0], params=params)), "test")
        await anext(events)
        await events.aclose()  # the client went away

    async def run():
        stays = [asyncio.ensure_future(_run(coordinator, GenerationRequest(prompt=prompt, params=params)))
                 for prompt in prompts[1:]]
        await leaving()
        batch = [len(coordinator.loop.scheduler)]
        results = await asyncio.gather(*stays)
        await coordinator.admission.closes_done()
        return results, batch

    results, batch = asyncio.run(run())
    assert batch == [2], "the one that left is out of the loop at once"
    for prompt, (token_ids, stats) in zip(prompts[1:], results):
        assert token_ids == library.generate(prompt, params).token_ids, prompt
    assert coordinator.outcomes["cancelled"] == 1 and coordinator.outcomes["finished"] == 2
    assert len(target_worker.sessions) == len(drafter_worker.sessions) == 0
    assert target_worker.model.kv_pool.taken == set() and drafter_worker.model.kv_pool.taken == set()


def test_a_request_whose_target_session_is_gone_fails_alone(exit_stack, gemma, smollm):
    """One item of the step's verify call fails (its target session closed behind its back): that request fails
    with the worker's error, the other request of the same calls finishes with the library's tokens."""
    from deployments.errors import UnknownSession
    from deployments.serving.request import GenerationRequest

    coordinator, target_worker, _ = _fixed(exit_stack, gemma, smollm)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)

    async def run():
        victim = coordinator.run(coordinator.prepare(GenerationRequest(prompt=PROMPT, params=params)), "test")
        other = asyncio.ensure_future(_run(coordinator, GenerationRequest(prompt="Once upon a time", params=params)))
        await anext(victim)
        [session_id] = [request.session_id for request in coordinator.loop.scheduler.running
                        if request.target.ids[:request.target.prompt_len] == gemma.encode_prompt(PROMPT)]
        target_worker.close(session_id)
        with pytest.raises(UnknownSession):
            async for _ in victim:
                pass
        return await other

    token_ids, _ = asyncio.run(run())
    library = Engine(gemma, smollm, speculation=SpeculationConfig(algorithm="slem", draft_tokens=3))
    assert token_ids == library.generate("Once upon a time", params).token_ids
    assert coordinator.outcomes["failed"] == 1


def test_pipelined_served_requests_draft_ahead_in_the_step_and_output_the_target_alone(exit_stack, gemma, smollm):
    """Pipelined, the step's draft call for the next step goes beside its verify call (hetspec/ahead.py): greedy SLEM
    output is the target's, and drafts made ahead were used."""
    from deployments.serving.request import GenerationRequest

    coordinator, _, _ = _fixed(exit_stack, gemma, smollm, pipelined=True)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    prompts = [PROMPT, "1, 2, 3, 4, 5,"]

    async def run():
        return await asyncio.gather(*(_run(coordinator, GenerationRequest(prompt=prompt, params=params))
                                      for prompt in prompts))

    results = asyncio.run(run())
    alone = Engine(gemma, smollm, speculation=SpeculationConfig(algorithm="ar"))
    for prompt, (token_ids, stats) in zip(prompts, results):
        assert token_ids == alone.generate(prompt, params).token_ids, prompt
        assert stats.pipelined
    assert sum(stats.pipeline_hits for _, stats in results) > 0
