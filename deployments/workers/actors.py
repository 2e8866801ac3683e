"""The drafter and target actors of one coordinator replica: started in the replica's placement group,
replaced when one dies.

Bundle 0 of the group is the replica's own, 1 the drafter's, 2 the target's. When a node dies, Ray
re-places its bundles once a node with the resources joins (the autoscaler's replacement machine); a
replacement actor created in the same bundle starts there, so the replica keeps serving without Serve
restarting it. Requests running on the lost actor fail with ``WorkerLost`` (gRPC UNAVAILABLE, HTTP 503).
"""

from __future__ import annotations

import asyncio
import logging
import re

import ray
from ray.exceptions import ActorDiedError, RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deployments.config import ActorResources, AppConfig
from deployments.errors import ModelLoadFailed
from deployments.runtime.metrics import coordinator_metrics
from deployments.workers.api import ModelInfo
from deployments.workers.clients import ActorWorker
from deployments.workers.model_workers import DrafterWorker, TargetWorker

log = logging.getLogger("ray.serve")

BUNDLES = {"drafter": 1, "target": 2}  # bundle 0 is the replica's own


def kv_budget_shares(kv_cache_bytes: int | None, bytes_per_token: dict[str, int]) -> dict[str, int | None]:
    """Each model's part of the replica's KV budget (limits.kv_cache_bytes), by its KV bytes per token: admission
    counts a request's tokens in both models, so the two pools grow to the budget together. None: no bound."""
    per_token = sum(bytes_per_token.values())
    return {role: None if kv_cache_bytes is None or not per_token else kv_cache_bytes * size // per_token
            for role, size in bytes_per_token.items()}


def actor_name(role: str, generation: int = 1) -> str | None:
    """The Ray actor name of this replica's ``role`` actor: application, deployment, replica and role, in the
    way Serve names its replica actors (``SERVE_REPLICA::hetspec#HetSpecServer#<replica>``), e.g.
    ``hetspec#HetSpecServer#ab12cd34#drafter``; a replacement adds its generation (``...#drafter#2``). What the
    Ray dashboard's Actors tab and ``ray list actors`` show; None outside a Serve replica (an unnamed actor)."""
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        replica = serve.get_replica_context().replica_id
    except RayServeException:
        return None
    deployment = replica.deployment_id
    name = f"{deployment.app_name}#{deployment.name}#{replica.unique_id}#{role}"
    return name if generation == 1 else f"{name}#{generation}"


def _actor_options(resources: ActorResources, config: AppConfig, bundle_index: int) -> dict:
    options: dict = {"num_cpus": resources.num_cpus, "num_gpus": resources.num_gpus,
                     "resources": dict(resources.resources),
                     "max_concurrency": config.pipeline.actor_max_concurrency}  # threads: requests interleave
    if resources.memory_bytes:
        options["memory"] = resources.memory_bytes
    if config.pipeline.worker_env_vars:  # Ray merges these into the replica's runtime_env for the actor
        options["runtime_env"] = {"env_vars": dict(config.pipeline.worker_env_vars)}
    group = ray.util.get_current_placement_group()
    if group is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=bundle_index)
    return options


def _reason(error: RayActorError) -> str:
    """The exception an actor's constructor raised, from the last line of its traceback, else Ray's message."""
    message = str(error)
    for line in reversed(message.splitlines()):
        if re.match(r"^[\w.]+(Error|Exception|Exit|Interrupt)\b.*", line.strip()):
            return line.strip()
    return message


