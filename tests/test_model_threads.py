"""deployments/runtime/model_threads.py: which threads run a worker's model work, and how many OpenMP threads each
uses."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from deployments.runtime import model_threads
from deployments.workers import model_workers as workers
from deployments.config import AppConfig
from deployments.runtime.model_threads import ModelThreads, torch_openmp
from deployments.workers.api import OpenSession, VerifyItem
from deployments.workers.model_workers import TargetWorker
from hetspec.algorithms import Draft
from hetspec import SamplingParams, SpeculationConfig
from hetspec.config import ModelConfig

SMALL_PAIR = {"target": {"model": "gemma3-270m"}, "drafter": {"model": "smollm2-135m"}}


def _openmp_threads_here() -> int:
    """OpenMP's thread count for the calling thread (what torch's CPU kernels use), from torch's libgomp."""
    openmp = torch_openmp()
    assert openmp is not None, "torch's CPU wheel ships its OpenMP runtime (libgomp)"
    return openmp.omp_get_max_threads()


def _where() -> tuple[str, int]:
    return threading.current_thread().name, _openmp_threads_here()


def _fresh_thread_openmp() -> int:
    seen: list[int] = []
    probe = threading.Thread(target=lambda: seen.append(_openmp_threads_here()))
    probe.start()
    probe.join()
    return seen[0]


def _while_the_first_lane_is_held(lanes: ModelThreads, *side_work):
    """Runs each of ``side_work`` while a call holds the first lane: their results, then the held call's."""
    held, release = threading.Event(), threading.Event()

    def hold() -> tuple[str, int]:
        held.set()
        assert release.wait(30)
        return _where()

    with ThreadPoolExecutor(1 + len(side_work)) as callers:
        first = callers.submit(lanes.run, hold)
        assert held.wait(30)
        side = [callers.submit(lanes.run, work) for work in side_work]
        results = [future.result()[0] for future in side]
        release.set()
        return results, first.result()[0]


def test_worker_runs_every_forward_on_its_model_threads_with_torch_thread_count(exit_stack, gemma):
    """A Ray actor runs calls on a pool of threads; a new thread starts at OpenMP's default thread count, not
    at torch.set_num_threads's, so the worker runs model work on threads of its own that it sizes."""
    before, wanted = torch.get_num_threads(), _fresh_thread_openmp() + 1  # unlike what a fresh thread gets
    torch.set_num_threads(wanted)
    seen: list[tuple[str, int]] = []
    hook = gemma.model.register_forward_pre_hook(lambda module, args: seen.append(_where()))
    try:
        pipeline = AppConfig.model_validate({**SMALL_PAIR, "pipeline": {"model_lanes": 1}}).pipeline
        worker = exit_stack.enter_context(TargetWorker(gemma, pipeline))
        prompt_ids = gemma.encode_prompt("def add(a, b):")

        def one_request(index: int):
            worker.open(OpenSession(f"r{index}", prompt_ids, "slem", SpeculationConfig(), SamplingParams()))
            try:
                [result] = worker.verify([VerifyItem(f"r{index}", Draft())])
                return result
            finally:
                worker.close(f"r{index}")

        results = []
        for index in range(3):  # like an actor's pool: each call on another thread (one request at a time)
            with ThreadPoolExecutor(1) as caller:
                results.append(caller.submit(one_request, index).result())
        assert len({tuple(result.new_ids) for result in results}) == 1 and all(r.seconds > 0 for r in results)
        assert len(seen) >= 3 and {name for name, _ in seen} == {"hetspec-target_0"}
        assert {threads for _, threads in seen} == {wanted}
    finally:
        hook.remove()
        torch.set_num_threads(before)


def test_worker_loads_its_model_on_its_first_lane(exit_stack, monkeypatch, gemma):
    """Loading runs torch's parallel kernels; on the constructor's thread they would leave a second team."""
    loaded_on: list[str] = []

    def load_model(*args, **kwargs):
        loaded_on.append(threading.current_thread().name)
        return gemma

    monkeypatch.setattr(workers, "load_model", load_model)
    pipeline = AppConfig.model_validate(SMALL_PAIR).pipeline
    worker = exit_stack.enter_context(TargetWorker(ModelConfig(model="gemma3-270m"), pipeline))
    assert worker.model is gemma and loaded_on == ["hetspec-target_0"]


def test_model_threads_split_the_cpu_threads_among_the_calls_running(exit_stack, monkeypatch):
    monkeypatch.setattr(model_threads, "usable_cpus", lambda: 8)  # 4 spare: a side lane may use 4 too
    lanes = exit_stack.enter_context(ModelThreads("lane", lanes=2, threads=4))
    assert lanes.side_lane_threads == 4
    assert lanes.run(_where)[0] == ("lane_0", 4)  # alone: every thread
    (side,), first = _while_the_first_lane_is_held(lanes, _where)
    assert side == ("lane_side", 2)  # two calls running: half each
    assert first == ("lane_0", 4)  # sized when it started alone
    assert lanes.run(_where)[0] == ("lane_0", 4)  # alone again: the first lane, every thread


def test_requests_at_the_other_model_count_as_one_more_call(exit_stack):
    """Drafter and target share the cores: while other requests are at the other model, a pass alone here
    takes half the threads, not all (at 4 clients the 2-thread drafter otherwise ran 2.4x slower)."""
    elsewhere = [0]
    lanes = exit_stack.enter_context(ModelThreads("shared", lanes=1, threads=4, at_other_model=lambda: elsewhere[0]))
    assert lanes.run(_where)[0] == ("shared_0", 4)  # every request in this call (a batch): every thread
    elsewhere[0] = 2
    assert lanes.run(_where)[0] == ("shared_0", 2)


