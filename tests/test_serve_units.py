"""The Serve app's parts that need no cluster: configs, stubs, sessions, request translation, speculation hits."""

from __future__ import annotations

import asyncio
import importlib
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import yaml
from pydantic import ValidationError

from deployments.app import deployment_options
from deployments.auth import ApiKeys
from deployments.config import AppConfig
from deployments.errors import (InvalidRequest, Overloaded, RequestTimeout, SessionLimitReached, Unauthenticated,
                                UnknownSession, WorkerLost)
from deployments.api.grpc_service import GrpcMethods, client_status, to_generation
from deployments.api.openai_protocol import ChatCompletionRequest, CompletionRequest
from deployments.workers.sessions import Sessions
from protos.generate import stale_stubs
from protos.hetspec.v1 import hetspec_pb2 as pb

REPO = Path(__file__).resolve().parent.parent
CONFIG_FILES = sorted((REPO / "deployments").glob("config*.yaml"))
SMALL_PAIR = {"target": {"model": "gemma3-270m"}, "drafter": {"model": "smollm2-135m"}}


def test_the_three_config_files_exist():
    assert [path.name for path in CONFIG_FILES] == ["config.gpu.yaml", "config.small.yaml", "config.yaml"]


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[path.name for path in CONFIG_FILES])
def test_config_file_is_a_valid_serve_config_of_the_app(path):
    from ray.serve.schema import ServeDeploySchema

    document = yaml.safe_load(path.read_text())
    ServeDeploySchema.model_validate(document)
    (application,) = document["applications"]
    assert application["import_path"] == "deployments.app:build_app"
    AppConfig.model_validate(application["args"])
    assert document["grpc_options"]["port"] == 9000
    assert "port" in document["http_options"]
    for servicer in document["grpc_options"]["grpc_servicer_functions"]:
        module, function = servicer.rsplit(".", 1)
        assert callable(getattr(importlib.import_module(module), function))


def test_gpu_config_gives_each_model_a_gpu():
    args = yaml.safe_load((REPO / "deployments" / "config.gpu.yaml").read_text())["applications"][0]["args"]
    config = AppConfig.model_validate(args)
    assert config.target_resources.num_gpus == 1 and config.drafter_resources.num_gpus == 1
    assert config.target.device == config.drafter.device == "cuda"


def test_app_config_rejects_unknown_fields_by_name():
    with pytest.raises(ValidationError, match="pipline"):
        AppConfig.model_validate({**SMALL_PAIR, "pipline": {}})
    with pytest.raises(ValidationError, match="max_session"):
        AppConfig.model_validate({**SMALL_PAIR, "pipeline": {"max_session": 3}})


def test_worker_env_vars_become_the_model_actors_runtime_env(monkeypatch):
    import ray

    from deployments.workers.actors import _actor_options

    monkeypatch.setattr(ray.util, "get_current_placement_group", lambda: None)  # asking would start Ray
    preload = {"LD_PRELOAD": "libjemalloc.so.2"}
    config = AppConfig.model_validate({**SMALL_PAIR, "pipeline": {"worker_env_vars": preload}})
    options = _actor_options(config.target_resources, config, 2)
    assert options["runtime_env"] == {"env_vars": preload}
    assert "runtime_env" not in _actor_options(config.target_resources, AppConfig.model_validate(SMALL_PAIR), 2)
    for bad in ("", "1ST", "LD PRELOAD", "A=B"):
        with pytest.raises(ValidationError, match="pipeline.worker_env_vars"):
            AppConfig.model_validate({**SMALL_PAIR, "pipeline": {"worker_env_vars": {bad: "x"}}})


def test_app_config_rejects_cuda_without_a_gpu():
    with pytest.raises(ValidationError, match="target_resources.num_gpus is 0"):
        AppConfig.model_validate({**SMALL_PAIR, "target": {"model": "gemma3-270m", "device": "cuda"}})


def test_every_app_config_field_is_described():
    from deployments import config as config_module

    for model in (config_module.AppConfig, config_module.PipelineConfig, config_module.ActorResources,
                  config_module.AutoscalingConfig, config_module.LimitsConfig, config_module.AuthConfig):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


