"""The Serve application's settings: one pydantic model, validated by ``deployments.app:build_app``.

Unknown fields are rejected and every field is described, so a typo in a Serve config file or in the
KubeRay manifest that embeds it fails at deploy time with the field's name, not at the first request.
"""

from __future__ import annotations

import os
import re
from typing import Literal, Mapping

from pydantic import (ConfigDict, Field, SecretStr, SerializationInfo, ValidationError, field_serializer, field_validator,
                      model_validator)

from hetspec.config import ModelConfig, SpeculationConfig, StrictModel

from deployments.auth import keys_from_environment

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
        "Default for requests: the drafter drafts each request's next step while the target verifies this one, "
        "assuming the whole draft accepted (hetspec/ahead.py); a request may override it."))
    max_sessions: int = Field(16, ge=1, le=4096, description=(
        "Most requests whose KV cache one drafter or target actor holds at once; more get 'resource exhausted'."))
    session_idle_timeout_s: float = Field(120.0, gt=0.0, description=(
        "A KV session untouched this long is freed (a coordinator that died mid-request leaves no leak)."))
    actor_max_concurrency: int = Field(16, ge=1, le=1024, description=(
        "Calls one drafter or target actor runs at once (threads), so concurrent requests interleave."))
    model_lanes: int = Field(2, ge=1, le=64, description=(
        "Model calls one drafter or target actor runs at once, each on its own thread: a lasting first lane, "
        "the others only while it is busy. Forward passes are batched (one at a time, every waiting request "
        "in it), so a side lane only takes session set-up; the CPU threads are split among the calls running "
        "(deployments/runtime/model_threads.py)."))
    worker_env_vars: dict[str, str] = Field(default_factory=dict, description=(
        "Environment variables of the drafter and target actors' processes (Ray's runtime_env env_vars), set "
        "before they start: e.g. LD_PRELOAD: libjemalloc.so.2, with which a soak's drafter ran 390 MiB lower than "
        "on glibc's allocator (docs/deploy.md, 'Memory allocator of the model workers'). A library the node lacks "
        "is skipped by the loader with a warning. (MALLOC_MMAP_THRESHOLD_=65536 also returns freed memory, but the "
        "realistic pair ran 21% slower with it.)"))
    heap_trim_interval_s: float = Field(30.0, ge=0.0, le=3600.0, allow_inf_nan=False, description=(
        "Every this many seconds the drafter and target actors give the C heap's free pages back to the system "
        "(glibc malloc_trim), so their resident memory follows what they hold; 0: never "
        "(deployments/runtime/heap_trim.py says why)."))
    prefill_chunk_tokens: int = Field(128, ge=1, le=65536, description=(
        "A new request's prompt is fed in chunks of at most this many tokens, one chunk a pass, packed with "
        "the other requests' decoding rows (hetspec/layouts.py), so a long prompt does not stall their decoding; "
        "a smaller chunk makes their steps shorter while a prompt is fed and the prompt slower."))

    @field_validator("worker_env_vars")
    @classmethod
    def _env_names(cls, env_vars: dict[str, str]) -> dict[str, str]:
        for name in env_vars:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ValueError(f"{name!r} is not an environment variable name (letters, digits and _, "
                                 "not starting with a digit)")
        return env_vars


class CorsConfig(StrictModel):
    allow_origins: list[str] = Field(default_factory=list, description=(
        "Browser origins allowed to call the HTTP API (e.g. ['https://app.example.com'], or ['*']); empty: "
        "no CORS headers at all (off)."))
    allow_methods: list[str] = Field(default_factory=lambda: ["GET", "POST"], description="Methods allowed.")
    allow_headers: list[str] = Field(default_factory=lambda: ["Authorization", "Content-Type"], description=(
        "Request headers allowed (Authorization carries the API key)."))
    allow_credentials: bool = Field(False, description="Whether a browser may send cookies or HTTP auth along.")


