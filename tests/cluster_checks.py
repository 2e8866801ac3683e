"""Checks shared by the tests that serve config.small.yaml across several Ray nodes: simulated nodes on one
network stack (tests/test_multinode.py) and hosts in network namespaces (tests/test_netns.py).

``endpoints`` is anything with ``http_url`` and ``grpc_target``.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import grpc
import httpx
import yaml

from protos.hetspec.v1 import hetspec_pb2 as pb
from protos.hetspec.v1 import hetspec_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]
SMALL_CONFIG = REPO / "deployments" / "config.small.yaml"
SMALL_ARGS = yaml.safe_load(SMALL_CONFIG.read_text())["applications"][0]["args"]
NEW_TOKENS = 12
PROMPTS = ["def fibonacci(n):\n", "The capital of France is"]
RECOVERY_DEADLINE_S = 240.0
STREAM_TIMEOUT_S = 120.0  # an in-flight stream silent this long has hung instead of failing


def target_alone(model, max_new_tokens: int = NEW_TOKENS, ignore_eos: bool = False) -> dict[str, list[int]]:
    """Each prompt's greedy tokens from the target alone (``ar``) in this process: what a cluster must output."""
    from hetspec import Engine, SamplingParams, SpeculationConfig

    engine, params = Engine(model), SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
    return {prompt: engine.generate(prompt, params, speculation=SpeculationConfig(algorithm="ar")).token_ids
            for prompt in PROMPTS}


def grpc_tokens(endpoints, prompt: str, timeout_s: float = 120) -> list[int]:
    with grpc.insecure_channel(endpoints.grpc_target) as channel:
        response = pb_grpc.HetSpecStub(channel).Generate(pb.GenerateRequest(prompt=prompt), timeout=timeout_s)
    return list(response.token_ids)


def http_tokens(endpoints, prompt: str) -> list[int]:
    body = {"model": SMALL_ARGS["model_id"], "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
    response = httpx.post(f"{endpoints.http_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["hetspec"]["token_ids"]


class InFlight:
    """Long streaming requests (gRPC and HTTP) on threads; ``start`` returns once both produced text."""

    def __init__(self, endpoints, max_new_tokens: int):
        self.endpoints = endpoints
        self.max_new_tokens = max_new_tokens
        self.started = threading.Barrier(3, timeout=180)
        self.grpc_outcome: tuple = ()
        self.http_events: list[dict] = []
        self.http_failure: Exception | None = None
        self.threads = [threading.Thread(target=self._grpc, daemon=True),
                        threading.Thread(target=self._http, daemon=True)]

    def start(self) -> "InFlight":
        for thread in self.threads:
            thread.start()
        try:
            self.started.wait()
        except threading.BrokenBarrierError:
            raise AssertionError(f"the streams did not start: gRPC {self.grpc_outcome}, HTTP "
                                 f"{self.http_failure!r} {self.http_events[-2:]}") from None
        return self

    def join(self) -> None:
        for thread in self.threads:
            thread.join(timeout=STREAM_TIMEOUT_S + 60)
            assert not thread.is_alive(), "an in-flight request neither finished nor failed"

    def _grpc(self) -> None:
        request = pb.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=self.max_new_tokens)
        messages = 0
        with grpc.insecure_channel(self.endpoints.grpc_target) as channel:
            try:
                for _ in pb_grpc.HetSpecStub(channel).GenerateStream(request, timeout=STREAM_TIMEOUT_S):
                    messages += 1
                    if messages == 1:
                        self.started.wait()
                self.grpc_outcome = ("finished", messages)
            except grpc.RpcError as error:
                self.grpc_outcome = (error.code(), error.details() or "")
            finally:
                if messages == 0:
                    self.started.abort()

    def _http(self) -> None:
        body = {"model": SMALL_ARGS["model_id"], "prompt": PROMPTS[1], "max_tokens": self.max_new_tokens,
                "temperature": 0, "stream": True, "hetspec": {"ignore_eos": True}}
        try:
            url = f"{self.endpoints.http_url}/v1/completions"
            with httpx.stream("POST", url, json=body, timeout=STREAM_TIMEOUT_S) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    self.http_events.append(json.loads(line[len("data: "):]))
                    if len(self.http_events) == 1:
                        self.started.wait()
        except Exception as error:  # noqa: BLE001 -- a cut connection is an outcome the test reports
            self.http_failure = error
        finally:
            if not self.http_events:
                self.started.abort()


def recovered_tokens(endpoints, prompt: str) -> list[int]:
    """The first successful answer after the failure, retrying while the pipeline is being rebuilt."""
    deadline = time.monotonic() + RECOVERY_DEADLINE_S
    while True:
        try:
            return grpc_tokens(endpoints, prompt, timeout_s=60)
        except grpc.RpcError as error:
            if time.monotonic() > deadline:
                raise AssertionError(f"no successful request {RECOVERY_DEADLINE_S} s after the node loss; "
                                     f"last error: {error.code()} {error.details()}") from None
            time.sleep(2.0)



def assert_failed_clearly(in_flight: InFlight) -> None:
    """The in-flight requests of a pipeline whose target was lost ended with an error naming the target."""
    grpc_code, grpc_details = in_flight.grpc_outcome
    http_errors = [event["error"] for event in in_flight.http_events if "error" in event]
    seen = {"grpc": in_flight.grpc_outcome, "http_errors": http_errors, "http_cut": repr(in_flight.http_failure)}
    # gRPC: UNAVAILABLE is the status a client may retry; the details say what was lost.
    assert grpc_code == grpc.StatusCode.UNAVAILABLE and "target" in grpc_details.lower(), seen
    # HTTP: headers are sent already, so one error event, then the stream closes; it never looks finished.
    assert in_flight.http_failure is None and len(http_errors) == 1, seen
    assert "target" in http_errors[0]["message"].lower(), seen
    assert not any(choice.get("finish_reason") for event in in_flight.http_events
                   for choice in event.get("choices", [])), "a cut stream must not look finished"