def test_deployment_reserves_a_bundle_each_for_replica_drafter_and_target():
    config = AppConfig.model_validate({
        **SMALL_PAIR, "pipeline": {"placement_strategy": "STRICT_SPREAD"},
        "coordinator_resources": {"num_cpus": 0},
        "drafter_resources": {"num_cpus": 1, "num_gpus": 1, "resources": {"drafter_node": 1}},
        "target_resources": {"num_cpus": 2, "num_gpus": 1},
        "autoscaling": {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 2}})
    options = deployment_options(config)
    assert options["placement_group_bundles"] == [
        {"CPU": 0.01}, {"CPU": 1, "GPU": 1, "drafter_node": 1}, {"CPU": 2, "GPU": 1}]
    assert options["placement_group_strategy"] == "STRICT_SPREAD"
    assert options["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 2,
                                             "upscale_delay_s": 30.0, "downscale_delay_s": 600.0,
                                             "look_back_period_s": 30.0}


def test_autoscaling_delays_go_from_yaml_to_serve_and_back():
    from ray.serve.config import AutoscalingConfig as ServeAutoscalingConfig

    from deployments.config import AutoscalingConfig

    text = ("min_replicas: 1\nmax_replicas: 2\ntarget_ongoing_requests: 2\nupscale_delay_s: 2\n"
            "downscale_delay_s: 5\nlook_back_period_s: 12\n")
    scaling = AutoscalingConfig.model_validate(yaml.safe_load(text))
    assert AutoscalingConfig.model_validate(yaml.safe_load(yaml.safe_dump(scaling.model_dump()))) == scaling
    options = deployment_options(AppConfig.model_validate({**SMALL_PAIR, "autoscaling": scaling.model_dump()}))
    served = ServeAutoscalingConfig.model_validate(options["autoscaling_config"])  # Serve takes every field
    assert (served.upscale_delay_s, served.downscale_delay_s, served.look_back_period_s) == (2, 5, 12)
    for bad in ({"upscale_delay_s": -1}, {"downscale_delay_s": float("inf")}, {"look_back_period_s": 10},
                {"upscale_delay_s": 1, "surprise": 1}):
        with pytest.raises(ValidationError):
            AutoscalingConfig.model_validate(bad)


def test_a_replica_being_removed_drains_its_running_requests():
    config = AppConfig.model_validate({**SMALL_PAIR, "limits": {"request_timeout_s": 300},
                                       "lifecycle": {"health_check_period_s": 5}})
    options = deployment_options(config)
    assert options["graceful_shutdown_timeout_s"] == 310 and options["health_check_period_s"] == 5
    assert deployment_options(AppConfig.model_validate({**SMALL_PAIR, "limits": {"request_timeout_s": None}}))[
        "graceful_shutdown_timeout_s"] == 600
    with pytest.raises(ValidationError, match="graceful_shutdown_timeout_s"):
        AppConfig.model_validate({**SMALL_PAIR, "limits": {"request_timeout_s": 300},
                                  "lifecycle": {"graceful_shutdown_timeout_s": 20}})


def test_committed_grpc_stubs_are_current():
    assert stale_stubs() == [], "run: python -m protos.generate"


class TestSessions:
    def test_limit_close_and_unknown(self):
        released = []
        sessions = Sessions(max_sessions=2, idle_timeout_s=60, release=released.append)
        sessions.open("a", "session a")
        sessions.open("b", "session b")
        with pytest.raises(SessionLimitReached):
            sessions.open("c", "session c")
        assert sessions.close("a") and released == ["session a"]
        assert not sessions.close("a")
        with pytest.raises(UnknownSession):
            with sessions.use("a"):
                pass
        sessions.open("c", "session c")
        assert len(sessions) == 2

    def test_idle_sessions_are_freed_but_busy_ones_are_not(self):
        released = []
        sessions = Sessions(max_sessions=4, idle_timeout_s=0.05, release=released.append)
        sessions.open("idle", "idle session")
        sessions.open("busy", "busy session")
        with sessions.use("busy"):
            time.sleep(0.1)
            assert sessions.close_idle() == ["idle"]
        assert released == ["idle session"] and len(sessions) == 1

    def test_elsewhere_counts_sessions_used_lately_not_in_a_call_and_not_abandoned(self):
        sessions = Sessions(max_sessions=4, idle_timeout_s=60, release=lambda session: None)
        for request_id in ("abandoned", "between steps", "in a call", "in the same call"):
            sessions.open(request_id, request_id)
        with sessions.use("in a call"), sessions.use("in the same call"):  # a batched call holds both
            time.sleep(0.5)  # the abandoned session's last use is 0.5 s old now
            with sessions.use("between steps"):
                pass
            assert sessions.elsewhere(within_s=0.25) == 1
            assert sessions.elsewhere(within_s=60) == 2
        assert sessions.elsewhere(within_s=0.25) == 3  # the call is over: its requests are between calls

    def test_close_waits_for_the_call_in_progress(self):
        events = []
        sessions = Sessions(max_sessions=1, idle_timeout_s=60, release=lambda session: events.append("released"))
        sessions.open("r", "session")
        entered = threading.Event()

        def long_call():
            with sessions.use("r"):
                entered.set()
                time.sleep(0.2)
                events.append("call done")

        worker = threading.Thread(target=long_call)
        worker.start()
        entered.wait()
        sessions.close("r")
        worker.join()
        assert events == ["call done", "released"]