class LifecycleConfig(StrictModel):
    health_check_period_s: float = Field(10.0, gt=0.0, le=3600.0, allow_inf_nan=False, description=(
        "How often Serve checks a replica's health (its drafter and target actors answer; a dead one is replaced)."))
    health_check_timeout_s: float = Field(30.0, gt=0.0, le=3600.0, allow_inf_nan=False, description=(
        "A health check that takes longer fails; after a few failures Serve restarts the replica."))
    graceful_shutdown_timeout_s: float | None = Field(None, ge=0.0, le=86400.0, allow_inf_nan=False, description=(
        "How long a replica being removed (scale-down, redeploy) keeps serving its running requests before "
        "Serve stops it. None: limits.request_timeout_s plus 10 s (600 s when there is no request timeout), "
        "so running requests finish instead of being cut after Serve's default 20 s."))
    graceful_shutdown_wait_loop_s: float = Field(2.0, gt=0.0, le=60.0, allow_inf_nan=False, description=(
        "How often a replica being removed checks whether its requests have finished."))


class AutoscalingConfig(StrictModel):
    min_replicas: int = Field(1, ge=0, description="Fewest coordinator replicas (each one a whole pipeline).")
    max_replicas: int = Field(1, ge=1, description="Most coordinator replicas (each one a whole pipeline).")
    target_ongoing_requests: float = Field(4.0, gt=0.0, description=(
        "Ongoing requests per replica (running, waiting in its line, or held for it in Serve's queue) the "
        "autoscaler aims for: Serve runs ceil(total ongoing / this) replicas. Set it near what one replica "
        "decodes at full speed (limits.max_running_requests or below), docs/deploy.md 'Autoscaling signal'."))
    upscale_delay_s: float = Field(30.0, ge=0.0, le=3600.0, allow_inf_nan=False, description=(
        "How long the load must call for more replicas before Serve adds one (Serve's default: 30 s). A new "
        "replica loads two models, so a short burst is better absorbed by the replicas' lines."))
    downscale_delay_s: float = Field(600.0, ge=0.0, le=86400.0, allow_inf_nan=False, description=(
        "How long the load must call for fewer replicas before Serve removes one (Serve's default: 600 s); a "
        "removed replica drains its running requests first (lifecycle.graceful_shutdown_timeout_s)."))
    look_back_period_s: float = Field(30.0, gt=10.0, le=3600.0, allow_inf_nan=False, description=(
        "Window over which Serve averages the ongoing requests it scales on (Serve's default: 30 s); shorter "
        "follows the load sooner and noisier. Above 10 s: Serve's handles and replicas report every 10 s."))
    max_queued_requests: int = Field(64, ge=1, description=(
        "Requests each Serve proxy holds while every replica is full or still starting (e.g. a new pipeline "
        "loading its models); beyond: HTTP 429 / gRPC RESOURCE_EXHAUSTED from Serve itself, with Retry-After."))

    @model_validator(mode="after")
    def _bounds(self) -> "AutoscalingConfig":
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must not exceed max_replicas")
        return self


# The gRPC message bound to give Serve's proxy (the environment variable RAY_SERVE_GRPC_MAX_MESSAGE_SIZE of the
# Ray processes; Ray's default is 2 GiB): a larger message is refused RESOURCE_EXHAUSTED before any replica
# sees it. The HTTP counterpart is limits.max_request_bytes.
GRPC_MAX_MESSAGE_BYTES = 4 * 1024 * 1024


