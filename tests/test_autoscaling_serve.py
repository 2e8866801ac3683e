"""Autoscaling and routing of the real app (the small pair, float32) on a private Ray instance.

1. Scale up and down under load: one replica to two while closed-loop clients send more than one replica
   admits, both serving; back to one once the load stops. No request fails, is cut, or differs from the
   library's greedy tokens during either transition, and the removed replica's actors, placement group and
   KV sessions are gone. The timeline (``-s``) says when each step happened; nothing asserts on timing.
2. Routing that uses the capacity there is: two replicas, as many closed-loop clients as both admit together
   (HTTP and gRPC), and not one 429 (the request router sends a generation where the admission has room:
   deployments/serving/routing.py).
3. A target killed on one of two pipelines while both decode batches: that pipeline's requests end with an
   error naming the target, the other pipeline's finish with the library's tokens, and once the target is
   replaced every request is right again.

Replicas are told apart by their Serve log files (one per replica, ``request done`` once per finished request).
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest
import yaml

from deployments.tools.local_serve import local_serve, wait_until_running
from hetspec import Engine, SamplingParams, SpeculationConfig
from protos.hetspec.v1 import hetspec_pb2 as pb
from protos.hetspec.v1 import hetspec_pb2_grpc as pb_grpc
from serve_fixtures import SMALL_CONFIG, serve_logs_dir, small_app_args

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]

APP_NAME = "hetspec"
DEPLOYMENT = "HetSpecServer"
NEW_TOKENS = 6
PROMPTS = ("def fibonacci(n):\n", "The capital of France is")
# One simulated node with room for two pipelines (each: 0.1 + 0.5 + 0.5 CPUs) and nothing more.
NODES = ({"num_cpus": 3},)
STATE_DEADLINE_S = 420.0  # a new pipeline loads two models on busy cores; generous, never a timing claim
# One replica admits 2 + 1 requests (deployments/app.py, replica_capacity); the loads below are measured in it.
LIMITS = {"max_running_requests": 2, "max_waiting_requests": 1, "default_max_new_tokens": NEW_TOKENS,
          "request_timeout_s": 300}
# While the second pipeline loads, the first holds every client: its line is long enough for all of them (with
# every replica full the request router sends the request anyway, and the replica answers 429).
SCALING_LIMITS = {**LIMITS, "max_waiting_requests": 4}


@pytest.fixture(scope="module")
def reference(gemma) -> dict[str, list[int]]:
    """The target alone, greedy (``ar`` in this process): what every served request must return."""
    engine = Engine(gemma)
    return {prompt: engine.generate(prompt, SamplingParams(max_new_tokens=NEW_TOKENS),
                                    speculation=SpeculationConfig(algorithm="ar")).token_ids
            for prompt in PROMPTS}


@dataclass
class App:
    http_url: str
    grpc_target: str
    model_id: str


@contextmanager
def _served(autoscaling: dict, limits: dict = LIMITS):
    config = yaml.safe_load(SMALL_CONFIG.read_text())
    config["applications"][0]["args"] = small_app_args(autoscaling=autoscaling, limits=limits)
    with local_serve(config, NODES) as served:
        wait_until_running(APP_NAME, STATE_DEADLINE_S)
        yield App(served.http_url, served.grpc_target, config["applications"][0]["args"]["model_id"])


@pytest.fixture
def autoscaling_app():
    """One replica, up to two, scaling on one ongoing request per replica with short delays."""
    with _served({"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1, "upscale_delay_s": 1,
                  "downscale_delay_s": 5, "look_back_period_s": 12}, SCALING_LIMITS) as app:
        yield app


@pytest.fixture(scope="module")  # the tests below share it; the kill test runs last and restores it
def two_pipelines_app():
    with _served({"min_replicas": 2, "max_replicas": 2}) as app:
        _until(lambda: _replica_states() == {"RUNNING": 2}, "two replicas running")
        yield app


# --- what the cluster holds --------------------------------------------------------------------------------------

def _replica_states() -> dict[str, int]:
    from ray import serve

    deployment = serve.status().applications[APP_NAME].deployments[DEPLOYMENT]
    return {state: count for state, count in deployment.replica_states.items() if count}


def _alive_actors() -> dict[str, int]:
    from ray.util.state import list_actors

    counts: dict[str, int] = {}
    for actor in list_actors(filters=[("state", "=", "ALIVE")], limit=1000):
        counts[actor.class_name] = counts.get(actor.class_name, 0) + 1
    return counts


def _pipeline_actors() -> dict[str, int]:
    """Alive replicas, drafters and targets, and the placement groups holding them."""
    import ray

    alive = _alive_actors()
    groups = sum(1 for group in ray.util.placement_group_table().values() if group["state"] == "CREATED")
    return {"replicas": sum(count for name, count in alive.items() if name.endswith(DEPLOYMENT)),
            "drafters": alive.get("DrafterWorker", 0), "targets": alive.get("TargetWorker", 0),
            "placement_groups": groups}


def _finished_by_replica() -> dict[str, int]:
    """Per replica (its Serve log file), the requests it finished."""
    return {re.sub(r"^replica_|\.log$", "", path.name): path.read_text(errors="replace").count("request done request_id=")
            for path in serve_logs_dir().glob(f"replica_{APP_NAME}_{DEPLOYMENT}_*.log")}


def _stats_once_idle(app: App) -> dict | None:
    """/v1/stats of a replica once its actors hold no session, else None."""
    stats = httpx.get(f"{app.http_url}/v1/stats", timeout=60).json()
    return stats if stats["target"]["active_sessions"] == stats["drafter"]["active_sessions"] == 0 else None


def _until(condition, what: str, deadline_s: float = STATE_DEADLINE_S):
    deadline = time.monotonic() + deadline_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"not {what} after {deadline_s} s"
        time.sleep(1.0)
    return value


# --- the load ------------------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    prompt: str
    streamed: bool
    status: int
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False  # a finish_reason came (and [DONE] on a stream): not cut
    error: str = ""


def _complete(client: httpx.Client, app: App, prompt: str, stream: bool) -> Outcome:
    body = {"model": app.model_id, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "stream": stream}
    url = f"{app.http_url}/v1/completions"
    try:
        if not stream:
            response = client.post(url, json=body)
            if response.status_code != 200:
                return Outcome(prompt, False, response.status_code, error=response.text[:300])
            answer = response.json()
            return Outcome(prompt, False, 200, answer["hetspec"]["token_ids"],
                           answer["choices"][0]["finish_reason"] is not None)
        with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                return Outcome(prompt, True, response.status_code, error=response.read().decode()[:300])
            return _read_stream(response, Outcome(prompt, True, 200))
    except httpx.HTTPError as error:  # a cut connection is an outcome the test reports
        return Outcome(prompt, stream, 0, error=repr(error))


def _read_stream(response: httpx.Response, outcome: Outcome, on_first_tokens=lambda: None) -> Outcome:
    """A completion stream's events into ``outcome``; ``on_first_tokens()`` once its first tokens came."""
    done = False
    for line in response.iter_lines():
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            event = json.loads(line[len("data: "):])
            outcome.error = outcome.error or event.get("error", {}).get("message", "")
            first_tokens = not outcome.token_ids
            outcome.token_ids += event.get("hetspec", {}).get("token_ids", [])
            outcome.finished |= any(choice.get("finish_reason") for choice in event.get("choices", []))
            if first_tokens and outcome.token_ids:
                on_first_tokens()
    outcome.finished &= done
    return outcome


