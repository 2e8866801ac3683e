"""The Serve application: ``serve run deployments/config.yaml``, or ``serve.run(build_app(args))``.

One deployment, ``HetSpecServer``: the HTTP (OpenAI) and gRPC ingress and the coordinator. Each replica
reserves a placement group of three bundles (itself, its drafter, its target) and starts its drafter and
target actors in bundles 1 and 2, so autoscaling the deployment adds whole pipelines and the placement
strategy decides whether a pipeline's models share a node. The per-token path is direct actor calls.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import ray
from ray import serve
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deployments.config import ActorResources, AppConfig
from deployments.coordinator import Coordinator
from deployments.grpc_service import GrpcMethods
from deployments.openai_api import build_openai_app
from deployments.pipeline import ActorWorker
from deployments.workers import DrafterWorker, ModelInfo, TargetWorker

DRAFTER_BUNDLE, TARGET_BUNDLE = 1, 2  # bundle 0 is the replica's own


@dataclass
class Pipeline:
    target: Any  # a Worker (deployments.pipeline.Worker)
    drafter: Any
    target_info: ModelInfo
    drafter_info: ModelInfo


def _actor_options(resources: ActorResources, config: AppConfig, bundle_index: int) -> dict:
    options: dict = {"num_cpus": resources.num_cpus, "num_gpus": resources.num_gpus,
                     "resources": dict(resources.resources),
                     "max_concurrency": config.pipeline.actor_max_concurrency}  # threads: requests interleave
    if resources.memory_bytes:
        options["memory"] = resources.memory_bytes
    group = ray.util.get_current_placement_group()
    if group is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=bundle_index)
    return options


async def start_actor_pipeline(config: AppConfig) -> Pipeline:
    """The drafter and target actors of this replica, in its placement group; returns once both models loaded."""
    target = ray.remote(TargetWorker).options(**_actor_options(config.target_resources, config, TARGET_BUNDLE)) \
        .remote(config.target, config.pipeline, fetch=ray.get)
    drafter = ray.remote(DrafterWorker).options(**_actor_options(config.drafter_resources, config, DRAFTER_BUNDLE)) \
        .remote(config.drafter, config.pipeline, store=ray.put)
    target_info = target.info.remote()
    attached = drafter.attach_target.remote(target_info)  # the tokenizer goes by reference, pickled once
    target_info, drafter_info, _ = await asyncio.gather(target_info, drafter.info.remote(), attached)
    return Pipeline(ActorWorker(target), ActorWorker(drafter), target_info, drafter_info)


class HetSpecServer(GrpcMethods):
    """A coordinator replica. ``start_pipeline`` is injected: the default starts Ray actors."""

    async def __init__(self, config: dict | AppConfig,
                       start_pipeline: Callable[[AppConfig], Awaitable[Pipeline]] = start_actor_pipeline):
        config = AppConfig.model_validate(config)
        self.pipeline = await start_pipeline(config)
        self.coordinator = Coordinator(config, self.pipeline.target, self.pipeline.drafter,
                                       self.pipeline.target_info, self.pipeline.drafter_info)

    async def check_health(self) -> None:
        """Serve's health check: the replica is unhealthy once either of its actors is gone."""
        await self.coordinator.check_health()

    async def actor_nodes(self) -> dict[str, str | None]:
        """The node ids of this replica's actors (placement checks)."""
        target, drafter = await asyncio.gather(self.pipeline.target.call("node_id"),
                                               self.pipeline.drafter.call("node_id"))
        return {"coordinator": ray.get_runtime_context().get_node_id(), "target": target, "drafter": drafter}


def deployment_options(config: AppConfig) -> dict:
    scaling = config.autoscaling
    replica = config.coordinator_resources
    actor_options: dict = {"num_cpus": replica.num_cpus, "num_gpus": replica.num_gpus,
                           "resources": dict(replica.resources)}
    if replica.memory_bytes:
        actor_options["memory"] = replica.memory_bytes
    return {
        "name": "HetSpecServer",
        "ray_actor_options": actor_options,
        "placement_group_bundles": [replica.bundle(), config.drafter_resources.bundle(),
                                    config.target_resources.bundle()],
        "placement_group_strategy": config.pipeline.placement_strategy,
        "max_ongoing_requests": scaling.max_ongoing_requests,
        "autoscaling_config": {"min_replicas": scaling.min_replicas, "max_replicas": scaling.max_replicas,
                               "target_ongoing_requests": scaling.target_ongoing_requests},
        "health_check_period_s": 10,
        "health_check_timeout_s": 30,
    }


def build_app(args: dict) -> serve.Application:
    """The Serve app builder named in the config files (``import_path: deployments.app:build_app``)."""
    config = AppConfig.model_validate(args)
    ingress = serve.ingress(build_openai_app)(HetSpecServer)
    return serve.deployment(ingress, **deployment_options(config)).bind(config.model_dump(mode="json"))
