"""Hostile and careless clients against the live Serve app (small pair, three simulated nodes, an API key).

Duplicate client request ids over HTTP and gRPC, 20 MB prompts (refused by the replica's body limit and the gRPC
proxy's message bound) beside a running stream, a temperature of 1e-40. The in-process defences (tokenizer spies,
caps, Unicode): tests/test_hostile_clients.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import grpc
import httpx
import pytest

from hetspec import Engine, SamplingParams, SpeculationConfig
from protos.hetspec.v1 import hetspec_pb2 as pb
from protos.hetspec.v1 import hetspec_pb2_grpc as pb_grpc
from serve_fixtures import serve_app, small_app_args

pytestmark = [pytest.mark.real, pytest.mark.timeout(600)]

API_KEY = "sk-hostile-0123456789"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GRPC_AUTH = (("authorization", f"Bearer {API_KEY}"),)
NEW_TOKENS = 12
HUGE = "a" * (20 * 1024 * 1024)
PROMPTS = ["The capital of France is", "def fibonacci(n):\n"]


@pytest.fixture(scope="module")
def limited_app():  # the conftest's name for a served app with an API key (marks the tests `serve`)
    """The key in $HETSPEC_API_KEY of every Ray process: the replicas and the proxy (deployments/proxy.py)."""
    args = small_app_args(pipeline={"placement_strategy": "STRICT_SPREAD"}, auth={"api_key_env": "HETSPEC_API_KEY"})
    saved = os.environ.get("HETSPEC_API_KEY")
    os.environ["HETSPEC_API_KEY"] = API_KEY
    try:
        with serve_app(args, keep_api_key=True) as app:
            yield app
    finally:
        if saved is None:
            os.environ.pop("HETSPEC_API_KEY")
        else:
            os.environ["HETSPEC_API_KEY"] = saved


@pytest.fixture(scope="module")
def reference(gemma, smollm):
    engine, cache = Engine(gemma, smollm), {}

    def generate(prompt: str, max_new_tokens: int = NEW_TOKENS):
        if (prompt, max_new_tokens) not in cache:
            cache[prompt, max_new_tokens] = engine.generate(prompt, SamplingParams(max_new_tokens=max_new_tokens),
                                                            speculation=SpeculationConfig(algorithm="ar"))
        return cache[prompt, max_new_tokens]

    return generate


def _stats(app) -> dict:
    response = httpx.get(f"{app.http_url}/v1/stats", headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


async def _http_stream(app, prompt: str, request_id: str, max_tokens: int = NEW_TOKENS) -> tuple[str, list[int]]:
    body = {"model": app.model_id, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    ids, tokens = set(), []
    async with httpx.AsyncClient(timeout=300) as client, \
            client.stream("POST", f"{app.http_url}/v1/completions", json=body,
                          headers={**AUTH, "X-Request-ID": request_id}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: "):])
                assert "error" not in chunk, chunk
                ids.add(chunk["id"])
                tokens += chunk["hetspec"]["token_ids"]
    (response_id,) = ids
    return response_id, tokens


async def _grpc_stream(app, prompt: str, request_id: str) -> tuple[set[str], list[int]]:
    async with grpc.aio.insecure_channel(app.grpc_target) as channel:
        request = pb.GenerateRequest(prompt=prompt, temperature=0.0, max_new_tokens=NEW_TOKENS)
        ids, tokens = set(), []
        async for chunk in pb_grpc.HetSpecStub(channel).GenerateStream(
                request, metadata=(*GRPC_AUTH, ("request_id", request_id)), timeout=300):
            ids.add(chunk.request_id)
            tokens += chunk.token_ids
        return ids, tokens


def test_same_client_request_id_over_http_and_grpc_each_gets_its_own_tokens(limited_app, reference):
    async def all_four():
        return await asyncio.gather(*(_http_stream(limited_app, prompt, "dup-http") for prompt in PROMPTS),
                                    *(_grpc_stream(limited_app, prompt, "dup-grpc") for prompt in PROMPTS))

    results = asyncio.run(all_four())
    for prompt, (response_id, tokens) in zip(PROMPTS, results[:2]):
        assert tokens == reference(prompt).token_ids and response_id == "cmpl-dup-http"
    for prompt, (ids, tokens) in zip(PROMPTS, results[2:]):
        assert tokens == reference(prompt).token_ids and ids == {"dup-grpc"}
    after = _stats(limited_app)
    assert after["failed_requests"] == 0


def test_20_mb_prompts_are_refused_fast_while_a_stream_runs(limited_app, reference):
    """HTTP: 413 from the replica's body limit; gRPC: RESOURCE_EXHAUSTED from the proxy's message bound. Four of
    them beside a stream: /health stays quick, the replica is the same process, the stream is the library's."""
    url = limited_app.http_url
    body = json.dumps({"model": limited_app.model_id, "prompt": HUGE, "max_tokens": 2}).encode()
    before = _stats(limited_app)

    response = httpx.post(f"{url}/v1/completions", content=body, headers={**AUTH, "content-type": "application/json"},
                          timeout=60)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large", response.text
    with grpc.insecure_channel(limited_app.grpc_target) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.HetSpecStub(channel).Generate(pb.GenerateRequest(prompt=HUGE, max_new_tokens=2),
                                                   metadata=GRPC_AUTH, timeout=60)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in refused.value.details()  # gRPC's own message bound: the handler never ran

    async def huge_http() -> int:
        async with httpx.AsyncClient(timeout=60) as client:
            answer = await client.post(f"{url}/v1/completions", content=body,
                                       headers={**AUTH, "content-type": "application/json"})
            return answer.status_code

    async def huge_grpc() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(limited_app.grpc_target) as channel:
            try:
                await pb_grpc.HetSpecStub(channel).Generate(pb.GenerateRequest(prompt=HUGE, max_new_tokens=2),
                                                             metadata=GRPC_AUTH, timeout=60)
            except grpc.aio.AioRpcError as error:
                return error.code()
            return grpc.StatusCode.OK

    async def health_while_flooded() -> int:
        await asyncio.sleep(0.2)
        async with httpx.AsyncClient(timeout=60) as client:
            return (await client.get(f"{url}/health")).status_code

    async def together():
        return await asyncio.gather(_http_stream(limited_app, PROMPTS[0], "beside-the-flood", 32), huge_http(),
                                    huge_http(), huge_grpc(), huge_grpc(), health_while_flooded())

    (_, tokens), *refusals, health = asyncio.run(together())
    assert tokens == reference(PROMPTS[0], 32).token_ids
    assert refusals == [413, 413, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert health == 200
    after = _stats(limited_app)
    assert after["replica_pid"] == before["replica_pid"]  # the same process: never killed for failed health checks
    # no refused prompt reached admission: only the stream beside them was counted
    counts = {key: after[key] - before[key] for key in after if key.endswith("_requests") and key != "ongoing_requests"
              and key != "waiting_requests"}
    assert counts["rejected_requests"] == counts["failed_requests"] == 0, counts


def test_temperature_1e_40_over_http_is_the_greedy_text(limited_app, reference):
    body = {"model": limited_app.model_id, "prompt": PROMPTS[0], "max_tokens": NEW_TOKENS, "temperature": 1e-40}
    response = httpx.post(f"{limited_app.http_url}/v1/completions", json=body, headers=AUTH, timeout=300)
    assert response.status_code == 200, response.text
    completion = response.json()
    assert completion["choices"][0]["text"] == reference(PROMPTS[0]).text
    assert completion["hetspec"]["token_ids"] == reference(PROMPTS[0]).token_ids


def test_a_keyless_flood_does_not_starve_authenticated_requests(limited_app):
    """96 keyless clients POST for 20 s, refused in the proxy before routing (deployments/proxy.py): the
    authenticated requests sent meanwhile all succeed, none is a 429."""
    url, flood_s = limited_app.http_url, 20.0
    body = {"model": limited_app.model_id, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}

    async def keyless(client: httpx.AsyncClient, until: float) -> list[int]:
        codes = []
        while time.monotonic() < until:
            codes.append((await client.post(f"{url}/v1/completions", json=body)).status_code)
        return codes

    async def authenticated(client: httpx.AsyncClient, until: float) -> list[int]:
        codes = []
        while time.monotonic() < until:
            codes.append((await client.post(f"{url}/v1/completions", json=body, headers=AUTH)).status_code)
        return codes

    async def flood():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            until = time.monotonic() + flood_s
            return await asyncio.gather(authenticated(client, until), authenticated(client, until),
                                        *(keyless(client, until) for _ in range(96)))

    first, second, *keyless_codes = asyncio.run(flood())
    paying = first + second
    assert paying and set(paying) == {200}, paying
    assert sum(map(len, keyless_codes)) > 96 and {code for codes in keyless_codes for code in codes} == {401}
    stats = _stats(limited_app)
    assert stats["rejected_requests"] == 0  # no admission ever saw a keyless request


def test_a_keyless_grpc_flood_does_not_starve_authenticated_calls(limited_app):
    """64 keyless gRPC clients call for 15 s, refused in Serve's gRPC proxy before routing (deployments/auth.py
    ``guard_grpc_server``): every authenticated call meanwhile succeeds, none is RESOURCE_EXHAUSTED."""
    request, flood_s = pb.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=4, temperature=0), 15.0

    async def calls(stub, metadata: tuple, until: float) -> list[grpc.StatusCode]:
        codes = []
        while time.monotonic() < until:
            try:
                await stub.Generate(request, metadata=metadata, timeout=120)
                codes.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as error:
                codes.append(error.code())
        return codes

    async def flood():
        async with grpc.aio.insecure_channel(limited_app.grpc_target) as channel:
            stub, until = pb_grpc.HetSpecStub(channel), time.monotonic() + flood_s
            return await asyncio.gather(calls(stub, GRPC_AUTH, until), calls(stub, GRPC_AUTH, until),
                                        *(calls(stub, (), until) for _ in range(64)))

    first, second, *keyless_codes = asyncio.run(flood())
    paying = first + second
    assert paying and set(paying) == {grpc.StatusCode.OK}, paying
    assert sum(map(len, keyless_codes)) > 64
    assert {code for codes in keyless_codes for code in codes} == {grpc.StatusCode.UNAUTHENTICATED}
    assert _stats(limited_app)["rejected_requests"] == 0
