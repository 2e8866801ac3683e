"""Cancellation and faults on the served app: sessions freed within a second, actors killed mid-request,
a model that fails to load.

One app for the module (tests/serve_fixtures.py: the small pair, float32, three simulated nodes). The
actors are killed for real (``ray.kill`` on the replica's actor handles); greedy output must stay the
target's alone, token for token. The in-process tests at the top need no Serve: the coordinator runs on
worker objects in this process, with a drafter that dies after a given number of calls.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from hetspec import Engine, SamplingParams, SpeculationConfig
from protos.hetspec.v1 import hetspec_pb2 as pb
from protos.hetspec.v1 import hetspec_pb2_grpc as pb_grpc
from serve_fixtures import in_process_coordinator, served_app, small_app_args  # noqa: F401 -- the module's fixture

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]

APP = "hetspec"
GRPC_METADATA = (("application", APP),)  # the module deploys a second app: name ours on every gRPC call
PROMPT = "def fibonacci(n):\n"
NEW_TOKENS = 24  # long enough that a kill after the first event lands mid-request
LONG_TOKENS = 200  # a request still running when the client goes away
LONG_NEW_TOKENS = 48  # several requests decoding together when an actor is killed
RECOVERY_DEADLINE_S = 180.0


@pytest.fixture(scope="module")
def long_reference(gemma):
    """The target alone, greedy, for the batched kill tests: long enough that a kill after each request's first
    event lands while all of them decode."""
    return Engine(gemma).generate(PROMPT, SamplingParams(max_new_tokens=LONG_NEW_TOKENS, ignore_eos=True),
                                  speculation=SpeculationConfig(algorithm="ar")).token_ids


@pytest.fixture(scope="module")
def reference(gemma):
    """The target alone, greedy (``ar`` in this process), ignoring EOS like the requests below."""
    engine = Engine(gemma)
    return engine.generate(PROMPT, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True),
                           speculation=SpeculationConfig(algorithm="ar")).token_ids


# --- in process: the coordinator's drafter-loss fallback -------------------------------------------------

class DrafterDyingAfter:
    """A drafter worker in this process whose ``draft`` calls fail with WorkerLost after ``drafts`` calls
    (``drafts=-1``: it is already gone when the request opens its session), as an actor's would."""

    def __init__(self, worker, drafts: int):
        from deployments.workers.clients import LocalWorker

        self.worker = worker
        self.local = LocalWorker(worker)
        self.drafts_left = drafts

    @property
    def identity(self) -> int:
        return self.local.identity

    def open(self, session):
        if self.drafts_left == -1:
            return self._lost()
        return self.local.open(session)

    def draft(self, items):
        if self.drafts_left in (-1, 0):
            return self._lost()
        self.drafts_left -= 1
        return self.local.draft(items)

    def close(self, request_id: str):
        return self.local.close(request_id)

    @staticmethod
    def _lost():
        from deployments.errors import WorkerLost

        lost = asyncio.get_running_loop().create_future()
        lost.set_exception(WorkerLost("drafter"))
        return lost

    def pinned(self):
        return self


@pytest.fixture(scope="module")
def local_coordinator(gemma, smollm):
    """A coordinator on worker objects in this process (built once: the vocabulary maps take seconds)."""
    with in_process_coordinator(gemma, smollm) as (coordinator, _, _):
        yield coordinator


@pytest.mark.parametrize("drafts, pipelined", [(-1, False), (1, False), (2, True)])
def test_drafter_lost_mid_request_the_target_finishes_alone(local_coordinator, reference, drafts, pipelined):
    from deployments.serving.request import GenerationRequest

    coordinator = local_coordinator
    target_worker, drafter_worker = coordinator.target.worker, coordinator.drafter.worker
    coordinator.drafter = DrafterDyingAfter(drafter_worker, drafts)
    request = GenerationRequest(prompt=PROMPT, params=SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True),
                                algorithm="slem", pipelined=pipelined)

    async def run():
        events = [event async for event in coordinator.run(coordinator.prepare(request), "test")]
        await coordinator.admission.closes_done()  # closes are fire and forget: the loop must outlive them
        return events

    events = asyncio.run(run())
    assert [token for event in events for token in event.token_ids] == reference
    stats = events[-1].stats
    assert stats.drafter_lost and stats.target_forwards > 0
    assert (stats.drafter_forwards == 0) == (drafts == -1)  # drafting happened until the drafter was lost
    assert len(target_worker.sessions) == len(drafter_worker.sessions) == 0


# --- the served app ----------------------------------------------------------------------------------------

def _stats(served_app) -> dict:  # noqa: F811
    return httpx.get(f"{served_app.http_url}/v1/stats", timeout=30).json()


def _sessions(served_app) -> tuple[int, int]:  # noqa: F811
    stats = _stats(served_app)
    return stats["target"].get("active_sessions", -1), stats["drafter"].get("active_sessions", -1)


