"""Multi-node behaviour of the Serve app on a Ray cluster of simulated nodes on this machine.

Three nodes (``ray.cluster_utils.Cluster``), each offering one custom "slot" resource, and the Serve
config deployed through the controller from its ``import_path`` and ``args`` (the path ``serve deploy``
and KubeRay's ``serveConfigV2`` take): the coordinator replica lands on the head, the drafter and the
target on nodes of their own (STRICT_SPREAD). The small pair in float32, so greedy output must equal the
target's alone, token for token. A deploy that changes only the deployment's ``user_config`` must change
speculation and limits on the running replica, with the same model actors.

Then the target's node is removed, as when a GPU machine dies: the requests in flight must end with a
clear error (gRPC UNAVAILABLE, an SSE error event, both naming the target), the same coordinator replica
must rebuild its pipeline once a replacement node joins (what the autoscaler provides), and new requests
must succeed with the same tokens.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest
import yaml

from deployments.tools.local_serve import LocalServe, deploy, local_serve
from hetspec import Engine, SamplingParams, SpeculationConfig
from protos.hetspec.v1 import hetspec_pb2 as pb
from protos.hetspec.v1 import hetspec_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.real, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[1]
SMALL_CONFIG = REPO / "deployments" / "config.small.yaml"
APP_NAME = "hetspec"
# One slot per node and per pipeline member: placement is decided by the resources, not by chance.
HEAD_SLOT, DRAFTER_SLOT, TARGET_SLOT = "coordinator_slot", "drafter_slot", "target_slot"
NEW_TOKENS = 12
PROMPTS = ["def fibonacci(n):\n", "The capital of France is"]
RECOVERY_DEADLINE_S = 240.0
STREAM_TIMEOUT_S = 120.0  # an in-flight stream silent this long has hung instead of failing
SMALL_ARGS = yaml.safe_load(SMALL_CONFIG.read_text())["applications"][0]["args"]


def multinode_serve_config() -> dict:
    """config.small.yaml with each pipeline member pinned to its slot (local_serve gives it private ports)."""
    config = yaml.safe_load(SMALL_CONFIG.read_text())
    args = config["applications"][0]["args"]
    args["pipeline"]["placement_strategy"] = "STRICT_SPREAD"
    args["limits"]["default_max_new_tokens"] = NEW_TOKENS
    for role, slot in (("coordinator", HEAD_SLOT), ("drafter", DRAFTER_SLOT), ("target", TARGET_SLOT)):
        args[f"{role}_resources"]["resources"] = {slot: 1.0}
    return config


@dataclass
class RunningCluster:
    served: LocalServe
    nodes: dict = field(default_factory=dict)  # slot -> the node offering it

    @property
    def http_url(self) -> str:
        return self.served.http_url

    @property
    def grpc_target(self) -> str:
        return self.served.grpc_target

    @property
    def cluster(self):  # ray.cluster_utils.Cluster
        return self.served.cluster

    def add_node(self, slot: str):
        node = self.cluster.add_node(num_cpus=1, resources={slot: 1.0})
        self.cluster.wait_for_nodes()
        self.nodes[slot] = node
        return node


@pytest.fixture(scope="module")
def running():
    """The Serve config deployed through the controller (the path of ``serve deploy``), a node per slot."""
    slots = (HEAD_SLOT, DRAFTER_SLOT, TARGET_SLOT)
    nodes = [{"num_cpus": 1, "resources": {slot: 1.0}} for slot in slots]
    with local_serve(multinode_serve_config(), nodes, declarative=True) as served:
        yield RunningCluster(served, dict(zip(slots, served.nodes)))


@pytest.fixture(scope="module")
def reference(gemma):
    """The target alone, greedy (``ar`` in this process): what the cluster must output."""
    engine = Engine(gemma)
    return {prompt: engine.generate(prompt, SamplingParams(max_new_tokens=NEW_TOKENS),
                                    speculation=SpeculationConfig(algorithm="ar")).token_ids
            for prompt in PROMPTS}


def _actor_nodes() -> dict:
    from ray import serve

    return serve.get_app_handle(APP_NAME).actor_nodes.remote().result(timeout_s=60)


def _replica_id(running: RunningCluster) -> str:
    return httpx.get(f"{running.http_url}/v1/stats", timeout=60).json()["replica"]


def _grpc_tokens(running: RunningCluster, prompt: str, timeout_s: float = 120) -> list[int]:
    with grpc.insecure_channel(running.grpc_target) as channel:
        response = pb_grpc.HetSpecStub(channel).Generate(pb.GenerateRequest(prompt=prompt), timeout=timeout_s)
    return list(response.token_ids)


def _http_tokens(running: RunningCluster, prompt: str) -> list[int]:
    body = {"model": SMALL_ARGS["model_id"], "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
    response = httpx.post(f"{running.http_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["hetspec"]["token_ids"]


def test_pipeline_members_run_on_their_own_nodes(running):
    nodes = _actor_nodes()
    assert nodes == {"coordinator": running.nodes[HEAD_SLOT].node_id,
                     "drafter": running.nodes[DRAFTER_SLOT].node_id,
                     "target": running.nodes[TARGET_SLOT].node_id}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_equal_the_target_alone_over_grpc_and_http(running, reference, prompt):
    assert _grpc_tokens(running, prompt) == reference[prompt]
    assert _http_tokens(running, prompt) == reference[prompt]


def _completion(running: RunningCluster, prompt: str, max_tokens: int) -> httpx.Response:
    body = {"model": SMALL_ARGS["model_id"], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{running.http_url}/v1/completions", json=body, timeout=120)


def _until_target_alone(running: RunningCluster, alone: bool, timeout_s: float = 120.0) -> None:
    """Until a new request runs with algorithm ar (``alone``) or with speculation: a deploy returns before
    the replica is reconfigured."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = _completion(running, PROMPTS[1], 2)
        algorithm = response.json()["hetspec"]["stats"]["algorithm"] if response.status_code == 200 else None
        if algorithm is not None and (algorithm == "ar") == alone:
            return
        assert time.monotonic() < deadline, f"algorithm still {algorithm}: {response.text[:300]}"
        time.sleep(1.0)