def _generate_over_grpc(app: App, prompt: str) -> Outcome:
    """A unary gRPC Generate; RESOURCE_EXHAUSTED is counted as 429 (the same refusal)."""
    with grpc.insecure_channel(app.grpc_target) as channel:
        try:
            response = pb_grpc.HetSpecStub(channel).Generate(pb.GenerateRequest(prompt=prompt), timeout=300)
        except grpc.RpcError as error:
            status = 429 if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else 0
            return Outcome(prompt, False, status, error=f"{error.code()}: {error.details()}")
    return Outcome(prompt, False, 200, list(response.token_ids), bool(response.finish_reason))


class ClosedLoop:
    """``clients`` threads, each sending its next completion when the last one ends (odd clients stream),
    until ``stop`` or ``requests_each`` requests."""

    def __init__(self, app: App, clients: int, requests_each: int | None = None, grpc_clients: int = 0):
        """``grpc_clients``: how many of the clients send over gRPC (Serve's gRPC proxy routes with a router
        of its own, so two routers share the replicas, as several proxies do on a cluster)."""
        self.app, self.requests_each, self.grpc_clients = app, requests_each, grpc_clients
        self.outcomes: list[Outcome] = []
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(index,), daemon=True) for index in range(clients)]

    def __enter__(self) -> "ClosedLoop":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout=600)
            assert not thread.is_alive(), "a client's request neither finished nor failed"

    def join(self) -> None:
        for thread in self._threads:
            thread.join(timeout=STATE_DEADLINE_S)

    def _client(self, index: int) -> None:
        sent = 0
        with httpx.Client(timeout=300) as client:
            while not self._stopping.is_set() and (self.requests_each is None or sent < self.requests_each):
                prompt = PROMPTS[(index + sent) % len(PROMPTS)]
                if index < self.grpc_clients:
                    self.outcomes.append(_generate_over_grpc(self.app, prompt))
                else:
                    self.outcomes.append(_complete(client, self.app, prompt, stream=index % 2 == 1))
                sent += 1


