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
import time
from dataclasses import dataclass, field

import httpx
import pytest
import yaml

from cluster_checks import (NEW_TOKENS, PROMPTS, SMALL_ARGS, SMALL_CONFIG, InFlight, assert_failed_clearly,
                            grpc_tokens, http_tokens, recovered_tokens, target_alone)
from deployments.tools.local_serve import LocalServe, deploy, local_serve

pytestmark = [pytest.mark.real, pytest.mark.timeout(600)]

APP_NAME = "hetspec"
# One slot per node and per pipeline member: placement is decided by the resources, not by chance.
HEAD_SLOT, DRAFTER_SLOT, TARGET_SLOT = "coordinator_slot", "drafter_slot", "target_slot"


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
    return target_alone(gemma)


def _actor_nodes() -> dict:
    from ray import serve

    return serve.get_app_handle(APP_NAME).actor_nodes.remote().result(timeout_s=60)


def _replica_id(running: RunningCluster) -> str:
    return httpx.get(f"{running.http_url}/v1/stats", timeout=60).json()["replica"]


def test_pipeline_members_run_on_their_own_nodes(running):
    nodes = _actor_nodes()
    assert nodes == {"coordinator": running.nodes[HEAD_SLOT].node_id,
                     "drafter": running.nodes[DRAFTER_SLOT].node_id,
                     "target": running.nodes[TARGET_SLOT].node_id}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_equal_the_target_alone_over_grpc_and_http(running, reference, prompt):
    assert grpc_tokens(running, prompt) == reference[prompt]
    assert http_tokens(running, prompt) == reference[prompt]


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
        assert http_tokens(running, PROMPTS[0]) == reference[PROMPTS[0]]  # the target alone: same tokens
        too_long = _completion(running, PROMPTS[0], NEW_TOKENS + 1)
        assert too_long.status_code == 400 and f"at most {NEW_TOKENS}" in too_long.text, too_long.text
        assert (_replica_id(running), _model_actor_ids()) == (replica, actors), "the models were reloaded"
    finally:
        deploy(running.served.serve_config)  # the user_config removed: args' settings again
    _until_target_alone(running, False)
    assert (_replica_id(running), _model_actor_ids()) == (replica, actors)


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
    assert_failed_clearly(target_node_loss.in_flight)


def test_coordinator_rebuilds_its_pipeline_on_a_replacement_node(running, reference, target_node_loss):
    replacement = running.add_node(TARGET_SLOT)  # what the autoscaler does for a lost GPU node
    assert recovered_tokens(running, PROMPTS[0]) == reference[PROMPTS[0]]
    assert http_tokens(running, PROMPTS[1]) == reference[PROMPTS[1]]
    nodes = _actor_nodes()
    assert nodes["target"] == replacement.node_id != target_node_loss.lost_node.node_id
    assert nodes["drafter"] == running.nodes[DRAFTER_SLOT].node_id
    assert _replica_id(running) == target_node_loss.replica_before, (
        "the coordinator replica itself should survive and rebuild its pipeline")