class LimitsConfig(StrictModel):
    max_prompt_tokens: int = Field(4096, ge=1, description="Longest prompt (in target tokens) a request may send.")
    max_new_tokens: int = Field(1024, ge=1, le=32768, description="Largest max_new_tokens a request may ask for.")
    default_max_new_tokens: int = Field(128, ge=1, le=32768, description=(
        "max_new_tokens of a request that gives none (capped by max_new_tokens)."))
    max_running_requests: int = Field(16, ge=1, le=4096, description=(
        "Requests one pipeline (replica) decodes at once, each holding a KV session in both actors."))
    max_waiting_requests: int = Field(32, ge=0, le=65536, description=(
        "Requests one replica holds, first come first served, while max_running_requests decode; beyond: "
        "HTTP 429 / gRPC RESOURCE_EXHAUSTED with a Retry-After hint. 0: no waiting, reject at once."))
    retry_after_s: float = Field(1.0, ge=0.0, le=3600.0, allow_inf_nan=False, description=(
        "The Retry-After hint (seconds, rounded up) sent with a request turned away because the server is full."))
    kv_cache_bytes: int | None = Field(None, ge=1, description=(
        "KV cache budget of one replica (drafter and target together): a request is admitted while every "
        "running request's (prompt + max_new_tokens) tokens times the models' KV bytes per token fit in it, "
        "else it waits in line (429 / RESOURCE_EXHAUSTED when the line is full, or at once when it alone "
        "exceeds the budget). None: no budget, max_running_requests alone bounds the requests."))
    request_timeout_s: float | None = Field(600.0, gt=0.0, allow_inf_nan=False, description=(
        "Longest a request may take on a replica, waiting included; past it the request stops, its KV "
        "sessions are freed and the client gets HTTP 408 / gRPC DEADLINE_EXCEEDED. None: no limit."))
    max_request_bytes: int = Field(4 * 1024 * 1024, ge=4096, description=(
        "Largest HTTP request body; a larger one is refused with 413 before it is read (a gRPC message's bound "
        "is the proxy's: RAY_SERVE_GRPC_MAX_MESSAGE_SIZE, docs/deploy.md). Prompts are also bounded in "
        "characters before they are tokenized: max_prompt_tokens times the target's longest token."))
    max_request_new_tokens: int = Field(4096, ge=1, description=(
        "Most tokens one request may ask for in all its choices: n x max_tokens."))
    max_logprob_entries: int = Field(16384, ge=1, description=(
        "Most log-probabilities one request may ask for: n x max_tokens x (1 + top_logprobs)."))

    @model_validator(mode="after")
    def _default_within_limit(self) -> "LimitsConfig":
        if self.default_max_new_tokens > self.max_new_tokens:
            raise ValueError(f"default_max_new_tokens ({self.default_max_new_tokens}) must not exceed "
                             f"max_new_tokens ({self.max_new_tokens})")
        return self


# API keys go in HTTP headers and gRPC metadata: printable ASCII, no spaces, no commas (the env var's separator).
_KEY_CHARACTERS = frozenset(chr(code) for code in range(0x21, 0x7F)) - {","}


class AuthConfig(StrictModel):
    model_config = ConfigDict(**StrictModel.model_config, hide_input_in_errors=True)  # errors never echo a key

    api_keys: list[SecretStr] = Field(default_factory=list, description=(
        "API keys a client may present (HTTP 'Authorization: Bearer <key>', gRPC metadata 'authorization: "
        "Bearer <key>' or 'x-api-key'). Anyone who can read the Serve config (dashboard, 'serve config') "
        "sees them: prefer api_key_env. No key from here or the environment: no authentication."))
    api_key_env: str | None = Field("HETSPEC_API_KEY", min_length=1, description=(
        "Environment variable each replica reads at start: when set and not empty, its comma-separated keys "
        "replace api_keys (e.g. filled from a Kubernetes Secret). None: the environment is not read."))

    @field_validator("api_keys")
    @classmethod
    def _header_safe(cls, keys: list[SecretStr]) -> list[SecretStr]:
        for index, key in enumerate(keys):  # never echo a key in the error
            if not key.get_secret_value() or not set(key.get_secret_value()) <= _KEY_CHARACTERS:
                raise ValueError(f"api_keys[{index}] must be non-empty printable ASCII without spaces or commas")
        return keys

    @field_serializer("api_keys", when_used="always")
    def _dump_keys(self, keys: list[SecretStr], info: SerializationInfo) -> list:
        # masked in every dump except the one handing the config to the replicas (build_app)
        if (info.context or {}).get("reveal_secrets"):
            return [key.get_secret_value() for key in keys]
        return [key if info.mode == "python" else str(key) for key in keys]

    def resolve_keys(self, environ: Mapping[str, str] = os.environ) -> list[str]:
        """The keys in force: the environment variable's when it is set and not empty, else api_keys."""
        keys = keys_from_environment(self.api_key_env, environ) if self.api_key_env else []
        if keys:
            if any(not set(key) <= _KEY_CHARACTERS for key in keys):
                raise ValueError(f"${self.api_key_env} must hold printable ASCII keys without spaces, "
                                 "separated by commas")
            return keys
        return [key.get_secret_value() for key in self.api_keys]


