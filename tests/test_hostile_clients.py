"""Hostile and careless clients, in process (real tokenizers and models, no cluster): every input is bounded
before any work, a client's request id never keys a KV session, errors name nothing of the server.

The same defences on the live Serve app (proxy, router, replica pid): tests/test_hostile_serve.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import grpc
import pytest
from fastapi.testclient import TestClient
from starlette.requests import Request as StarletteRequest

from deployments.config import AppConfig
from deployments.serving.coordinator import Coordinator, GenerationRequest, InvalidRequest
from deployments.api.grpc_service import GrpcMethods
from deployments.api.openai_api import build_openai_app
from deployments.workers.api import ModelInfo
from hetspec import Engine, SamplingParams, SpeculationConfig
from hetspec.models import LanguageModel
from protos.hetspec.v1 import hetspec_pb2 as pb
from protos.hetspec.v1 import hetspec_pb2_grpc as pb_grpc
from serve_fixtures import in_process_coordinator, small_app_args

HUGE = "a" * (20 * 1024 * 1024)  # 20 MB
PROMPT = "The capital of France is"


@pytest.fixture
def tokenizer_calls(monkeypatch) -> list[str]:
    """Every tokenizing call of either model from now on (a spy: each still tokenizes)."""
    calls: list[str] = []
    for name in ("encode", "encode_prompt", "encode_chat"):
        real = getattr(LanguageModel, name)

        def spy(self, *args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(LanguageModel, name, spy)
    return calls


@pytest.fixture(scope="module")
def coordinator(gemma, smollm):
    """The replica's coordinator with the small pair's tokenizers; validation only, so no workers."""
    config = AppConfig.model_validate(small_app_args(limits={"max_request_new_tokens": 1024}))
    infos = [ModelInfo(model.name, model.tokenizer, model.vocab_size, model.eos_token_ids) for model in (gemma, smollm)]
    return Coordinator(config, None, None, *infos)


@pytest.fixture(scope="module")
def http(coordinator):
    with TestClient(build_openai_app(lambda: coordinator), raise_server_exceptions=False) as client:
        yield client


def _post(http, path: str, body: dict):
    # serialized here: the client's json= cannot encode a lone surrogate, json.dumps escapes it (\ud800)
    return http.post(path, content=json.dumps({"model": "gemma3-270m", **body}).encode(),
                     headers={"content-type": "application/json"})


class TestOversizedInput:
    def test_a_20_mb_prompt_over_http_is_413_before_it_is_read_or_tokenized(self, http, tokenizer_calls):
        response = _post(http, "/v1/completions", {"prompt": HUGE, "max_tokens": 2})
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
        assert tokenizer_calls == []

    def test_a_body_without_content_length_is_cut_off_at_the_limit(self, http, tokenizer_calls):
        def chunks():  # sent chunked: no Content-Length to refuse it by
            yield b'{"model": "gemma3-270m", "prompt": "'
            for _ in range(20):
                yield b"a" * 1024 * 1024
            yield b'"}'

        response = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert response.status_code == 413 and "max_request_bytes" in response.json()["error"]["message"]
        assert tokenizer_calls == []

    @pytest.mark.parametrize("route", ["/v1/completions", "/tokenize"])
    def test_a_prompt_within_the_body_limit_but_beyond_any_tokenization_is_400_untokenized(
            self, http, coordinator, tokenizer_calls, route):
        prompt = "a" * (coordinator.max_prompt_chars + 1)
        assert len(prompt) < coordinator.config.limits.max_request_bytes
        response = _post(http, route, {"prompt": prompt})
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
        assert "characters" in response.json()["error"]["message"] and tokenizer_calls == []

    def test_messages_are_bounded_in_characters_together(self, http, coordinator, tokenizer_calls):
        half = "a" * (coordinator.max_prompt_chars // 2 + 1)
        response = _post(http, "/v1/chat/completions", {"messages": [{"role": "user", "content": half}] * 2})
        assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
        assert tokenizer_calls == []

    @pytest.mark.parametrize("body,param", [
        ({"messages": [{"role": "user", "content": "hi"}] * 4097}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}] * 1025}]}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": ["x"] * 17}, "stop")])
    def test_counts_are_capped(self, http, tokenizer_calls, body, param):
        response = _post(http, "/v1/chat/completions", body)
        assert response.status_code == 400 and response.json()["error"]["param"].startswith(param)
        assert tokenizer_calls == []

    def test_the_limit_is_the_longest_token_times_max_prompt_tokens(self, coordinator, gemma):
        longest = max(len(piece) for piece in gemma.tokenizer.get_vocab())
        assert coordinator.max_prompt_chars == coordinator.config.limits.max_prompt_tokens * longest
        # at the bound a prompt is tokenized (and may fit): only what cannot fit is refused untokenized
        text = "The capital of France is Paris. " * 64
        assert len(gemma.encode_prompt(text)) * longest >= len(text)

    def test_a_20_mb_prompt_over_grpc_is_invalid_argument_untokenized(self, coordinator, tokenizer_calls):
        methods = GrpcMethods(coordinator)
        context = _Context()
        answer = asyncio.run(methods.Generate(pb.GenerateRequest(prompt=HUGE, max_new_tokens=2), context))
        assert answer == pb.GenerateResponse() and context.code == grpc.StatusCode.INVALID_ARGUMENT
        assert context.details.startswith("prompt:") and "characters" in context.details
        assert tokenizer_calls == []


class TestClientChosenWork:
    @pytest.mark.parametrize("body,param", [
        ({"n": 16, "max_tokens": 128}, "max_tokens"),  # 2048 tokens, above max_request_new_tokens (1024)
        ({"n": 16, "max_tokens": 64, "logprobs": True, "top_logprobs": 20}, "logprobs"),  # 21504 log-probabilities
        ({"hetspec": {"draft_tokens": 64}}, "draft_tokens")])
    def test_beyond_the_servers_caps_is_400(self, http, body, param, tokenizer_calls):
        response = _post(http, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **body})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param and tokenizer_calls == []

    def test_draft_tokens_up_to_the_servers_bound_are_taken(self, coordinator):
        bound = coordinator.config.speculation.max_draft_tokens
        request = GenerationRequest(prompt=PROMPT, draft_tokens=bound, params=SamplingParams(max_new_tokens=2))
        assert coordinator.prepare(request).speculation.draft_tokens == bound
        with pytest.raises(InvalidRequest, match="draft_tokens"):
            coordinator.prepare(request.model_copy(update={"draft_tokens": bound + 1}))


class TestNumbersAndText:
    def test_a_temperature_below_the_floor_is_greedy(self):
        assert SamplingParams(temperature=1e-40).greedy and SamplingParams(temperature=1e-5).greedy
        assert not SamplingParams(temperature=1e-4).greedy

    def test_sampling_refuses_a_distribution_that_is_not_finite(self):
        import torch

        from hetspec.sampling import logits_to_probs

        with pytest.raises(AssertionError, match="not finite"):
            logits_to_probs(torch.tensor([1.0, float("nan")]), 1.0)

    @pytest.mark.parametrize("body", [{"prompt": "\ud800", "add_special_tokens": False}, {"prompt": "\ud800"},
                                      {"messages": [{"role": "user", "content": "a\udfffb"}]}])
    def test_bad_unicode_is_400_on_tokenize(self, http, body):
        response = _post(http, "/tokenize", body)
        assert response.status_code == 400 and "surrogate" in response.json()["error"]["message"]

    @pytest.mark.parametrize("route,body", [
        ("/v1/completions", {"prompt": "\ud800"}), ("/v1/completions", {"prompt": "a", "stop": "\udc00"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]})])
    def test_bad_unicode_is_400_on_generation_routes(self, http, route, body):
        response = _post(http, route, body)
        assert response.status_code == 400 and "surrogate" in response.json()["error"]["message"]


class _Context:
    """What GrpcMethods uses of Serve's gRPC context."""

    def __init__(self, metadata=()):
        self.metadata, self.code, self.details = list(metadata), None, None

    def invocation_metadata(self):
        return self.metadata

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details