def _invalid_field(function) -> str:
    with pytest.raises(InvalidRequest) as raised:
        function()
    return raised.value.field


class TestOpenAIRequests:
    def test_defaults_follow_openai_except_max_tokens(self):
        generation = CompletionRequest(model="m", prompt="hi", stop="\n").to_generation(default_max_tokens=32)
        assert generation.prompt == "hi"
        assert generation.params.temperature == 1.0 and generation.params.max_new_tokens == 32
        assert generation.params.stop == ["\n"]
        assert generation.algorithm is None and generation.pipelined is None

    def test_extension_and_chat_translation(self):
        body = ChatCompletionRequest(
            model="m", max_completion_tokens=7, temperature=0, seed=3,
            messages=[{"role": "developer", "content": "Be brief."},
                      {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                                   {"type": "text", "text": "there"}]}],
            hetspec={"algorithm": "tli", "draft_tokens": 3, "pipelined": False, "ignore_eos": True})
        generation = body.to_generation(default_max_tokens=32)
        assert [message.model_dump() for message in generation.messages] == [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
        assert (generation.algorithm, generation.draft_tokens, generation.pipelined) == ("tli", 3, False)
        assert generation.params.max_new_tokens == 7 and generation.params.ignore_eos
        assert generation.params.seed == 3 and generation.params.temperature == 0.0

    def test_choices_logprobs_echo_and_stop_token_ids_translate(self):
        completion = CompletionRequest(model="m", prompt="hi", n=3, logprobs=2, echo=False, stop_token_ids=[7])
        params = completion.to_generation(default_max_tokens=8).params
        assert completion.choices == 3 and (params.logprobs, params.stop_token_ids) == (2, [7])
        chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], logprobs=True)
        assert chat.to_generation(8).params.logprobs == 0  # the tokens' own, no alternatives
        chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], logprobs=True,
                                     top_logprobs=4)
        assert chat.to_generation(8).params.logprobs == 4
        assert ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}]).to_generation(8) \
            .params.logprobs is None
        with pytest.raises(ValidationError, match="needs logprobs"):
            ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], top_logprobs=2)

    @pytest.mark.parametrize("change,field", [
        ({"n": 17}, "n"), ({"echo": True, "logprobs": 1}, "logprobs"), ({"logprobs": 21}, "logprobs"),
        ({"best_of": 2}, "best_of"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"presence_penalty": 1}, "presence_penalty"), ({"prompt": ["a", "b"]}, "prompt"),
        ({"colour": "red"}, "colour"), ({"hetspec": {"k": 3}}, "hetspec.k")])
    def test_unsupported_or_unknown_fields_are_named(self, change, field):
        with pytest.raises(ValidationError) as raised:
            CompletionRequest.model_validate({"model": "m", "prompt": "hi", **change})
        assert raised.value.errors()[0]["loc"][0] == field.split(".")[0]
        assert field.split(".")[-1] in str(raised.value)


class TestGrpcRequests:
    def test_unset_fields_take_the_defaults(self):
        generation = to_generation(pb.GenerateRequest(prompt="hi"), default_max_new_tokens=9)
        assert generation.params.max_new_tokens == 9 and generation.params.temperature == 0.0
        assert generation.algorithm is None and generation.draft_tokens is None and generation.pipelined is None

    @pytest.mark.parametrize("request_message,field", [
        (pb.GenerateRequest(prompt="hi", temperature=-1), "temperature"),
        (pb.GenerateRequest(prompt="hi", top_k=-2), "top_k"),
        (pb.GenerateRequest(prompt="hi", algorithm="fast"), "algorithm"),
        (pb.GenerateRequest(prompt="hi", stop=[""]), "stop")])
    def test_bad_fields_are_named(self, request_message, field):
        assert _invalid_field(lambda: to_generation(request_message, 9)).startswith(field)


class _Context:
    """The part of Serve's RayServegRPCContext the methods use."""

    def __init__(self, metadata=()):
        self.metadata, self.code, self.details = list(metadata), None, None

    def invocation_metadata(self):
        return self.metadata

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details