def _wrong(outcomes: list[Outcome], reference: dict[str, list[int]]) -> list[Outcome]:
    return [outcome for outcome in outcomes
            if outcome.status != 200 or outcome.error or not outcome.finished
            or outcome.token_ids != reference[outcome.prompt]]


class Timeline:
    def __init__(self):
        self.start = time.monotonic()
        self.events: list[tuple[float, str]] = []

    def mark(self, event: str) -> None:
        self.events.append((time.monotonic() - self.start, event))

    def __str__(self) -> str:
        return "\n".join(f"  t = {seconds:6.1f} s  {event}" for seconds, event in self.events)


# --- the tests -----------------------------------------------------------------------------------------------------

def test_load_adds_a_pipeline_that_serves_and_its_end_removes_it_with_every_answer_right(autoscaling_app,
                                                                                         reference):
    assert _replica_states() == {"RUNNING": 1}
    assert _pipeline_actors() == {"replicas": 1, "drafters": 1, "targets": 1, "placement_groups": 1}
    timeline = Timeline()
    # 4 clients, one replica runs 2 (and holds up to 4 in line): the ongoing requests
    # (4) are above target_ongoing_requests (1). One client stays through the scale-down, so requests are in
    # flight on the replica being removed (it drains them: lifecycle.graceful_shutdown_timeout_s).
    with ClosedLoop(autoscaling_app, clients=1) as steady:
        with ClosedLoop(autoscaling_app, clients=3) as burst:
            timeline.mark("load started: 4 closed-loop clients (one replica runs 2)")
            _until(lambda: sum(_replica_states().values()) == 2, "a second replica started")
            timeline.mark(f"Serve starts a second replica: {_replica_states()}")
            _until(lambda: _replica_states() == {"RUNNING": 2}, "two replicas running")
            timeline.mark("second replica RUNNING (its drafter and target loaded)")
            _until(lambda: len(_finished_by_replica()) == 2 and min(_finished_by_replica().values()) > 0,
                   "both replicas finishing requests")
            timeline.mark(f"second replica finished its first request; finished by replica: {_finished_by_replica()}")
            _until(lambda: min(_finished_by_replica().values()) >= 3, "the second replica serving a while")
        timeline.mark(f"load down to 1 client; finished by replica: {_finished_by_replica()}")
        _until(lambda: _replica_states() != {"RUNNING": 2}, "a replica being removed")
        timeline.mark(f"Serve removes a replica: {_replica_states()}; finished by replica: {_finished_by_replica()}")
        _until(lambda: _replica_states() == {"RUNNING": 1}, "back to one replica")
        timeline.mark(f"Serve back to one replica; finished by replica: {_finished_by_replica()}")
        _until(lambda: _pipeline_actors() == {"replicas": 1, "drafters": 1, "targets": 1, "placement_groups": 1},
               "the removed replica's actors and placement group gone", 120)
        timeline.mark("removed replica's drafter, target and placement group gone")
        served_before = len(steady.outcomes)
        _until(lambda: len(steady.outcomes) >= served_before + 2, "the steady client served after the scale-down")
    outcomes = burst.outcomes + steady.outcomes
    timeline.mark(f"load stopped after {len(outcomes)} requests; finished by replica: {_finished_by_replica()}")
    print(f"\nautoscaling timeline (1 -> 2 -> 1 replicas):\n{timeline}")

    finished = _finished_by_replica()
    assert len(finished) == 2 and min(finished.values()) > 0, finished
    # every request that reached a replica finished there (a replica logs its line once the answer is sent)
    _until(lambda: sum(_finished_by_replica().values()) == len(outcomes), "every request logged as done", 30)
    assert not _wrong(outcomes, reference), _wrong(outcomes, reference)[:3]
    # no session left behind on the replica that stays (the removed one's actors are gone with their sessions)
    stats = _until(lambda: _stats_once_idle(autoscaling_app), "the remaining replica's sessions closed", 60)
    assert stats["running_slots"] == stats["waiting_requests"] == 0, stats
    assert stats["target"]["kv_reserved_bytes"] == stats["drafter"]["kv_reserved_bytes"] == 0, stats