class _Pinging:
    def __init__(self):
        self.pings = 0

    async def ping(self):
        self.pings += 1
        await asyncio.sleep(0.05)


def test_a_health_flood_costs_one_ping_per_actor():
    coordinator = SimpleNamespace(target=_Pinging(), drafter=_Pinging(), _health=(0.0, None))
    coordinator._ping_both = lambda: Coordinator._ping_both(coordinator)

    async def flood():
        await asyncio.gather(*(Coordinator.check_health(coordinator) for _ in range(200)))

    asyncio.run(flood())
    assert coordinator.target.pings == coordinator.drafter.pings == 1


def test_two_runs_with_one_client_request_id_keep_their_own_sessions(gemma, smollm, exit_stack):
    """The request id is the client's; the sessions' key is the server's: same id, two sessions, right tokens."""
    coordinator, target_worker, _ = exit_stack.enter_context(in_process_coordinator(gemma, smollm))
    prompts = [PROMPT, "def fibonacci(n):\n"]
    prepared = [coordinator.prepare(GenerationRequest(prompt=prompt, params=SamplingParams(max_new_tokens=8)),
                                    "same-id") for prompt in prompts]
    assert prepared[0].session_id != prepared[1].session_id
    opened: list[str] = []
    real_open = target_worker.open
    target_worker.open = lambda session: (opened.append(session.request_id), real_open(session))[1]

    async def tokens(run) -> list[int]:
        return [token for event in [event async for event in coordinator.run(run, "test")] for token in event.token_ids]

    async def both():
        return await asyncio.gather(*(tokens(run) for run in prepared))

    results = asyncio.run(both())
    engine = Engine(gemma, smollm)
    for prompt, token_ids in zip(prompts, results):
        expected = engine.generate(prompt, SamplingParams(max_new_tokens=8), speculation=SpeculationConfig(algorithm="ar"))
        assert token_ids == expected.token_ids
    assert sorted(opened) == sorted(run.session_id for run in prepared) and "same-id" not in opened