class AppConfig(StrictModel):
    """The whole application: the ``args`` of ``deployments.app:build_app`` in a Serve config file."""

    # Errors name the field and the rule but never repeat the input: it may hold an API key (auth.api_keys),
    # and Serve shows a failed deployment's error to anyone who can read its status.
    model_config = ConfigDict(**StrictModel.model_config, hide_input_in_errors=True)

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
    cors: CorsConfig = Field(default_factory=CorsConfig, description=(
        "Cross-origin requests from browsers (FastAPI's CORSMiddleware); off unless origins are listed."))
    lifecycle: LifecycleConfig = Field(default_factory=LifecycleConfig, description=(
        "Serve's health checks of a replica and how long a replica being removed drains its requests."))
    autoscaling: AutoscalingConfig = Field(default_factory=AutoscalingConfig, description=(
        "Serve autoscaling of the coordinator on ongoing requests."))
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description=(
        "Per-request limits, concurrency, the waiting queue and the request timeout."))
    auth: AuthConfig = Field(default_factory=AuthConfig, description=(
        "Optional API keys required on every HTTP route but /health and on every gRPC method."))
    chat_template: str | None = Field(None, description=(
        "Jinja chat template for a model whose tokenizer has none (a base model), so chat requests still work; "
        "a model's own template always wins."))

    @model_validator(mode="after")
    def _sessions_for_every_request(self) -> "AppConfig":
        # each running request of a replica holds one session in each of the replica's actors
        if self.limits.max_running_requests > self.pipeline.max_sessions:
            raise ValueError(f"limits.max_running_requests ({self.limits.max_running_requests}) must not "
                             f"exceed pipeline.max_sessions ({self.pipeline.max_sessions})")
        return self

    @model_validator(mode="after")
    def _drain_running_requests(self) -> "AppConfig":
        drain, timeout = self.lifecycle.graceful_shutdown_timeout_s, self.limits.request_timeout_s
        if drain is not None and timeout is not None and drain < timeout:
            raise ValueError(f"lifecycle.graceful_shutdown_timeout_s ({drain}) must be at least "
                             f"limits.request_timeout_s ({timeout}): a replica being removed would cut running "
                             "requests")
        return self

    @property
    def graceful_shutdown_timeout_s(self) -> float:
        """The drain time in force (``lifecycle.graceful_shutdown_timeout_s`` or its default)."""
        if self.lifecycle.graceful_shutdown_timeout_s is not None:
            return self.lifecycle.graceful_shutdown_timeout_s
        timeout = self.limits.request_timeout_s
        return 600.0 if timeout is None else timeout + 10.0

    @model_validator(mode="after")
    def _gpu_devices(self) -> "AppConfig":
        for name in ("target", "drafter"):
            model, resources = getattr(self, name), getattr(self, f"{name}_resources")
            if model.device.startswith("cuda") and resources.num_gpus <= 0:
                raise ValueError(f"{name}.device is {model.device} but {name}_resources.num_gpus is 0")
        return self


# --- Serve's user_config: the settings a running replica takes without restarting ------------------------------