def test_two_pipelines_at_their_capacity_never_answer_429(two_pipelines_app, reference):
    # each replica admits 3 (2 running + 1 waiting): 6 clients fill both exactly, so one request sent to a
    # replica without room is a 429. Before deployments/serving/routing.py, Serve's router (which sees each replica's
    # ongoing requests against max_ongoing_requests, the capacity plus app.CONTROL_SLOTS) sent a 4th request to
    # a full replica once in 20 with 5 clients.
    with ClosedLoop(two_pipelines_app, clients=6, requests_each=5, grpc_clients=3) as load:
        load.join()
    statuses = sorted({outcome.status for outcome in load.outcomes})
    finished = _finished_by_replica()
    print(f"\ntwo replicas, 6 clients (3 gRPC) x 5 requests: statuses {statuses}, finished by replica {finished}")
    assert len(load.outcomes) == 30
    assert not [outcome for outcome in load.outcomes if outcome.status == 429], "a 429 within total capacity"
    assert not _wrong(load.outcomes, reference), _wrong(load.outcomes, reference)[:3]
    assert len(finished) == 2 and min(finished.values()) > 0, finished


KILL_NEW_TOKENS = 48  # long enough that a kill after every stream's first tokens lands while all of them decode


def _stream_through_a_kill(app: App, prompt: str, started: threading.Barrier) -> Outcome:
    """A streamed completion (EOS ignored) that waits at ``started`` once its first tokens came."""
    body = {"model": app.model_id, "prompt": prompt, "max_tokens": KILL_NEW_TOKENS, "temperature": 0,
            "stream": True, "hetspec": {"ignore_eos": True}}
    outcome = Outcome(prompt, True, 0)
    try:
        with httpx.stream("POST", f"{app.http_url}/v1/completions", json=body, timeout=300) as response:
            outcome.status = response.status_code
            _read_stream(response, outcome, on_first_tokens=lambda: started.wait(timeout=300))
    except httpx.HTTPError as error:  # a cut connection is an outcome the test reports
        outcome.error = outcome.error or repr(error)
    return outcome


def test_target_killed_on_one_pipeline_leaves_the_other_untouched(two_pipelines_app, reference, gemma):
    import ray
    from ray import serve

    prompt = PROMPTS[0]
    long_reference = Engine(gemma).generate(prompt, SamplingParams(max_new_tokens=KILL_NEW_TOKENS, ignore_eos=True),
                                            speculation=SpeculationConfig(algorithm="ar")).token_ids
    # one replica's target, fetched first: the kill must land while the requests decode
    target = serve.get_deployment_handle(DEPLOYMENT, app_name=APP_NAME).actor_handles.remote().result(
        timeout_s=60)["target"]
    # 4 streams: a replica runs 2, and the router counts each from its choice, so each replica gets 2
    streams = 4
    started = threading.Barrier(streams + 1)
    with ThreadPoolExecutor(streams) as pool:
        futures = [pool.submit(_stream_through_a_kill, two_pipelines_app, prompt, started) for _ in range(streams)]
        started.wait(timeout=300)
        ray.kill(target)
        outcomes = [future.result(timeout=300) for future in futures]
    right = [o for o in outcomes if o.status == 200 and not o.error and o.finished and o.token_ids == long_reference]
    lost = [o for o in outcomes if o.error]
    print(f"\ntarget killed on one of two pipelines: {len(right)} right, {len(lost)} told: "
          f"{[outcome.error[:120] for outcome in lost]}")
    assert len(right) == 2 and len(lost) == 2, outcomes  # the other pipeline's two untouched
    for outcome in lost:  # told why, naming the target, after tokens that were right
        assert "target" in outcome.error and outcome.token_ids == long_reference[:len(outcome.token_ids)], outcome
    # the target is replaced (503 meanwhile, naming it; or, for a request that meets the dead actor before the
    # replica learns of the loss, which depends on which error Ray raises first, an error event naming the
    # target); then both pipelines answer right again
    deadline = time.monotonic() + STATE_DEADLINE_S
    while True:
        with ClosedLoop(two_pipelines_app, clients=4, requests_each=1) as after:
            after.join()
        statuses = {outcome.status for outcome in after.outcomes}
        assert statuses <= {200, 503}, after.outcomes
        told = [outcome.error for outcome in after.outcomes if outcome.error]
        assert all("target" in error for error in told), told
        if (statuses == {200} and not told) or time.monotonic() > deadline:
            break
        time.sleep(2.0)
    assert not _wrong(after.outcomes, reference), _wrong(after.outcomes, reference)[:3]
    assert _pipeline_actors() == {"replicas": 2, "drafters": 2, "targets": 2, "placement_groups": 2}
