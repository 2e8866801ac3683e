"""deployments/serving/routing.py's request router, driven the way Serve's router drives it, without Ray running.

The serve-level proof (two replicas at their total capacity, not one 429) is in tests/test_autoscaling_serve.py.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest

from deployments.app import deployment_options, replica_capacity
from deployments.config import AppConfig
from deployments.serving.routing import RoomRouter, is_generation, rank_by_room


def _replica(name: str, **routing_stats) -> SimpleNamespace:
    return SimpleNamespace(replica_id=name, routing_stats=routing_stats)


class Driver:
    """Serve's side of the router: choose, send to the first replica offered, finish."""

    def __init__(self, capacity: int, replicas: list[SimpleNamespace], full_grace_s: float = 0.0):
        """``full_grace_s`` 0: every replica full sends to the full ones at once (the wait has its own test)."""
        self.router = RoomRouter(DeploymentID("HetSpecServer", "hetspec"), DeploymentHandleSource.UNKNOWN)
        self.router.initialize_state(capacity=capacity, full_grace_s=full_grace_s)
        self.replicas = replicas
        self.loop = asyncio.new_event_loop()
        self.requests: dict[str, SimpleNamespace] = {}

    def pending(self, request_id: str, route: str = "/v1/completions", call_method: str = "__call__"):
        metadata = RequestMetadata(request_id=request_id, internal_request_id=request_id, route=route,
                                   call_method=call_method)
        self.requests[request_id] = PendingRequest([], {}, metadata, future=self.loop.create_future())
        return self.requests[request_id]

    def choose(self, request_id: str, **where) -> list[list[str]]:
        ranks = self.loop.run_until_complete(self.router.choose_replicas(self.replicas, self.pending(request_id,
                                                                                                   **where)))
        return [[replica.replica_id for replica in rank] for rank in ranks]

    def send(self, request_id: str, **where) -> str:
        """Routed to the first replica offered (Serve's probe accepts it)."""
        replica = self.choose(request_id, **where)[0][0]
        self.requests[request_id].future.set_result(replica)
        self.router.on_request_routed(self.requests[request_id], replica, None)
        return replica

    def finish(self, request_id: str, replica: str) -> None:
        self.router.on_request_completed(replica, request_id)


def test_generations_go_where_the_admission_has_room_least_loaded_first():
    serve = Driver(capacity=2, replicas=[_replica("a"), _replica("b")])
    assert [serve.send(f"r{index}") for index in range(4)] == ["a", "b", "a", "b"]
    # both full: the last resort offers every full replica at once (its admission answers 429)
    assert serve.choose("r4") == [["a", "b"]]
    serve.finish("r0", "a")
    assert serve.send("r5") == "a"
    assert serve.router.loads() == {"a": 2, "b": 2}
    assert serve.requests["r5"].routing_context.should_backoff  # Serve's loop waits between our choices


def test_a_request_finding_every_replica_full_waits_a_moment_for_a_slot():
    serve = Driver(capacity=1, replicas=[_replica("a"), _replica("b")], full_grace_s=60.0)
    serve.send("r0"), serve.send("r1")
    assert serve.choose("r2") == []  # nothing offered: Serve backs off and asks again
    serve.finish("r0", "a")  # the end Serve reported late
    assert serve.choose("r2")[0] == ["a"]
    serve.router.full_grace_s = 0.0
    assert serve.choose("r3") == [["a", "b"]]  # past the wait: to the full replicas, whose admission says 429


def test_concurrent_choices_count_before_they_are_accepted():
    serve = Driver(capacity=1, replicas=[_replica("a"), _replica("b")])
    # two routing tasks choose before either request is accepted: they must not pick the same replica
    assert serve.choose("r0") == [["a"], ["b"]]
    assert serve.choose("r1") == [["b"], ["a"]]
    assert serve.choose("r2") == [["a", "b"]]


def test_a_request_chosen_again_or_sent_elsewhere_counts_once_where_it_went():
    serve = Driver(capacity=2, replicas=[_replica("a"), _replica("b")])
    assert serve.choose("r0")[0] == ["a"]
    assert serve.choose("r0")[0] == ["a"]  # its replica refused it (Serve's probe): chosen again, counted once
    assert serve.router.loads() == {"a": 1}
    serve.requests["r0"].future.set_result("b")
    serve.router.on_request_routed(serve.requests["r0"], "b", None)  # Serve went on to the next rank
    assert serve.router.loads() == {"b": 1}


def test_a_request_cancelled_while_queued_frees_its_choice():
    serve = Driver(capacity=1, replicas=[_replica("a")])
    serve.choose("r0")
    serve.requests["r0"].future.cancel()  # the client left before Serve dispatched it: no callback comes
    assert serve.choose("r1") == [["a"]] and serve.router.loads() == {"a": 1}


def test_control_calls_go_anywhere_and_are_not_counted():
    serve = Driver(capacity=1, replicas=[_replica("a"), _replica("b")])
    serve.send("r0")
    serve.send("r1")
    for route, method in (("/v1/stats", "__call__"), ("/health", "__call__"), ("", "actor_handles")):
        assert serve.choose(f"control {route}{method}", route=route, call_method=method) == [["a", "b"]]
    assert serve.router.loads() == {"a": 1, "b": 1}


def test_a_replicas_reported_capacity_overrides_the_deployment_default():
    serve = Driver(capacity=1, replicas=[_replica("a", capacity=3), _replica("b")])
    assert [serve.send(f"r{index}") for index in range(4)] == ["a", "b", "a", "a"]


@pytest.mark.parametrize("route, method, generation", [
    ("/v1/completions", "__call__", True), ("/v1/chat/completions", "__call__", True),
    ("/hetspec/v1/chat/completions", "__call__", True),  # under a route prefix
    ("hetspec", "Generate", True), ("hetspec", "GenerateStream", True),  # gRPC: the app name and the method
    ("/v1/models", "__call__", False), ("/tokenize", "__call__", False), ("", "record_routing_stats", False)])
def test_which_requests_take_an_admission_slot(route, method, generation):
    assert is_generation(route, method) == generation


def test_rank_by_room():
    assert rank_by_room({"a": 2, "b": 0, "c": 1}, {"a": 2, "b": 2, "c": 2}) == [["b"], ["c"], ["a"]]
    assert rank_by_room({"a": 3, "b": 2}, {"a": 2, "b": 2}) == [["b", "a"]]


def test_the_deployment_routes_with_it_at_the_admissions_capacity():
    config = AppConfig.model_validate({"model_id": "m", "target": {"model": "t"}, "drafter": {"model": "d"},
                                       "limits": {"max_running_requests": 3, "max_waiting_requests": 5}})
    options = deployment_options(config)["request_router_config"]
    router_config = RequestRouterConfig(**options)  # what Serve builds from it
    assert router_config.get_request_router_class() is RoomRouter
    assert router_config.request_router_kwargs == {"capacity": replica_capacity(config.limits)} == {"capacity": 8}