class ActorPipeline:
    def __init__(self, config: AppConfig):
        self.config = config
        self.target = ActorWorker("target", on_lost=self.replace_later)
        self.drafter = ActorWorker("drafter", on_lost=self.replace_later)
        self.target_info: ModelInfo | None = None
        self.drafter_info: ModelInfo | None = None
        self._replacing: dict[str, asyncio.Task] = {}
        self.kv_cache_bytes = config.limits.kv_cache_bytes  # the budget the actors' KV pools are given
        self.generations = {"target": 0, "drafter": 0}  # actors started per role: 1, then one more per replacement

    def _new_actor(self, role: str):
        worker_class, resources = ((TargetWorker, self.config.target_resources) if role == "target"
                                   else (DrafterWorker, self.config.drafter_resources))
        options = _actor_options(resources, self.config, BUNDLES[role])
        self.generations[role] += 1
        name = actor_name(role, self.generations[role])
        if name is not None:
            options["name"] = name
        model = self.config.target if role == "target" else self.config.drafter
        io = {"fetch": ray.get} if role == "target" else {"store": ray.put}
        return ray.remote(worker_class).options(**options).remote(model, self.config.pipeline, **io)

    async def start(self) -> None:
        """Both actors; returns once both models are loaded and the drafter knows the target's vocabulary.

        A model that fails to load raises ``ModelLoadFailed`` naming the model and the reason: the replica's
        constructor fails with it, and Serve shows it in the deployment's status message (``serve status``)
        and gives up after a few attempts (DEPLOY_FAILED) instead of restarting forever.
        """
        self.target.handle, self.drafter.handle = self._new_actor("target"), self._new_actor("drafter")
        target_info = self.target.handle.info.remote()
        drafter_info = self.drafter.handle.info.remote()
        # the target's first: the drafter's attach_target fails too when the target's info never comes
        for role, info in (("target", target_info), ("drafter", drafter_info)):
            try:
                setattr(self, f"{role}_info", await info)
            except RayActorError as error:
                model = self.config.target if role == "target" else self.config.drafter
                raise ModelLoadFailed(role, model.model, _reason(error)) from None
        await self.drafter.handle.attach_target.remote(target_info)  # the tokenizer goes by reference
        await asyncio.gather(*self.set_kv_budget(self.kv_cache_bytes))
        log.info("pipeline started: %s", self.describe())

    def set_kv_budget(self, kv_cache_bytes: int | None) -> list:
        """Give each actor's KV pool its share of ``kv_cache_bytes`` (``kv_budget_shares``): the pools stop
        doubling at it (hetspec/kv.py). The calls' refs, to await or not (a reconfigure does not wait)."""
        self.kv_cache_bytes = kv_cache_bytes
        shares = kv_budget_shares(kv_cache_bytes, {"target": self.target_info.kv_bytes_per_token,
                                                   "drafter": self.drafter_info.kv_bytes_per_token})
        return [worker.handle.set_kv_budget.remote(shares[worker.role]) for worker in (self.target, self.drafter)]

    def describe(self) -> str:
        """This replica's actors by role: Ray actor id and name (``ray list actors``, the dashboard's Actors tab)."""
        # Ray 2.60 has no public accessor for a handle's actor id
        return "; ".join(f"{worker.role} actor {worker.handle._actor_id.hex()} "
                         f"({actor_name(worker.role, self.generations[worker.role])})"
                         for worker in (self.target, self.drafter))

    def replace_later(self, role: str) -> None:
        """Replace a dead actor in the background, once (calls meanwhile wait for the new actor)."""
        if role not in self._replacing or self._replacing[role].done():
            self._replacing[role] = asyncio.get_running_loop().create_task(self._replace(role))

    async def _replace(self, role: str) -> None:
        log.warning("replacing the %s actor of this replica", role)
        worker = self.target if role == "target" else self.drafter
        worker.available = False  # requests fail fast (UNAVAILABLE) instead of queueing on an actor not yet there
        worker.handle = self._new_actor(role)
        if role == "drafter":  # a new drafter needs the target's vocabulary again
            await worker.handle.attach_target.remote(ray.put(self.target_info))
        else:
            await worker.handle.ping.remote()
        shares = kv_budget_shares(self.kv_cache_bytes, {"target": self.target_info.kv_bytes_per_token,
                                                        "drafter": self.drafter_info.kv_bytes_per_token})
        await worker.handle.set_kv_budget.remote(shares[role])
        worker.available = True
        coordinator_metrics().actor_replacements.inc(tags={"role": role})
        log.warning("the %s actor of this replica is back: %s", role, self.describe())

    async def check(self) -> None:
        """Replace an actor found dead; raise if a replacement itself failed (Serve then restarts us)."""
        for role, task in list(self._replacing.items()):
            if task.done() and task.exception() is not None:
                del self._replacing[role]
                raise RuntimeError(f"replacing the {role} actor failed") from task.exception()
        for worker in (self.target, self.drafter):
            if worker.role in self._replacing and not self._replacing[worker.role].done():
                continue
            try:
                await worker.handle.ping.remote()
            except ActorDiedError:
                self.replace_later(worker.role)
            except RayActorError:  # unreachable for now (a network blip): the next check looks again
                log.warning("the %s actor of this replica does not answer", worker.role)