def test_temperature_1e_40_decodes_the_greedy_text(gemma, smollm, exit_stack):
    coordinator, _, _ = exit_stack.enter_context(in_process_coordinator(gemma, smollm))
    request = GenerationRequest(prompt=PROMPT, params=SamplingParams(max_new_tokens=8, temperature=1e-40))

    async def run():
        return [event async for event in coordinator.run(coordinator.prepare(request), "test")]

    events = asyncio.run(run())
    expected = Engine(gemma, smollm).generate(PROMPT, SamplingParams(max_new_tokens=8),
                                              speculation=SpeculationConfig(algorithm="ar"))
    assert "".join(event.text for event in events) == expected.text
    assert [token for event in events for token in event.token_ids] == expected.token_ids


@pytest.mark.parametrize("keys,host,warned", [
    ([], "0.0.0.0", True), ([], "10.1.2.3", True), ([], "my-host", True), ([], "127.0.0.1", False),
    ([], "::1", False), ([], "localhost", False), (["sk-1"], "0.0.0.0", False), ([], None, False)])
def test_startup_warns_when_open_without_a_key_beyond_loopback(keys, host, warned):
    from deployments.auth import ApiKeys, unauthenticated_warning

    assert (unauthenticated_warning(ApiKeys(keys), host) is not None) is warned


def test_the_proxy_checks_keys_from_its_environment_and_leaves_serves_probes_open(monkeypatch):
    from fastapi import FastAPI

    from deployments.proxy import proxy_middlewares

    monkeypatch.delenv("HETSPEC_API_KEY", raising=False)
    monkeypatch.delenv("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE", raising=False)
    assert proxy_middlewares() == []  # no key: the replicas decide, as without the proxy check
    monkeypatch.setenv("HETSPEC_API_KEY", "sk-a, sk-b")
    app = FastAPI(middleware=proxy_middlewares())
    for path in ("/v1/completions", "/-/healthz", "/health"):
        app.post(path)(lambda: {"ok": True})
    client = TestClient(app)
    assert client.post("/v1/completions").status_code == 401
    assert client.post("/v1/completions", headers={"Authorization": "Bearer sk-b"}).status_code == 200
    assert client.post("/-/healthz").status_code == client.post("/health").status_code == 200


