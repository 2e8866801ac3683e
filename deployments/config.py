"""The Serve application's settings: one pydantic model, validated by ``deployments.app:build_app``.

Unknown fields are rejected and every field is described, so a typo in a Serve config file or in the
KubeRay manifest that embeds it fails at deploy time with the field's name, not at the first request.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from hetspec.config import ModelConfig, SpeculationConfig, StrictModel

PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


class ActorResources(StrictModel):
    num_cpus: float = Field(1.0, ge=0.0, description="Logical CPUs reserved for this actor in its placement bundle.")
    num_gpus: float = Field(0.0, ge=0.0, description="GPUs reserved for this actor (1 on GPU machines: a GPU each).")
    memory_bytes: int | None = Field(None, ge=0, description="Memory reserved for this actor; None reserves none.")
    resources: dict[str, float] = Field(default_factory=dict, description=(
        "Custom Ray resources this actor's bundle asks for, e.g. a node label {'drafter_node': 1}."))

    def bundle(self) -> dict[str, float]:
        """The placement-group bundle of this actor (zero amounts left out)."""
        amounts = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        if self.memory_bytes:
            amounts["memory"] = float(self.memory_bytes)
        bundle = {name: amount for name, amount in amounts.items() if amount > 0}
        return bundle or {"CPU": 0.01}  # Ray rejects an empty bundle; a sliver of CPU still places it


class PipelineConfig(StrictModel):
    placement_strategy: PlacementStrategy = Field("PACK", description=(
        "How a coordinator replica's three bundles (itself, drafter, target) are placed: PACK on as few nodes "
        "as possible, SPREAD across nodes when it can, STRICT_SPREAD on three different nodes, STRICT_PACK on one."))
    pipelined: bool = Field(True, description=(
        "Default for requests: draft chunk i+1 while the target verifies chunk i (a request may override it)."))
    max_sessions: int = Field(16, ge=1, le=4096, description=(
        "Most requests whose KV cache one drafter or target actor holds at once; more get 'resource exhausted'."))
    session_idle_timeout_s: float = Field(120.0, gt=0.0, description=(
        "A KV session untouched this long is freed (a coordinator that died mid-request leaves no leak)."))
    actor_max_concurrency: int = Field(16, ge=1, le=1024, description=(
        "Calls one drafter or target actor runs at once (threads), so concurrent requests interleave."))


class AutoscalingConfig(StrictModel):
    min_replicas: int = Field(1, ge=0, description="Fewest coordinator replicas (each one a whole pipeline).")
    max_replicas: int = Field(1, ge=1, description="Most coordinator replicas (each one a whole pipeline).")
    target_ongoing_requests: float = Field(4.0, gt=0.0, description=(
        "Ongoing requests per replica the autoscaler aims for."))
    max_ongoing_requests: int = Field(16, ge=1, description="Requests one replica accepts before Serve queues them.")

    @model_validator(mode="after")
    def _bounds(self) -> "AutoscalingConfig":
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must not exceed max_replicas")
        return self


class LimitsConfig(StrictModel):
    max_prompt_tokens: int = Field(4096, ge=1, description="Longest prompt (in target tokens) a request may send.")
    max_new_tokens: int = Field(1024, ge=1, le=32768, description="Largest max_new_tokens a request may ask for.")
    default_max_new_tokens: int = Field(128, ge=1, le=32768, description=(
        "max_new_tokens of a request that gives none (capped by max_new_tokens)."))


class AppConfig(StrictModel):
    """The whole application: the ``args`` of ``deployments.app:build_app`` in a Serve config file."""

    model_id: str = Field("hetspec", min_length=1, description="Model name served by /v1/models and echoed back.")
    target: ModelConfig = Field(description="The target model: its distribution is the output's.")
    drafter: ModelConfig = Field(description="The drafter model proposing tokens (any vocabulary).")
    speculation: SpeculationConfig = Field(default_factory=SpeculationConfig, description=(
        "Speculation defaults; a request may override algorithm and draft_tokens."))
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig, description="Pipelining and KV sessions.")
    coordinator_resources: ActorResources = Field(
        default_factory=lambda: ActorResources(num_cpus=0.5), description="Bundle of each coordinator replica.")
    drafter_resources: ActorResources = Field(default_factory=ActorResources,
                                              description="Bundle of the drafter actor.")
    target_resources: ActorResources = Field(default_factory=ActorResources, description="Bundle of the target actor.")
    autoscaling: AutoscalingConfig = Field(default_factory=AutoscalingConfig, description=(
        "Serve autoscaling of the coordinator on ongoing requests."))
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="Per-request limits.")
    chat_template: str | None = Field(None, description=(
        "Jinja chat template for a model whose tokenizer has none (a base model), so chat requests still work; "
        "a model's own template always wins."))

    @model_validator(mode="after")
    def _sessions_for_every_request(self) -> "AppConfig":
        # each ongoing request of a replica holds one session in each of the replica's actors
        if self.autoscaling.max_ongoing_requests > self.pipeline.max_sessions:
            raise ValueError(f"autoscaling.max_ongoing_requests ({self.autoscaling.max_ongoing_requests}) must not "
                             f"exceed pipeline.max_sessions ({self.pipeline.max_sessions})")
        return self

    @model_validator(mode="after")
    def _gpu_devices(self) -> "AppConfig":
        for name in ("target", "drafter"):
            model, resources = getattr(self, name), getattr(self, f"{name}_resources")
            if model.device.startswith("cuda") and resources.num_gpus <= 0:
                raise ValueError(f"{name}.device is {model.device} but {name}_resources.num_gpus is 0")
        return self