@pytest.mark.parametrize("placement, pipelined, counted", [("PACK", True, 1), ("STRICT_SPREAD", True, 0),
                                                          ("PACK", False, 0)])
def test_a_worker_counts_requests_at_the_other_model_only_where_both_models_run_at_once_on_shared_cores(
        exit_stack, gemma, placement, pipelined, counted):
    """Not pipelined, requests go in step (draft together, then verify together): the models take turns."""
    pipeline = AppConfig.model_validate({**SMALL_PAIR, "pipeline": {"placement_strategy": placement,
                                                                    "pipelined": pipelined}}).pipeline
    worker = exit_stack.enter_context(TargetWorker(gemma, pipeline))
    for request_id in ("r", "s"):
        worker.open(OpenSession(request_id, gemma.encode_prompt("def add(a, b):"), "slem", SpeculationConfig(),
                                SamplingParams()))
    try:
        assert worker.model_threads.at_other_model() == 2 * counted  # both between calls here
        with worker.sessions.use("r"), worker.sessions.use("s"):  # both in one batched call: its pass gets every
            assert worker.model_threads.at_other_model() == 0  # thread (docs/decisions/model-threads.md)
        with worker.sessions.use("r"):
            assert worker.model_threads.at_other_model() == counted
    finally:
        worker.close("r")
        worker.close("s")


def test_a_side_lane_uses_only_the_cpus_the_first_lane_leaves(exit_stack, monkeypatch):
    monkeypatch.setattr(model_threads, "usable_cpus", lambda: 2)
    lanes = exit_stack.enter_context(ModelThreads("tight", lanes=3, threads=2))
    assert lanes.side_lane_threads == 1
    sides, first = _while_the_first_lane_is_held(lanes, _where, _where)
    assert sides == [("tight_side", 1), ("tight_side", 1)] and first == ("tight_0", 2)


def test_calls_wait_for_a_lane_and_errors_reach_the_caller(exit_stack):
    lanes = exit_stack.enter_context(ModelThreads("one", lanes=1, threads=2))

    def fails():
        raise ValueError("bad draft")

    with pytest.raises(ValueError, match="bad draft"):
        lanes.run(fails)
    with ThreadPoolExecutor(4) as callers:  # one lane: every call runs there, one at a time, all answered
        assert {result[0] for result in callers.map(lambda _: lanes.run(_where), range(8))} == {("one_0", 2)}


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _matmul() -> float:  # big enough for MKL to run it on a team of threads
    square = torch.ones(512, 512)
    return float((square @ square)[0, 0])


def test_a_one_thread_share_runs_mkl_on_one_thread_too(exit_stack):
    """torch's CPU attention and float32 matmuls run in MKL, which keeps its own thread count: sized by
    OpenMP alone, a one-thread call still made a team of two, and the teams then outnumbered the CPUs."""
    # another request: a share of 1
    lanes = exit_stack.enter_context(ModelThreads("mkl", lanes=1, threads=2, at_other_model=lambda: 1))
    lanes.run(lambda: None)
    settled = _os_threads()
    assert lanes.run(_matmul)[0] == 512.0
    assert _os_threads() == settled


def test_a_side_lane_ends_when_the_first_lane_is_free_and_its_openmp_team_with_it(exit_stack, monkeypatch):
    """libgomp stops spinning once its teams hold more threads than there are CPUs (every parallel region
    then waits on a futex: the int8 drafter's token 2.5x slower), so no side lane's team may outlive it."""
    monkeypatch.setattr(model_threads, "usable_cpus", lambda: 8)  # a side lane gets 2 threads: a team
    lanes = exit_stack.enter_context(ModelThreads("teams", lanes=2, threads=4))
    lanes.run(_matmul)
    settled = _os_threads()
    (side,), _ = _while_the_first_lane_is_held(lanes, _matmul)
    assert side == 512.0
    deadline = time.monotonic() + 10
    while _os_threads() > settled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _os_threads() == settled
    assert not [thread for thread in threading.enumerate() if thread.name == "teams_side"]


def test_a_shut_down_worker_frees_its_sessions_and_ends_every_thread_it_started_openmp_teams_included(gemma):
    """A worker built in a process that goes on: its sweeper, heap trimmer and model lanes (with their OpenMP
    teams) end at shutdown. Left running, 22 workers' teams slowed this suite's later model tests ~1.5x."""
    pipeline = AppConfig.model_validate({**SMALL_PAIR, "pipeline": {"heap_trim_interval_s": 30}}).pipeline
    # a first worker, built and shut down: the one-time thread pools the process keeps after first use (torch's,
    # OpenMP's) are then there before the count (run alone, the count otherwise grew by one of those)
    with TargetWorker(gemma, pipeline) as warm_up:
        warm_up.open(OpenSession("w", gemma.encode_prompt("def add(a, b):"), "slem", SpeculationConfig(),
                                 SamplingParams()))
        warm_up.verify([VerifyItem("w", Draft())])
    before, taken_before = _os_threads(), set(gemma.kv_pool.taken)  # the session-wide model's other users
    with TargetWorker(gemma, pipeline) as worker:
        worker.open(OpenSession("r", gemma.encode_prompt("def add(a, b):"), "slem", SpeculationConfig(),
                                SamplingParams()))
        worker.verify([VerifyItem("r", Draft())])  # model work on the first lane: a team of two
        assert _os_threads() > before and len(worker.sessions) == 1
    assert len(worker.sessions) == 0 and gemma.kv_pool.taken == taken_before
    deadline = time.monotonic() + 10
    while _os_threads() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _os_threads() <= before  # every thread it started has ended (another may have ended meanwhile)
    with pytest.raises(RuntimeError, match="stopped"):
        worker.model_threads.run(lambda: None)