def _model_actor_ids() -> dict:
    from ray import serve

    handles = serve.get_app_handle(APP_NAME).actor_handles.remote().result(timeout_s=60)
    return {role: handle._actor_id.hex() for role, handle in handles.items()}


def test_a_user_config_changes_speculation_and_limits_without_reloading_the_models(running, reference):
    replica, actors = _replica_id(running), _model_actor_ids()
    changed = copy.deepcopy(running.served.serve_config)
    changed["applications"][0]["deployments"] = [{"name": "HetSpecServer", "user_config": {
        "speculation": {"algorithm": "ar"}, "limits": {"max_new_tokens": NEW_TOKENS, "default_max_new_tokens": 8}}}]
    deploy(changed)  # only the user_config differs: Serve reconfigures the running replica
    try:
        _until_target_alone(running, True)
        assert _http_tokens(running, PROMPTS[0]) == reference[PROMPTS[0]]  # the target alone: same tokens
        too_long = _completion(running, PROMPTS[0], NEW_TOKENS + 1)
        assert too_long.status_code == 400 and f"at most {NEW_TOKENS}" in too_long.text, too_long.text
        assert (_replica_id(running), _model_actor_ids()) == (replica, actors), "the models were reloaded"
    finally:
        deploy(running.served.serve_config)  # the user_config removed: args' settings again
    _until_target_alone(running, False)
    assert (_replica_id(running), _model_actor_ids()) == (replica, actors)


class InFlight:
    """Long streaming requests (gRPC and HTTP) on threads; ``start`` returns once both produced text."""

    def __init__(self, running: RunningCluster, max_new_tokens: int):
        self.running = running
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
        with grpc.insecure_channel(self.running.grpc_target) as channel:
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
            url = f"{self.running.http_url}/v1/completions"
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


def _recovered_tokens(running: RunningCluster, prompt: str) -> list[int]:
    """The first successful answer after the failure, retrying while the pipeline is being rebuilt."""
    deadline = time.monotonic() + RECOVERY_DEADLINE_S
    while True:
        try:
            return _grpc_tokens(running, prompt, timeout_s=60)
        except grpc.RpcError as error:
            if time.monotonic() > deadline:
                raise AssertionError(f"no successful request {RECOVERY_DEADLINE_S} s after the node loss; "
                                     f"last error: {error.code()} {error.details()}") from None
            time.sleep(2.0)


@dataclass
class NodeLoss:
    lost_node: object  # the removed node
    replica_before: str
    in_flight: InFlight


@pytest.fixture(scope="module")
def target_node_loss(running) -> NodeLoss:
    """Remove the target's node while a gRPC and an HTTP stream are running on the pipeline."""
    replica_before = _replica_id(running)
    lost_node = running.nodes.pop(TARGET_SLOT)
    # The server's longest completion: still running when the node goes.
    in_flight = InFlight(running, SMALL_ARGS["limits"]["max_new_tokens"]).start()
    running.cluster.remove_node(lost_node)
    in_flight.join()
    return NodeLoss(lost_node, replica_before, in_flight)


def test_in_flight_requests_fail_clearly_when_the_target_node_dies(target_node_loss):
    in_flight = target_node_loss.in_flight
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


def test_coordinator_rebuilds_its_pipeline_on_a_replacement_node(running, reference, target_node_loss):
    replacement = running.add_node(TARGET_SLOT)  # what the autoscaler does for a lost GPU node
    assert _recovered_tokens(running, PROMPTS[0]) == reference[PROMPTS[0]]
    assert _http_tokens(running, PROMPTS[1]) == reference[PROMPTS[1]]
    nodes = _actor_nodes()
    assert nodes["target"] == replacement.node_id != target_node_loss.lost_node.node_id
    assert nodes["drafter"] == running.nodes[DRAFTER_SLOT].node_id
    assert _replica_id(running) == target_node_loss.replica_before, (
        "the coordinator replica itself should survive and rebuild its pipeline")