def _wait_for_sessions(served_app, expected: tuple[int, int], timeout_s: float = 60) -> None:  # noqa: F811
    deadline = time.monotonic() + timeout_s
    while (seen := _sessions(served_app)) != expected:
        if time.monotonic() > deadline:
            raise AssertionError(f"(target, drafter) sessions {seen}, expected {expected} within {timeout_s} s")
        time.sleep(0.05)


def _seconds_until_freed(served_app, cancelled_at: float) -> float:  # noqa: F811
    """Seconds from the cancel until both actors hold no session (polled; measured up to 30 s)."""
    _wait_for_sessions(served_app, (0, 0), timeout_s=30)
    return time.monotonic() - cancelled_at


def _actor_handles() -> dict:
    from ray import serve

    return serve.get_app_handle(APP).actor_handles.remote().result(timeout_s=60)


@pytest.fixture(scope="module")
def grpc_stub(served_app):  # noqa: F811
    with grpc.insecure_channel(served_app.grpc_target) as channel:
        yield pb_grpc.HetSpecStub(channel)


def _long_request() -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=PROMPT, max_new_tokens=LONG_TOKENS, temperature=0.0)


def _raw_http_request(served_app, stream: bool) -> socket.socket:  # noqa: F811
    """A long completion sent on a plain socket, so the test decides exactly when the connection goes."""
    body = json.dumps({"model": served_app.model_id, "prompt": PROMPT, "max_tokens": LONG_TOKENS,
                       "temperature": 0, "stream": stream, "hetspec": {"ignore_eos": True}}).encode()
    host, port = served_app.http_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=120)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(body), body))
    return sock


def _read_until(sock: socket.socket, marker: bytes) -> bytes:
    received = b""
    while marker not in received:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before {marker!r}: {received[-300:]!r}"
        received += chunk
    return received


@pytest.mark.parametrize("interface", ["http-stream", "http", "grpc-stream", "grpc"])
def test_cancelled_request_frees_both_sessions_and_stops(served_app, grpc_stub, interface):  # noqa: F811
    before = _stats(served_app)
    _wait_for_sessions(served_app, (0, 0))
    if interface.startswith("http"):
        sock = _raw_http_request(served_app, stream=interface == "http-stream")
        if interface == "http-stream":
            assert b" 200 " in _read_until(sock, b"data: ").split(b"\r\n", 1)[0]
        _wait_for_sessions(served_app, (1, 1))  # decoding: both sessions open
        cancelled_at = time.monotonic()
        sock.close()  # the client goes away
    elif interface == "grpc-stream":
        call = grpc_stub.GenerateStream(_long_request(), metadata=GRPC_METADATA, timeout=120)
        next(call)
        _wait_for_sessions(served_app, (1, 1))
        cancelled_at = time.monotonic()
        call.cancel()
    else:
        future = grpc_stub.Generate.future(_long_request(), metadata=GRPC_METADATA, timeout=120)
        _wait_for_sessions(served_app, (1, 1))
        cancelled_at = time.monotonic()
        future.cancel()
    seconds = _seconds_until_freed(served_app, cancelled_at)
    print(f"{interface}: both sessions freed {seconds:.3f} s after the cancel")  # shown with pytest -s
    after = _stats(served_app)
    # stopped by the cancel, not run to its end: counted cancelled, never finished
    assert after["cancelled_requests"] == before["cancelled_requests"] + 1
    assert after["finished_requests"] == before["finished_requests"], f"{interface}: ran to its end"
    assert after["ongoing_requests"] == 0


def _wait_until_healthy(served_app, timeout_s: float = RECOVERY_DEADLINE_S) -> None:  # noqa: F811
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{served_app.http_url}/health", timeout=30).status_code != 200:
        if time.monotonic() > deadline:
            raise AssertionError(f"/health not 200 {timeout_s} s after an actor was killed")
        time.sleep(0.5)


BATCH = 3  # requests in flight together when an actor is killed: their steps share the actors' passes


def _streams_in_flight(start_stream, on_all_started) -> list:
    """``BATCH`` streams run at once (``start_stream()`` gives an iterable of events); once each has its first
    event, ``on_all_started()`` runs (the kill) while all are mid-request. Per stream: its events, or the error
    that ended it."""
    started = threading.Barrier(BATCH + 1)

    def consume():
        events = []
        try:
            for event in start_stream():
                events.append(event)
                if len(events) == 1:
                    started.wait(timeout=120)
        except Exception as error:  # noqa: BLE001 -- handed back to the test
            return error
        return events

    with ThreadPoolExecutor(BATCH) as pool:
        futures = [pool.submit(consume) for _ in range(BATCH)]
        started.wait(timeout=120)
        on_all_started()
        return [future.result(timeout=300) for future in futures]