def test_the_proxy_refuses_a_body_over_its_message_bound_before_reading_it(monkeypatch):
    """With Serve's message bound in its environment (the one its gRPC side enforces), the HTTP proxy answers an
    oversized body 413 (the replica's error body, naming the setting) without reading it or routing it."""
    from fastapi import FastAPI

    from deployments.proxy import proxy_middlewares

    monkeypatch.delenv("HETSPEC_API_KEY", raising=False)
    monkeypatch.setenv("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE", "4096")
    routed = []
    app = FastAPI(middleware=proxy_middlewares())

    @app.post("/v1/completions")
    async def completions(request: StarletteRequest):
        routed.append(len(await request.body()))
        return {"ok": True}

    client = TestClient(app)
    refused = client.post("/v1/completions", content=b"x" * 5000)
    assert refused.status_code == 413 and refused.json()["error"]["code"] == "request_too_large"
    assert "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE" in refused.json()["error"]["message"] and routed == []
    assert client.post("/v1/completions", content=b"x" * 4000).status_code == 200 and routed == [4000]


class _Unreachable:
    async def ping(self):
        await asyncio.Event().wait()  # a node cut off: no answer, no error, until Ray declares the actor dead


def test_health_names_an_actor_that_does_not_answer_instead_of_waiting_for_it(monkeypatch):
    from deployments.errors import WorkerLost
    from deployments.serving import coordinator as coordinator_module

    monkeypatch.setattr(coordinator_module, "HEALTH_WAIT_S", 0.1)
    coordinator = SimpleNamespace(target=_Pinging(), drafter=_Unreachable(), _health=(0.0, None))
    coordinator._ping_both = lambda: Coordinator._ping_both(coordinator)
    with pytest.raises(WorkerLost, match="drafter actor did not answer a ping within 0.1 s"):  # /health's 503
        asyncio.run(Coordinator.check_health(coordinator))


def _grpc_proxy_calls(metadata_by_call: list[tuple]) -> tuple[list, list[str]]:
    """Serve's own gRPC proxy server class (Ray's ``gRPCGenericServer``) with our servicer function registered, as the
    proxy does, and a factory standing for Serve's routing handlers: (each call's status, the methods it routed)."""
    from unittest.mock import Mock

    from ray.serve._private.grpc_util import gRPCGenericServer

    from deployments.api.grpc_registration import add_HetSpecServicer_to_server

    routed: list[str] = []

    def routing_factory(service_method: str, streaming_type):
        async def unary(request, context):
            routed.append(service_method)
            return pb.GenerateResponse(text="routed").SerializeToString()

        async def streaming(request, context):
            routed.append(service_method)
            yield pb.GenerateResponse(text="routed").SerializeToString()

        return streaming if streaming_type.value == "unary_stream" else unary

    async def scenario() -> list:
        server = gRPCGenericServer(routing_factory)
        port = server.add_insecure_port("127.0.0.1:0")
        add_HetSpecServicer_to_server(Mock(), server)
        await server.start()
        statuses = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.HetSpecStub(channel)
                for streamed, metadata in metadata_by_call:
                    try:
                        if streamed:
                            [_ async for _ in stub.GenerateStream(pb.GenerateRequest(prompt="Hi"), metadata=metadata)]
                        else:
                            await stub.Generate(pb.GenerateRequest(prompt="Hi"), metadata=metadata)
                        statuses.append(grpc.StatusCode.OK)
                    except grpc.aio.AioRpcError as error:
                        statuses.append(error.code())
        finally:
            await server.stop(None)
        return statuses

    return asyncio.run(scenario()), routed


