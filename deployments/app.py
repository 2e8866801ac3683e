"""The Serve application: ``serve run deployments/config.yaml``, or ``serve.run(build_app(args))``.

One deployment, ``HetSpecServer``: the HTTP (OpenAI) and gRPC ingress and the coordinator, composed here
(the composition root: the one module that imports the API, the serving loop and the actor transport). Each replica
reserves a placement group of three bundles (itself, its drafter, its target) and starts its drafter and
target actors in bundles 1 and 2, so autoscaling the deployment adds whole pipelines and the placement
strategy decides whether a pipeline's models share a node. The per-token path is direct actor calls.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable

import ray
from ray import serve

from deployments.api.grpc_service import GrpcMethods
from deployments.api.openai_api import build_openai_app
from deployments.auth import unauthenticated_warning
from deployments.config import SERVER_DEPLOYMENT, AppConfig, AutoscalingConfig, LimitsConfig, with_user_config
from deployments.serving.coordinator import Coordinator
from deployments.workers.actors import ActorPipeline

log = logging.getLogger("ray.serve")


class HetSpecServer:
    """A coordinator replica and its pipeline. ``make_pipeline`` is injected: the default starts Ray actors.
    The HTTP routes reach the coordinator through Serve's replica context (deployments/api/openai_api.py), the
    gRPC methods are forwarded to a ``GrpcMethods`` on it."""

    async def __init__(self, config: dict | AppConfig, make_pipeline: Callable[[AppConfig], Any] = ActorPipeline):
        config = AppConfig.model_validate(config)
        self.args = config  # what a user_config overrides (each one anew: Serve's user_config is declarative)
        self.pipeline = make_pipeline(config)
        await self.pipeline.start()
        self.coordinator = Coordinator(config, self.pipeline.target, self.pipeline.drafter,
                                       self.pipeline.target_info, self.pipeline.drafter_info)
        self.grpc = GrpcMethods(self.coordinator)
        if warning := unauthenticated_warning(self.coordinator.api_keys, http_host()):
            log.warning(warning)

    async def Generate(self, request: Any, grpc_context=None) -> Any:  # noqa: N802 -- the proto's method name
        """``hetspec.v1.HetSpec/Generate`` (protos/hetspec/v1/hetspec.proto)."""
        return await self.grpc.Generate(request, grpc_context)

    async def GenerateStream(self, request: Any, grpc_context=None) -> AsyncIterator[Any]:  # noqa: N802
        """``hetspec.v1.HetSpec/GenerateStream``; closed (the client gone), it closes the request's stream at once."""
        async with aclosing(self.grpc.GenerateStream(request, grpc_context)) as responses:
            async for response in responses:
                yield response

    def reconfigure(self, user_config: dict) -> None:
        """Serve's ``user_config`` (deployments/config.py, UserConfig): new speculation and limits for new
        requests, the model actors untouched. Serve calls it at start and on a deploy that changes only the
        user_config; raising ``InvalidUserConfig`` fails that replica's update with the message."""
        config = with_user_config(self.args, user_config)
        self.coordinator.reconfigure(config)
        self.pipeline.set_kv_budget(config.limits.kv_cache_bytes)  # the actors' KV pools follow the budget
        log.info("reconfigured: speculation %s; limits %s", config.speculation.model_dump(),
                 config.limits.model_dump())

    async def check_health(self) -> None:
        """Serve's health check: a dead actor is replaced here; only a failed replacement makes us unhealthy."""
        await self.pipeline.check()

    def record_routing_stats(self) -> dict[str, int]:
        """What Serve hands our request router (deployments/serving/routing.py) about this replica: what its admission
        takes now (a user_config may have changed the limits since the deployment's options were set)."""
        return {"capacity": replica_capacity(self.coordinator.config.limits)}

    async def actor_nodes(self) -> dict[str, str | None]:
        """The node ids of this replica's actors (placement checks)."""
        target, drafter = await asyncio.gather(self.pipeline.target.node_id(), self.pipeline.drafter.node_id())
        return {"coordinator": ray.get_runtime_context().get_node_id(), "target": target, "drafter": drafter}

    async def actor_handles(self) -> dict[str, Any]:
        """This replica's drafter and target actor handles (fault tests kill them with ``ray.kill``)."""
        return {"target": self.pipeline.target.handle, "drafter": self.pipeline.drafter.handle}