def test_drafter_killed_mid_batch_every_request_finishes_target_alone(served_app, grpc_stub, long_reference):  # noqa: F811
    import ray

    drafter_before = _stats(served_app)["drafter"]["actor"]
    drafter = _actor_handles()["drafter"]  # fetched first: the kill must land while the requests run
    passes_before = _stats(served_app)["target"]["forward_passes"]
    body = {"model": served_app.model_id, "prompt": PROMPT, "max_tokens": LONG_NEW_TOKENS, "temperature": 0,
            "stream": True, "hetspec": {"ignore_eos": True}}

    def stream():
        with httpx.stream("POST", f"{served_app.http_url}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    yield json.loads(line[len("data: "):])

    outcomes = _streams_in_flight(stream, lambda: ray.kill(drafter))
    for events in outcomes:
        assert isinstance(events, list) and not [event for event in events if "error" in event], events
        assert [token for event in events for token in event["hetspec"]["token_ids"]] == long_reference
        stats = events[-1]["hetspec"]["stats"]
        assert stats["drafter_lost"] is True and events[-1]["choices"][0]["finish_reason"] == "length"
    # the three were in step: far fewer target passes than their own passes summed
    own_passes = sum(events[-1]["hetspec"]["stats"]["target_forwards"] for events in outcomes)
    assert _stats(served_app)["target"]["forward_passes"] - passes_before < own_passes
    # the pipeline gets a new drafter, and speculation resumes with it
    _wait_until_healthy(served_app)
    response = grpc_stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_new_tokens=NEW_TOKENS, temperature=0.0),
                                  metadata=GRPC_METADATA, timeout=120)
    if len(response.token_ids) == NEW_TOKENS:  # no EOS within NEW_TOKENS: comparable with the reference
        assert list(response.token_ids) == long_reference[:NEW_TOKENS]
    assert not response.stats.drafter_lost and response.stats.drafted_tokens > 0
    after = _stats(served_app)
    assert after["drafter"]["actor"] != drafter_before and after["drafter"]["active_sessions"] == 0


def test_target_killed_mid_batch_every_request_is_unavailable_then_recovers(served_app, grpc_stub,  # noqa: F811
                                                                            long_reference):
    import ray

    target = _actor_handles()["target"]
    outcomes = _streams_in_flight(
        lambda: grpc_stub.GenerateStream(_long_request(), metadata=GRPC_METADATA, timeout=120),
        lambda: ray.kill(target))
    for outcome in outcomes:  # every request of the batch is told, naming the target
        assert isinstance(outcome, grpc.RpcError), outcome
        assert outcome.code() == grpc.StatusCode.UNAVAILABLE and "target" in outcome.details()
    # while the target is being replaced, new requests are told so at once
    body = {"model": served_app.model_id, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    response = httpx.post(f"{served_app.http_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 503 and "target" in response.json()["error"]["message"], response.text
    _wait_until_healthy(served_app)
    body["max_tokens"], body["hetspec"] = LONG_NEW_TOKENS, {"ignore_eos": True}
    with ThreadPoolExecutor(BATCH) as pool:  # a batch again, on the new target: the target's own output
        responses = list(pool.map(lambda _: httpx.post(f"{served_app.http_url}/v1/completions", json=body,
                                                       timeout=120), range(BATCH)))
    for response in responses:
        assert response.status_code == 200, response.text
        assert response.json()["hetspec"]["token_ids"] == long_reference
    _wait_for_sessions(served_app, (0, 0))


def test_a_model_that_fails_to_load_is_reported_with_its_reason(served_app, tmp_path):  # noqa: F811
    """A second app whose target path does not exist: Serve's status names the model and the reason."""
    from ray import serve

    from deployments.app import build_app

    missing = tmp_path / "no-such-model"
    args = small_app_args(target={"model": str(missing)}, pipeline={"placement_strategy": "PACK"})
    serve._run(build_app(args), name="broken", route_prefix="/broken", _blocking=False)
    try:
        deadline = time.monotonic() + RECOVERY_DEADLINE_S
        while True:
            application = serve.status().applications.get("broken")
            deployment = application.deployments.get("HetSpecServer") if application else None
            if deployment is not None and "failed to load" in deployment.message:
                break
            assert time.monotonic() < deadline, f"no load failure reported: {application}"
            time.sleep(1.0)
        assert f"the target model '{missing}' failed to load" in deployment.message, deployment.message
        assert f"model folder {missing} does not exist" in deployment.message, deployment.message
        assert application.status in ("DEPLOYING", "DEPLOY_FAILED")  # never RUNNING, never hidden
        print(deployment.message)  # shown with pytest -s
    finally:
        serve.delete("broken")
    assert httpx.get(f"{served_app.http_url}/health", timeout=30).status_code == 200  # the good app is untouched
