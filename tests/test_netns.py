"""The Serve app across hosts with network stacks of their own: drafter and target talk over a real link.

Three network namespaces behind a router namespace (cluster/netns/hosts.py), each running a Ray node, every
packet between them held by the user-space delay forwarder (a few milliseconds of RTT on the wire). The
config.small.yaml app is deployed through the head's dashboard (the REST path of ``serve deploy``) with the
coordinator on host 1, the drafter on host 2 and the target on host 3 (custom resources, STRICT_SPREAD).
Greedy output over gRPC and HTTP must equal the target's alone in this process (float32 small pair); then
every Ray process of the target's host is killed mid-stream: the in-flight requests end with an error
naming the target, and once a Ray node runs on that host again the pipeline is rebuilt and answers equal
the library's. Needs root (CI runs as root); skipped with the reason elsewhere.
"""

from __future__ import annotations

import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import yaml

from cluster.netns.hosts import TestHosts, namespaces_can_be_made, test_hosts
from cluster_checks import (NEW_TOKENS, PROMPTS, SMALL_CONFIG, InFlight, assert_failed_clearly, grpc_tokens,
                            http_tokens, recovered_tokens, target_alone)
from deployments.tools.client import wait_until_healthy

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]

WHY_NOT = namespaces_can_be_made()
if WHY_NOT:
    pytest.skip(f"network namespaces cannot be made here: {WHY_NOT}", allow_module_level=True)

ONE_WAY_MS = 1.5  # RTT 3 ms between any two hosts
APP_NAME = "hetspec"
ROLE_HOSTS = {"coordinator": 1, "drafter": 2, "target": 3}
WORKER_CLASSES = {"DrafterWorker": "drafter", "TargetWorker": "target"}


def netns_serve_config() -> dict:
    """config.small.yaml with each pipeline member pinned to its host, the proxies on the head's addresses."""
    config = yaml.safe_load(SMALL_CONFIG.read_text())
    config["http_options"] = {"host": "0.0.0.0", "port": 8000}
    args = config["applications"][0]["args"]
    args["pipeline"]["placement_strategy"] = "STRICT_SPREAD"
    args["limits"]["default_max_new_tokens"] = NEW_TOKENS
    for role, index in ROLE_HOSTS.items():
        args[f"{role}_resources"]["resources"] = {f"host_{index}": 1.0}
    return config


def deploy(hosts: TestHosts, config: dict, timeout_s: float = 300.0) -> None:
    """PUT the config to the head's dashboard (what ``serve deploy`` does), until the app is RUNNING."""
    response = httpx.put(f"{hosts.dashboard_url}/api/serve/applications/", json=config, timeout=60)
    assert response.status_code == 200, response.text
    deadline = time.monotonic() + timeout_s
    while True:
        status = httpx.get(f"{hosts.dashboard_url}/api/serve/applications/", timeout=30).json()
        application = status.get("applications", {}).get(APP_NAME) or {}
        if application.get("status") == "RUNNING":
            break
        assert application.get("status") != "DEPLOY_FAILED", application.get("message")
        assert time.monotonic() < deadline, f"not RUNNING after {timeout_s} s: {application}"
        time.sleep(2.0)
    wait_until_healthy(hosts.http_url, timeout_s=timeout_s, poll_s=0.5)


@contextmanager
def served_hosts(prefix: str) -> Iterator[TestHosts]:
    """Three hosts with Ray, the small pair's app deployed across them; all torn down on exit."""
    workdir = Path(tempfile.mkdtemp(prefix="hsn", dir="/tmp"))  # short: Ray's socket paths live under it
    with test_hosts(3, one_way_ms=ONE_WAY_MS, prefix=prefix, workdir=workdir) as hosts:
        hosts.ray.start()
        deploy(hosts, netns_serve_config())
        yield hosts


@pytest.fixture(scope="module")
def hosts():
    with served_hosts("hetspec-t") as hosts:
        yield hosts


@pytest.fixture(scope="module")
def reference(gemma):
    return target_alone(gemma)


def _state(hosts: TestHosts, kind: str) -> list[dict]:
    response = httpx.get(f"{hosts.dashboard_url}/api/v0/{kind}", params={"detail": "1", "limit": "1000"}, timeout=30)
    return response.json()["data"]["result"]["result"]


def _worker_hosts(hosts: TestHosts) -> dict[str, str]:
    """role -> the address of the host its live actor runs on, from the head's state API."""
    node_ips = {node["node_id"]: node["node_ip"] for node in _state(hosts, "nodes")}
    return {WORKER_CLASSES[actor["class_name"]]: node_ips[actor["node_id"]] for actor in _state(hosts, "actors")
            if actor["class_name"] in WORKER_CLASSES and actor["state"] == "ALIVE"}


def test_the_link_between_hosts_carries_the_delay(hosts):
    _, drafter_host, target_host = hosts.network.hosts
    assert hosts.network.rtt_ms(drafter_host, target_host) >= 2 * ONE_WAY_MS  # a lower bound: never flaky


def test_drafter_and_target_run_on_their_own_hosts(hosts):
    addresses = {host.index: host.address for host in hosts.network.hosts}
    assert _worker_hosts(hosts) == {"drafter": addresses[2], "target": addresses[3]}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_over_the_wire_equal_the_target_alone(hosts, reference, prompt):
    assert grpc_tokens(hosts, prompt) == reference[prompt]
    assert http_tokens(hosts, prompt) == reference[prompt]


def test_losing_the_target_host_fails_in_flight_requests_clearly_then_recovers(hosts, reference):
    target_host = hosts.network.hosts[2]
    in_flight = InFlight(hosts, yaml.safe_load(SMALL_CONFIG.read_text())["applications"][0]["args"]["limits"]
                         ["max_new_tokens"]).start()
    hosts.ray.kill_node(target_host)  # every Ray process on the target's host, at once
    in_flight.join()
    assert_failed_clearly(in_flight)
    assert httpx.get(f"{hosts.http_url}/health", timeout=30).status_code in (200, 503)  # the head still answers
    hosts.ray.start_node(target_host)  # the host is back (what the autoscaler would provide)
    assert recovered_tokens(hosts, PROMPTS[0]) == reference[PROMPTS[0]]
    assert http_tokens(hosts, PROMPTS[1]) == reference[PROMPTS[1]]
    assert _worker_hosts(hosts)["target"] == target_host.address