# A replica applies these through HetSpecServer.reconfigure, for its new requests. Every other section loads,
# sizes or places the model actors (models, dtypes, resources, placement, sessions) or is fixed when the
# replica starts (CORS, auth, autoscaling, drain): it changes only by redeploying args, which restarts replicas.
HOT_SECTIONS = ("speculation", "limits")
# The deployment's name: where a Serve config puts its user_config (applications[].deployments[].name).
SERVER_DEPLOYMENT = "HetSpecServer"


class InvalidUserConfig(ValueError):
    """A user_config the running replica cannot take; the message names the field and what to do instead."""

    def __reduce__(self):  # raised in a replica, shown by the Serve controller
        return InvalidUserConfig, (str(self),)


class UserConfig(StrictModel):
    """The ``user_config`` of the HetSpecServer deployment: overrides of the ``args`` sections a replica can
    change in place. A field given replaces args' value, one left out keeps args' value; each is validated
    by the same models as args (``with_user_config``)."""

    speculation: dict[str, object] = Field(default_factory=dict, description=(
        "Fields of args.speculation (SpeculationConfig) to override for new requests, e.g. {draft_tokens: 3}."))
    limits: dict[str, object] = Field(default_factory=dict, description=(
        "Fields of args.limits (LimitsConfig) to override for new requests; running and waiting requests keep "
        "the limits they were admitted under."))

    @model_validator(mode="before")
    @classmethod
    def _redeploy_sections(cls, value: object) -> object:
        if isinstance(value, Mapping):
            cold = [name for name in value if name in AppConfig.model_fields and name not in HOT_SECTIONS]
            if cold:
                raise ValueError(f"{cold[0]} cannot change on running replicas (only "
                                 f"{' and '.join(HOT_SECTIONS)} can): change args.{cold[0]} and redeploy")
        return value


def _first_error(error: ValidationError) -> str:
    first = error.errors()[0]
    where = "".join(f".{part}" for part in first["loc"])
    message = str(first["ctx"]["error"]) if first["type"] == "value_error" else first["msg"]  # no "Value error, "
    return f"user_config{where}: {message}"


def with_user_config(args: AppConfig, user_config: Mapping | None) -> AppConfig:
    """``args`` with ``user_config``'s overrides, validated as a whole; ``InvalidUserConfig`` names the field.

    Declarative: each user_config applies to args, not to the previous user_config, so a field removed from
    it goes back to args' value."""
    try:
        overrides = UserConfig.model_validate(user_config or {})
        merged = args.model_dump(mode="json", context={"reveal_secrets": True})
        for section in HOT_SECTIONS:
            merged[section] = {**merged[section], **getattr(overrides, section)}
        config = AppConfig.model_validate(merged)
    except ValidationError as error:
        raise InvalidUserConfig(_first_error(error)) from None
    _within_deployment_options(args.limits, config.limits, args.graceful_shutdown_timeout_s)
    return config


def _within_deployment_options(deployed: LimitsConfig, wanted: LimitsConfig, drain_s: float) -> None:
    """Serve's options of the deployment were derived from args' limits (deployments/app.py) and only change
    with a redeploy: a user_config must stay within them."""
    slots, deployed_slots = (limits.max_running_requests + limits.max_waiting_requests
                             for limits in (wanted, deployed))
    if slots > deployed_slots:
        raise InvalidUserConfig(
            f"user_config.limits: max_running_requests + max_waiting_requests ({slots}) above args' "
            f"({deployed_slots}) needs a redeploy: Serve's max_ongoing_requests is derived from args.limits")
    timeout = wanted.request_timeout_s
    if timeout is None or timeout > drain_s:
        raise InvalidUserConfig(
            f"user_config.limits.request_timeout_s ({timeout}) above the replicas' drain time ({drain_s} s, "
            "lifecycle.graceful_shutdown_timeout_s) needs a redeploy: a replica being removed would cut requests")