def http_host() -> str | None:
    """The address Serve's HTTP proxies listen on; None if it cannot be told.

    Private API: Ray 2.60 has no public accessor for the running ``http_options`` (the controller's client
    holds them)."""
    try:
        from ray.serve.context import _get_global_client

        return _get_global_client().http_config.host
    except Exception:  # noqa: BLE001 -- no Serve controller reachable (a test's in-process server)
        return None


def replica_capacity(limits: LimitsConfig) -> int:
    """Requests one replica's admission takes (running + waiting)."""
    return limits.max_running_requests + limits.max_waiting_requests


# Serve's max_ongoing_requests is the replica's capacity plus these: /health, /v1/models and /v1/stats count as
# ongoing, and set exactly at the capacity they queued behind generations on a full replica (a stats poll then
# held a slot a waiting request needed: tests/test_limits_serve.py). Generations are kept within the capacity
# by our request router (deployments/serving/routing.py), and the replica's admission answers any beyond (429).
CONTROL_SLOTS = 8
# How often a replica reports its capacity to the routers (Serve's default is 10 s)
ROUTING_STATS_PERIOD_S = 5.0


def autoscaling_options(scaling: AutoscalingConfig) -> dict:
    """Serve's ``autoscaling_config``: Serve's default policy on ongoing requests per replica."""
    return scaling.model_dump(include={"min_replicas", "max_replicas", "target_ongoing_requests",
                                       "upscale_delay_s", "downscale_delay_s", "look_back_period_s"})


def deployment_options(config: AppConfig) -> dict:
    """Serve options of the deployment.

    ``max_ongoing_requests`` is what the replica's admission takes (``replica_capacity``) plus ``CONTROL_SLOTS``;
    generations go where the admission has room (``request_router_config``: deployments/serving/routing.py);
    Serve's ``max_queued_requests`` bounds what each proxy holds when every replica is full or still starting,
    answered 429 with Retry-After.
    """
    scaling, limits = config.autoscaling, config.limits
    replica = config.coordinator_resources
    actor_options: dict = {"num_cpus": replica.num_cpus, "num_gpus": replica.num_gpus,
                           "resources": dict(replica.resources)}
    if replica.memory_bytes:
        actor_options["memory"] = replica.memory_bytes
    return {
        "name": SERVER_DEPLOYMENT,
        "ray_actor_options": actor_options,
        "placement_group_bundles": [replica.bundle(), config.drafter_resources.bundle(),
                                    config.target_resources.bundle()],
        "placement_group_strategy": config.pipeline.placement_strategy,
        "max_ongoing_requests": replica_capacity(limits) + CONTROL_SLOTS,
        "max_queued_requests": scaling.max_queued_requests,
        "backpressure_config": {"status_code": 429, "retry_after_s": limits.retry_after_s},
        "autoscaling_config": autoscaling_options(scaling),
        "request_router_config": {"request_router_class": "deployments.serving.routing.RoomRouter",
                                  "request_router_kwargs": {"capacity": replica_capacity(limits)},
                                  "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S},
        "health_check_period_s": config.lifecycle.health_check_period_s,
        "health_check_timeout_s": config.lifecycle.health_check_timeout_s,
        "graceful_shutdown_timeout_s": config.graceful_shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": config.lifecycle.graceful_shutdown_wait_loop_s,
        # Serve calls reconfigure only while a user_config is set: with {} as the code's own, a Serve config
        # that drops its user_config reconfigures the replicas back to args instead of leaving the last one
        "user_config": {},
    }


def build_app(args: dict) -> serve.Application:
    """The Serve app builder named in the config files (``import_path: deployments.app:build_app``)."""
    config = AppConfig.model_validate(args)
    cors = config.cors

    def http_app():  # a plain function: Serve calls builder functions (a functools.partial it would not)
        return build_openai_app(cors=cors)

    ingress = serve.ingress(http_app)(HetSpecServer)
    # plain JSON for the replicas, API keys included (every other dump of the config masks them)
    replica_args = config.model_dump(mode="json", context={"reveal_secrets": True})
    return serve.deployment(ingress, **deployment_options(config)).bind(replica_args)
