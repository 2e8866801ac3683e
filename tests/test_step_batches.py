"""deployments/serving/pipeline.py StepBatches: when the coordinator sends its requests' draft and verify calls
together."""

from __future__ import annotations

import asyncio

import pytest

from deployments.errors import WorkerLost
from deployments.serving.pipeline import Phase, StepBatches

DRAFT, VERIFY = Phase.DRAFT, Phase.VERIFY


class Recorder:
    """A worker whose batch calls are recorded and answered with each item."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list]] = []
        self.gate: asyncio.Event | None = None  # set: calls wait for it before answering

    @property
    def identity(self) -> int:
        return id(self)

    def draft(self, items: list):
        return self._answer("draft", items)

    def verify(self, items: list):
        return self._answer("verify", items)

    def _answer(self, method: str, items: list):
        self.calls.append((method, list(items)))

        async def answer():
            if self.gate is not None:
                await self.gate.wait()
            return list(items)

        return asyncio.ensure_future(answer())


def test_one_request_alone_is_never_held_back():
    async def scenario():
        batches, worker, member = StepBatches(max_wait_s=60), Recorder(), object()
        batches.join(member)
        assert await asyncio.wait_for(batches.call(member, worker, VERIFY, "a"), 1) == "a"
        assert worker.calls == [("verify", ["a"])]

    asyncio.run(scenario())


def test_calls_leave_together_once_nobody_else_is_about_to_call():
    async def scenario():
        batches, target, drafter = StepBatches(max_wait_s=60), Recorder(), Recorder()
        a, b, c = object(), object(), object()
        for member in (a, b, c):
            batches.join(member)
        verify_a = asyncio.ensure_future(batches.call(a, target, VERIFY, "a"))
        verify_b = asyncio.ensure_future(batches.call(b, target, VERIFY, "b"))
        await asyncio.sleep(0.05)
        assert target.calls == []  # c is free: it may be about to verify too
        draft_c = asyncio.ensure_future(batches.call(c, drafter, DRAFT, "c"))
        assert await asyncio.wait_for(asyncio.gather(verify_a, verify_b, draft_c), 1) == ["a", "b", "c"]
        assert target.calls == [("verify", ["a", "b"])] and drafter.calls == [("draft", ["c"])]

    asyncio.run(scenario())


def test_a_call_in_flight_is_waited_for_and_a_slow_member_is_not():
    async def scenario():
        batches, target, drafter = StepBatches(max_wait_s=0.2), Recorder(), Recorder()
        a, b = object(), object()
        batches.join(a)
        batches.join(b)
        drafter.gate = asyncio.Event()
        draft_b = asyncio.ensure_future(batches.call(b, drafter, DRAFT, "b"))
        await asyncio.sleep(0.3)  # a is free (busy elsewhere) past max_wait_s: b's draft leaves without it
        verify_a = asyncio.ensure_future(batches.call(a, target, VERIFY, "a"))
        await asyncio.sleep(0.4)  # past max_wait_s: still waiting, since b's call is in flight
        assert drafter.calls == [("draft", ["b"])] and target.calls == []
        drafter.gate.set()
        assert await draft_b == "b"
        # b is back and free (it would verify next); it gets max_wait_s, then a leaves alone
        assert await asyncio.wait_for(verify_a, 1) == "a"
        assert target.calls == [("verify", ["a"])]

    asyncio.run(scenario())


def test_a_cancelled_caller_leaves_the_batch_and_errors_reach_every_caller():
    async def scenario():
        batches, target = StepBatches(max_wait_s=60), Recorder()
        a, b, c = object(), object(), object()
        for member in (a, b, c):
            batches.join(member)
        verify_a = asyncio.ensure_future(batches.call(a, target, VERIFY, "a"))
        verify_b = asyncio.ensure_future(batches.call(b, target, VERIFY, "b"))
        await asyncio.sleep(0)
        verify_a.cancel()  # its client went away: its task unwinds, then leaves
        await asyncio.sleep(0)
        batches.leave(a)
        batches.leave(c)  # c finished: b is the last one
        assert await asyncio.wait_for(verify_b, 1) == "b"
        assert target.calls == [("verify", ["b"])]

        class Lost(Recorder):
            def verify(self, items):
                raise WorkerLost("target")

        with pytest.raises(WorkerLost):
            await asyncio.wait_for(batches.call(b, Lost(), "verify", "b"), 1)

    asyncio.run(scenario())


def test_with_one_model_at_a_time_the_others_wait_for_the_call_in_flight_and_the_phases_merge():
    """Drafter and target on the same cores, in step: a request drafting while another verifies would run both
    models at once on every thread; one waits, and the request the first call frees joins it."""
    async def scenario():
        batches, target, drafter = StepBatches(max_wait_s=60, one_model_at_a_time=True), Recorder(), Recorder()
        a, b = object(), object()
        batches.join(a)
        batches.join(b)
        target.gate = asyncio.Event()
        verify_a = asyncio.ensure_future(batches.call(a, target, VERIFY, "a"))
        draft_b = asyncio.ensure_future(batches.call(b, drafter, DRAFT, "b"))  # out of phase with a
        await asyncio.sleep(0.05)
        assert target.calls == [("verify", ["a"])] and drafter.calls == []
        target.gate.set()
        assert await verify_a == "a"
        draft_a = asyncio.ensure_future(batches.call(a, drafter, DRAFT, "a2"))  # a's next step
        assert await asyncio.wait_for(asyncio.gather(draft_b, draft_a), 1) == ["b", "a2"]
        assert drafter.calls == [("draft", ["b", "a2"])], "one draft call for both: back in phase"

    asyncio.run(scenario())


def test_with_one_model_at_a_time_a_lone_drafting_request_is_not_starved_by_the_decoding_ones():
    """Three requests decoding plain call the target again as soon as each call is back; a fourth drafting
    waited for the drafter until they had all finished (a 22.7 s stall in a served run). Its draft goes next."""
    async def scenario():
        batches, target, drafter = StepBatches(max_wait_s=60, one_model_at_a_time=True), Recorder(), Recorder()
        plain, drafting = [object(), object(), object()], object()
        for member in (*plain, drafting):
            batches.join(member)

        async def decode(member, steps):
            for step in range(steps):
                await batches.call(member, target, VERIFY, step)
            batches.leave(member)

        async def draft_then_verify():
            await batches.call(drafting, drafter, DRAFT, "d")
            await batches.call(drafting, target, VERIFY, "d")
            batches.leave(drafting)

        await asyncio.wait_for(asyncio.gather(*(decode(member, 6) for member in plain), draft_then_verify()), 2)
        methods = [method for method, _ in target.calls + drafter.calls]
        assert methods.count("verify") == 6 and drafter.calls == [("draft", ["d"])]
        # the draft went after the first target call, and the drafting request's verify rode the second
        assert target.calls[0] == ("verify", [0, 0, 0]) and target.calls[1] == ("verify", [1, 1, 1, "d"])

    asyncio.run(scenario())
