"""Serve's request router for hetspec: generation requests go to a replica with room in its admission.

Serve's own router (power of two choices) balances by each replica's ongoing requests, bounded by
``max_ongoing_requests``; that bound is the replica's admission capacity plus ``app.CONTROL_SLOTS`` (the
control routes count as ongoing too), so it could send a replica more generations than it admits while
another replica had room, and the full one answered 429 (docs/deploy.md, "Routing"). ``RoomRouter`` counts
the generation requests it has sent to each replica and not seen finish, and sends a generation to a replica
whose count is below its capacity (``running + waiting``: ``record_routing_stats`` of deployments/app.py
reports it, so a ``user_config`` that changes the limits changes it too), the least loaded first. When every
replica is full it waits up to ``FULL_GRACE_S`` for a slot, then sends the request to a full replica, whose
admission answers 429 with Retry-After, as one replica alone does. Control calls (health, stats, models,
handle calls) go anywhere.

Exact for the traffic of one router: each Serve proxy (HTTP and gRPC share it) and each ``DeploymentHandle``
has its own, so with one proxy (``proxy_location: HeadOnly``) a replica never receives more generations than
it admits from the clients' traffic. With a proxy per node each counts only its own sends, and a replica's
admission is the bound that stays exact (its 429). A sampled request with ``n`` choices counts once here and
takes ``n`` admission slots.
"""

from __future__ import annotations

import time
from typing import Any, Hashable, Sequence

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

# The routes whose requests take an admission slot: OpenAI's generation routes (Serve gives the router the
# FastAPI route pattern, after any route prefix) and the gRPC methods (deployments/api/grpc_service.py).
GENERATION_HTTP_ROUTES = ("/v1/completions", "/v1/chat/completions")
GENERATION_GRPC_METHODS = frozenset({"Generate", "GenerateStream"})
# A choice that Serve resolved but never dispatched (its caller left in between) fires no callback: its
# reservation is dropped after this long (until then the replica only looks fuller than it is).
STALE_CHOICE_S = 30.0
# How long a generation that finds every replica full waits in the router for a slot before it is sent to a
# full replica (whose admission answers 429): Serve reports a request's end to the router a moment after the
# client has its answer, and a closed-loop client's next request can arrive first.
FULL_GRACE_S = 0.5


def is_generation(route: str, call_method: str) -> bool:
    return call_method in GENERATION_GRPC_METHODS or route.endswith(GENERATION_HTTP_ROUTES)


def rank_by_room(loads: dict[Hashable, int], capacities: dict[Hashable, int]) -> list[list[Hashable]]:
    """Serve's ranks for a generation: each replica with room alone, the least loaded first (so the choice is
    ours, not the probe's), then every full replica together (least loaded first) as the last resort."""
    by_load = sorted(loads, key=lambda replica: loads[replica])
    with_room = [replica for replica in by_load if loads[replica] < capacities[replica]]
    full = [replica for replica in by_load if loads[replica] >= capacities[replica]]
    return [[replica] for replica in with_room] + ([full] if full else [])


class RoomRouter(RequestRouter):
    """Serve request router (``request_router_config.request_router_class``): see the module docstring."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.initialize_state()  # the defaults in one place; Serve calls it again with the config's kwargs
        self.sent: dict[str, Any] = {}  # internal request id -> replica id: generations chosen or running
        self.chosen: dict[str, tuple[PendingRequest, float]] = {}  # chosen here, not yet accepted
        self.full_since: dict[str, float] = {}  # requests that found every replica full: since when

    def initialize_state(self, capacity: int = 1, full_grace_s: float = FULL_GRACE_S, **_: Any) -> None:
        """Serve's ``request_router_kwargs``. ``capacity``: what a replica admits until it reports its own;
        ``full_grace_s``: how long a generation that finds every replica full waits for a slot."""
        self.default_capacity = capacity
        self.full_grace_s = full_grace_s

    def capacity(self, replica: RunningReplica) -> int:
        return int((replica.routing_stats or {}).get("capacity", self.default_capacity))

    def loads(self) -> dict[Any, int]:
        counts: dict[Any, int] = {}
        for replica_id in self.sent.values():
            counts[replica_id] = counts.get(replica_id, 0) + 1
        return counts

    def _forget_stale_choices(self) -> None:
        now = time.monotonic()
        for request_id, (pending, chosen_at) in list(self.chosen.items()):
            if pending.future.cancelled() or (pending.future.done() and now - chosen_at > STALE_CHOICE_S):
                self.chosen.pop(request_id)
                self.sent.pop(request_id, None)
        for request_id, since in list(self.full_since.items()):
            if now - since > STALE_CHOICE_S:
                self.full_since.pop(request_id)

    async def choose_replicas(self, candidate_replicas: Sequence[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Serve's loop backs off between our choices only when told to (its locality mixin tells it so);
            # without it, a request that no replica takes would be chosen again at once, in a busy loop
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        metadata = pending_request.metadata if pending_request is not None else None
        if metadata is None or not is_generation(metadata.route, metadata.call_method):
            return [list(candidate_replicas)]  # Serve's probe picks the least loaded
        self._forget_stale_choices()
        request_id = metadata.internal_request_id
        self.sent.pop(request_id, None)  # chosen again (its replica refused it): the earlier choice is void
        self.chosen.pop(request_id, None)
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        counts = self.loads()
        loads = {replica_id: counts.get(replica_id, 0) for replica_id in by_id}
        capacities = {replica_id: self.capacity(replica) for replica_id, replica in by_id.items()}
        ranks = rank_by_room(loads, capacities)
        if all(loads[replica_id] >= capacities[replica_id] for replica_id in by_id):  # as far as we know
            # A client that got its answer may send its next request before Serve tells us the last one ended:
            # wait a moment for that slot (Serve's loop backs off and asks again) before a full replica's 429.
            since = self.full_since.setdefault(request_id, time.monotonic())
            if time.monotonic() - since < self.full_grace_s:
                return []
        else:
            # counted now, not once accepted: routing tasks run concurrently, and the next one must see it
            self.sent[request_id] = ranks[0][0]
            self.chosen[request_id] = (pending_request, time.monotonic())
        self.full_since.pop(request_id, None)
        return [[by_id[replica_id] for replica_id in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any) -> None:
        metadata = pending_request.metadata
        if is_generation(metadata.route, metadata.call_method):
            self.sent[metadata.internal_request_id] = replica_id  # where it went, whatever was chosen
            self.chosen.pop(metadata.internal_request_id, None)

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        self.full_since.pop(internal_request_id, None)
        self.sent.pop(internal_request_id, None)
        self.chosen.pop(internal_request_id, None)