def _grpc_methods(run_error: Exception | None = None) -> GrpcMethods:
    """GrpcMethods on a stand-in coordinator: key "sk-1" required; a prepared request's run raises run_error."""
    async def run(prepared, interface):
        raise run_error
        yield  # an async generator, like Coordinator.run

    async def prepare_async(generation, request_id):
        return SimpleNamespace(request_id="r-1")

    return GrpcMethods(SimpleNamespace(
        api_keys=ApiKeys(["sk-1"]), config=SimpleNamespace(limits=SimpleNamespace(default_max_new_tokens=4)),
        prepare_async=prepare_async, run=run))


async def _answers(methods: GrpcMethods, method: str, context,
                   request=pb.GenerateRequest(prompt="hi")) -> list[pb.GenerateResponse]:
    if method == "Generate":
        return [await methods.Generate(request, context)]
    return [message async for message in methods.GenerateStream(request, context)]


AUTHORIZED = [("authorization", "Bearer sk-1")]


class TestGrpcClientErrors:
    """Client errors are answered with a status and one empty message, not raised: Serve would log a traceback."""

    @pytest.mark.parametrize("error,code,details", [
        (Unauthenticated("invalid API key"), grpc.StatusCode.UNAUTHENTICATED, "invalid API key"),
        (InvalidRequest("params.top_p", "must be <= 1"), grpc.StatusCode.INVALID_ARGUMENT, "top_p: must be <= 1"),
        (Overloaded("server busy", retry_after_s=1.5), grpc.StatusCode.RESOURCE_EXHAUSTED,
         "server busy; retry after 2 s"),
        (RequestTimeout("too long"), grpc.StatusCode.DEADLINE_EXCEEDED, "too long")])
    def test_each_client_error_has_its_status(self, error, code, details):
        assert client_status(error) == (code, details)

    def test_a_server_fault_is_not_a_client_error(self):
        with pytest.raises(TypeError):
            client_status(WorkerLost("target"))

    @pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
    @pytest.mark.parametrize("metadata,run_error,code,details", [
        ((), None, grpc.StatusCode.UNAUTHENTICATED, "missing API key: send metadata 'authorization: Bearer <key>' "
                                                    "(or 'x-api-key: <key>')"),
        (AUTHORIZED, Overloaded("server busy", 1), grpc.StatusCode.RESOURCE_EXHAUSTED, "server busy; retry after 1 s"),
        (AUTHORIZED, RequestTimeout("too long"), grpc.StatusCode.DEADLINE_EXCEEDED, "too long")],
        ids=["unauthenticated", "overloaded", "timeout"])
    def test_answered_with_the_status_and_one_empty_message(self, method, metadata, run_error, code, details):
        context = _Context(metadata)
        assert asyncio.run(_answers(_grpc_methods(run_error), method, context)) == [pb.GenerateResponse()]
        assert (context.code, context.details) == (code, details)

    @pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
    def test_bad_input_names_the_proto_field(self, method):
        context = _Context(AUTHORIZED)
        request = pb.GenerateRequest(prompt="hi", top_p=1.5)
        assert asyncio.run(_answers(_grpc_methods(), method, context, request)) == [pb.GenerateResponse()]
        assert context.code == grpc.StatusCode.INVALID_ARGUMENT and context.details.startswith("top_p:")

    @pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
    def test_without_a_grpc_context_the_typed_error_is_raised(self, method):
        with pytest.raises(Unauthenticated):  # no context, so no metadata: no key
            asyncio.run(_answers(_grpc_methods(), method, None))

    @pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
    def test_a_lost_worker_is_raised_with_unavailable_set(self, method):
        context = _Context(AUTHORIZED)
        with pytest.raises(WorkerLost):
            asyncio.run(_answers(_grpc_methods(WorkerLost("target")), method, context))
        assert context.code == grpc.StatusCode.UNAVAILABLE and "target actor is gone" in context.details

    @pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
    def test_any_other_failure_is_internal_naming_nothing_of_the_server(self, method):
        """Raised to Serve, the details would be the error's text: here a Ray traceback with a pid and actor id."""
        context = _Context(AUTHORIZED)
        leaky = RuntimeError("ray::TargetWorker.open() (pid=4242, ip=10.0.0.1, actor_id=abcdef0123456789)\nTraceback")
        assert asyncio.run(_answers(_grpc_methods(leaky), method, context)) == [pb.GenerateResponse()]
        assert (context.code, context.details) == (grpc.StatusCode.INTERNAL, "internal server error")