def test_the_grpc_proxy_refuses_keyless_calls_before_serves_routing_handler_runs(monkeypatch):
    monkeypatch.setenv("HETSPEC_API_KEY", "sk-a, sk-b")
    calls = [(False, ()), (True, ()), (False, (("authorization", "Bearer sk-wrong"),)),
             (False, (("authorization", "Bearer sk-b"),)), (True, (("x-api-key", "sk-a"),))]
    statuses, routed = _grpc_proxy_calls(calls)
    unauthenticated = grpc.StatusCode.UNAUTHENTICATED
    assert statuses == [unauthenticated, unauthenticated, unauthenticated, grpc.StatusCode.OK, grpc.StatusCode.OK]
    assert routed == ["/hetspec.v1.HetSpec/Generate", "/hetspec.v1.HetSpec/GenerateStream"]  # the keyed two only


def test_without_a_key_in_the_proxy_every_grpc_call_is_routed_for_the_replica_to_decide(monkeypatch):
    monkeypatch.delenv("HETSPEC_API_KEY", raising=False)
    statuses, routed = _grpc_proxy_calls([(False, ()), (True, ())])
    assert statuses == [grpc.StatusCode.OK, grpc.StatusCode.OK] and len(routed) == 2


def test_the_grpc_key_check_wraps_only_hetspecs_methods():
    from deployments.auth import ApiKeys
    from deployments.auth import guarded_handler_factory

    async def healthz(request, context):
        return b""

    factory = guarded_handler_factory(lambda service_method, streaming_type: healthz, ApiKeys(["sk"]),
                                      "hetspec.v1.HetSpec")
    assert factory(service_method="/ray.serve.RayServeAPIService/Healthz", streaming_type=None) is healthz
    assert factory(service_method="/hetspec.v1.HetSpec/Generate", streaming_type=None) is not healthz


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_drafter_session_swept_mid_request_goes_on_target_only(gemma, smollm, exit_stack, pipelined):
    """The drafter's sweeper frees a session idle past session_idle_timeout_s (a request drafting nothing for a
    while: load-adaptive or lookup steps); the next draft finds it gone and the request finishes target-only."""
    coordinator, target_worker, drafter_worker = exit_stack.enter_context(in_process_coordinator(gemma, smollm))
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    prepared = coordinator.prepare(GenerationRequest(prompt=PROMPT, params=params, algorithm="slem",
                                                     pipelined=pipelined))

    async def run():
        events = []
        async for event in coordinator.run(prepared, "test"):
            if not events:  # what the sweeper does to an idle session (Sessions.close_idle)
                assert await asyncio.to_thread(drafter_worker.sessions.close, prepared.session_id)
            events.append(event)
        await coordinator.admission.closes_done()
        return events

    events = asyncio.run(run())
    expected = Engine(gemma, smollm).generate(PROMPT, params, speculation=SpeculationConfig(algorithm="ar"))
    assert [token for event in events for token in event.token_ids] == expected.token_ids
    assert events[-1].stats.drafter_lost and events[-1].finish_reason == "length"
    assert len(target_worker.sessions) == len(drafter_worker.sessions) == 0


def test_a_close_that_comes_before_its_open_frees_the_session_at_the_open():
    from deployments.workers.sessions import Sessions, UnknownSession

    released: list[str] = []
    sessions = Sessions(max_sessions=4, idle_timeout_s=60.0, release=released.append)
    assert sessions.close("s-1") is False  # the client left while the open was on its way
    with pytest.raises(UnknownSession):
        sessions.open("s-1", "kv of s-1")
    assert released == ["kv of s-1"] and len(sessions) == 0
    sessions.open("s-1", "kv again")  # remembered once only
    assert len(sessions) == 1 and sessions.close("s-1") and released == ["kv of s-1", "kv again"]


def test_an_early_close_is_forgotten_after_the_idle_timeout():
    from deployments.workers.sessions import Sessions

    sessions = Sessions(max_sessions=4, idle_timeout_s=0.01, release=lambda session: None)
    sessions.close("s-1")
    time.sleep(0.02)
    sessions.close_idle()
    sessions.open("s-1", "kv")
    assert len(sessions) == 1