def test_grafana_dashboard_charts_every_metric_and_only_those():
    import json
    import re

    from deployments.runtime.metrics import CoordinatorMetrics, WorkerMetrics

    defined = {metric._name for owner in (CoordinatorMetrics(), WorkerMetrics()) for metric in vars(owner).values()}
    dashboard = json.loads((REPO / "cluster" / "grafana" / "hetspec.json").read_text())
    recorded = {rule["record"]: rule["expr"] for group in yaml.safe_load(
        (REPO / "cluster" / "prometheus" / "hetspec.rules.yaml").read_text())["groups"]
        for rule in group["rules"] if "record" in rule}
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    used = {name for expression in expressions for name in re.findall(r"hetspec:[\w:]+", expression)}
    assert used <= set(recorded), sorted(used - set(recorded))  # every recording rule a panel reads is shipped
    while used:  # a recording rule charts what it reads
        expressions += [recorded[name] for name in used]
        used = {name for name in re.findall(r"hetspec:[\w:]+", " ".join(recorded[name] for name in used))} - used
    charted = {re.sub(r"_(bucket|sum|count)$", "", name)
               for expression in expressions for name in re.findall(r"ray_(hetspec_\w+)", expression)}
    assert charted == defined


def test_app_config_rejects_more_running_requests_than_sessions():
    with pytest.raises(ValidationError, match="max_running_requests"):
        AppConfig.model_validate({**SMALL_PAIR, "pipeline": {"max_sessions": 4},
                                  "limits": {"max_running_requests": 8}})


class _NoActors:
    """A pipeline without actors: the server's reconfigure must never need them."""

    def __init__(self, target_info, drafter_info):
        self.target = self.drafter = None
        self.target_info, self.drafter_info = target_info, drafter_info
        self.kv_budgets: list[int | None] = []

    async def start(self) -> None:
        pass

    def set_kv_budget(self, kv_cache_bytes: int | None) -> list:  # the actors' calls are not awaited
        self.kv_budgets.append(kv_cache_bytes)
        return []


def test_reconfigure_applies_to_new_requests_only_and_refuses_what_needs_a_redeploy(gemma, smollm):
    """HetSpecServer.reconfigure (Serve's user_config) with the small pair's real tokenizers, no Ray."""
    from deployments.app import HetSpecServer
    from deployments.config import InvalidUserConfig
    from deployments.serving.request import GenerationRequest
    from deployments.workers.api import ModelInfo
    from hetspec import SamplingParams
    from serve_fixtures import small_app_args

    infos = [ModelInfo(model.name, model.tokenizer, model.vocab_size, model.eos_token_ids) for model in (gemma, smollm)]
    request = GenerationRequest(prompt="def fibonacci(n):", params=SamplingParams(max_new_tokens=8))

    async def scenario():
        server = object.__new__(HetSpecServer)  # its __init__ is async, as Serve runs it
        await server.__init__(small_app_args(), lambda config: _NoActors(*infos))
        coordinator = server.coordinator
        before = coordinator.prepare(request)
        running = coordinator.admit("http", before)
        server.reconfigure({"speculation": {"draft_tokens": 2}, "limits": {"max_running_requests": 1,
                                                                           "request_timeout_s": 30,
                                                                           "kv_cache_bytes": 10**9}})
        assert server.pipeline.kv_budgets == [10**9]  # the actors' KV pools follow the budget
        after = coordinator.prepare(request)
        assert (before.speculation.draft_tokens, after.speculation.draft_tokens) == (4, 2)
        assert after.deadline < before.deadline  # 30 s from now against the 300 s the first one started with
        assert running.holds_slot and coordinator.admission.max_running == 1
        waiting = coordinator.admit("http", after)  # the lowered cap holds the newcomer back
        assert not waiting.holds_slot
        running.release()
        await waiting.wait()
        with pytest.raises(InvalidUserConfig, match="change args.drafter and redeploy"):
            server.reconfigure({"drafter": {"model": "gemma3-270m"}})
        with pytest.raises(InvalidUserConfig, match="user_config.speculation.draft_tokens"):
            server.reconfigure({"speculation": {"draft_tokens": 99}})
        assert coordinator.config.speculation.draft_tokens == 2  # a refused user_config changes nothing
        server.reconfigure({})  # removed from the Serve config: args again
        assert coordinator.prepare(request).speculation.draft_tokens == 4
        assert coordinator.admission.max_running == 8

    asyncio.run(scenario())
