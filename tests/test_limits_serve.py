"""API key, admission limits and deadlines on the real Serve app (small pair, three simulated nodes).

One app for the module, configured tight so every limit is reached deterministically: an API key, one
running request per pipeline, one waiting place, a KV cache budget, a 15 s request timeout. A "long" request
counts upwards (the greedy continuation of a number sequence never ends) with a max_new_tokens far beyond what
the small pair generates in 15 s on any machine, so it holds its slot until it is stopped.
"""

from __future__ import annotations

import json
import threading
import uuid

import grpc
import httpx
import pytest

from protos.hetspec.v1 import hetspec_pb2 as pb
from protos.hetspec.v1 import hetspec_pb2_grpc as pb_grpc
from serve_fixtures import (app_stats, assert_nothing_logged_as_an_error, serve_app, serve_log_sizes, small_app_args,
                            wait_for_stats)

pytestmark = [pytest.mark.real, pytest.mark.timeout(600)]

API_KEY = "sk-test-0123456789"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GRPC_AUTH = (("authorization", f"Bearer {API_KEY}"),)
REQUEST_TIMEOUT_S = 15  # long enough for the 429 test's four rejections on a slow, busy machine
RETRY_AFTER_S = 2
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"
LONG_TOKENS = 2048  # the small pair needs minutes for these: every long request is stopped by a limit
KV_CACHE_BYTES = 200_000_000  # a long request (~2080 tokens x ~83 KB in both models) fits, 400 tokens more do not


@pytest.fixture(scope="module")
def limited_app():
    args = small_app_args(
        pipeline={"placement_strategy": "STRICT_SPREAD"},
        auth={"api_keys": [API_KEY], "api_key_env": None},
        limits={"max_running_requests": 1, "max_waiting_requests": 1, "retry_after_s": RETRY_AFTER_S,
                "request_timeout_s": REQUEST_TIMEOUT_S, "max_new_tokens": LONG_TOKENS,
                "default_max_new_tokens": 4, "kv_cache_bytes": KV_CACHE_BYTES})
    with serve_app(args) as app:
        yield app


@pytest.fixture(scope="module")
def grpc_stub(limited_app):
    with grpc.insecure_channel(limited_app.grpc_target) as channel:
        yield pb_grpc.HetSpecStub(channel)


def _stats(app) -> dict:
    return app_stats(app, AUTH)


def _wait_for(app, condition, what: str, timeout_s: float = 30) -> dict:
    return wait_for_stats(app, condition, what, timeout_s, AUTH)


def _idle(stats: dict) -> bool:
    return (stats["target"]["active_sessions"] == stats["drafter"]["active_sessions"] == 0
            and stats["ongoing_requests"] == stats["running_slots"] == stats["waiting_requests"] == 0)


def _long_body(app, stream: bool) -> dict:
    return {"model": app.model_id, "prompt": COUNTING, "max_tokens": LONG_TOKENS, "temperature": 0,
            "stream": stream, "hetspec": {"ignore_eos": True}}


def _events(lines) -> list[dict | str]:
    return [line[len("data: "):] if line == "data: [DONE]" else json.loads(line[len("data: "):])
            for line in lines if line.startswith("data: ")]


def test_http_needs_the_key_on_every_route_but_health(limited_app):
    url = limited_app.http_url
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    body = {"model": limited_app.model_id, "prompt": "Hello", "max_tokens": 2}
    for method, path, headers in [("GET", "/v1/models", {}), ("GET", "/v1/stats", {}),
                                  ("POST", "/v1/completions", {}),
                                  ("POST", "/v1/completions", {"Authorization": "Bearer sk-wrong"}),
                                  ("POST", "/v1/completions", {"Authorization": API_KEY})]:  # no scheme
        response = httpx.request(method, f"{url}{path}", json=body, headers=headers, timeout=30)
        assert response.status_code == 401, (path, headers, response.text)
        assert response.headers["www-authenticate"] == "Bearer"
        error = response.json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert "sk-" not in error["message"]


def test_openai_client_with_the_key(limited_app):
    import openai

    client = openai.OpenAI(base_url=f"{limited_app.http_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    assert [model.id for model in client.models.list().data] == [limited_app.model_id]
    completion = client.completions.create(model=limited_app.model_id, prompt="Hello", max_tokens=2, temperature=0)
    assert completion.usage.completion_tokens == 2
    wrong = openai.OpenAI(base_url=f"{limited_app.http_url}/v1", api_key="sk-wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


@pytest.mark.parametrize("metadata,accepted", [
    ((), False), ((("authorization", "Bearer sk-wrong"),), False), ((("x-api-key", "sk-wrong"),), False),
    (GRPC_AUTH, True), ((("x-api-key", API_KEY),), True)],
    ids=["none", "wrong-bearer", "wrong-x-api-key", "bearer", "x-api-key"])
@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
def test_grpc_needs_the_key(grpc_stub, method, metadata, accepted):
    request = pb.GenerateRequest(prompt="Hello", max_new_tokens=2, temperature=0)
    call = getattr(grpc_stub, method)
    if accepted:
        result = call(request, metadata=metadata, timeout=60)
        messages = list(result) if method == "GenerateStream" else [result]
        assert messages[-1].usage.completion_tokens == 2
        return
    sizes, request_id = serve_log_sizes(), uuid.uuid4().hex
    with pytest.raises(grpc.RpcError) as raised:
        result = call(request, metadata=(*metadata, ("request_id", request_id)), timeout=60)
        list(result) if method == "GenerateStream" else result
    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "API key" in raised.value.details() and "sk-" not in raised.value.details()
    assert_nothing_logged_as_an_error(sizes, request_id)  # answered, not raised: no ERROR traceback


def test_full_server_answers_429_and_resource_exhausted(limited_app, grpc_stub):
    """One request runs, one waits, the rest are turned away; the runner is stopped by the request timeout."""
    import openai

    url, before = limited_app.http_url, _wait_for(limited_app, _idle, "idle")
    with httpx.Client(timeout=60) as client, \
            client.stream("POST", f"{url}/v1/completions", json=_long_body(limited_app, True),
                          headers=AUTH) as runner:
        assert runner.status_code == 200
        lines = runner.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))  # decoding: it holds the slot
        assert json.loads(first[len("data: "):])["choices"][0]["finish_reason"] is None

        # a gRPC request waits in line while the others are turned away; its client then gives up. (Its own
        # deadline is long: a short one raced the rejections below on a slow machine; the deadline in line is
        # tested where nothing runs between the two: test_request_timeout_http_408_and_grpc_deadline_exceeded.)
        waiter = grpc_stub.Generate.future(pb.GenerateRequest(prompt="Hi", max_new_tokens=2), metadata=GRPC_AUTH,
                                           timeout=60)
        during = _wait_for(limited_app, lambda stats: stats["waiting_requests"] == 1, "waiting")
        assert during["running_slots"] == 1 and during["target"]["active_sessions"] == 1

        small = {"model": limited_app.model_id, "prompt": "Hi", "max_tokens": 2}
        for stream in (False, True):
            busy = httpx.post(f"{url}/v1/completions", json={**small, "stream": stream}, headers=AUTH, timeout=30)
            assert busy.status_code == 429, busy.text
            assert busy.headers["retry-after"] == str(RETRY_AFTER_S)
            error = busy.json()["error"]
            assert error["type"] == "rate_limit_exceeded" and "max_waiting_requests" in error["message"]
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=30).chat.completions.create(
                model=limited_app.model_id, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        with pytest.raises(grpc.RpcError) as raised:
            grpc_stub.Generate(pb.GenerateRequest(prompt="Hi", max_new_tokens=2), metadata=GRPC_AUTH, timeout=30)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert raised.value.details().endswith(f"retry after {RETRY_AFTER_S} s")

        waiter.cancel()
        assert waiter.cancelled()
        left = _wait_for(limited_app, lambda stats: stats["waiting_requests"] == 0, "out of line")  # it left the line
        assert left["running_slots"] == 1  # and the runner runs on

        # the runner is stopped at the request timeout: an error event, then [DONE]; never a clean finish
        events = _events(lines)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["type"] == "timeout_error", events[-2]
    assert all(event["choices"][0]["finish_reason"] is None for event in events[:-2])
    after = _wait_for(limited_app, _idle, "idle")
    assert after["rejected_requests"] == before["rejected_requests"] + 4
    assert after["timed_out_requests"] == before["timed_out_requests"] + 1


def test_a_request_whose_kv_cache_cannot_fit_is_turned_away_before_any_work(limited_app, grpc_stub):
    before = _wait_for(limited_app, _idle, "idle")
    per_token = before["target"]["kv_bytes_per_token"] + before["drafter"]["kv_bytes_per_token"]
    assert (LONG_TOKENS + 20) * per_token < KV_CACHE_BYTES  # the other tests' long requests fit
    prompt = ", ".join(str(number) for number in range(1, 151))  # ~640 tokens: with LONG_TOKENS, past the budget
    body = {"model": limited_app.model_id, "prompt": prompt, "max_tokens": LONG_TOKENS}
    busy = httpx.post(f"{limited_app.http_url}/v1/completions", json=body, headers=AUTH, timeout=30)
    assert busy.status_code == 429, busy.text
    assert busy.headers["retry-after"] == str(RETRY_AFTER_S) and "kv_cache_bytes" in busy.json()["error"]["message"]
    with pytest.raises(grpc.RpcError) as raised:
        grpc_stub.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=LONG_TOKENS), metadata=GRPC_AUTH,
                           timeout=30)
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "kv_cache_bytes" in raised.value.details()
    after = _stats(limited_app)
    assert after["rejected_requests"] == before["rejected_requests"] + 2
    assert after["target"]["forward_passes"] == before["target"]["forward_passes"]  # no work was done
    assert _idle(after) and after["admitted_kv_bytes"] == 0
    # the same prompt with a budget that fits runs (the budget counts prompt + max_new_tokens)
    fits = httpx.post(f"{limited_app.http_url}/v1/completions", json={**body, "max_tokens": 2}, headers=AUTH,
                      timeout=120)
    assert fits.status_code == 200, fits.text
    assert _wait_for(limited_app, _idle, "idle")["target"]["kv_reserved_bytes"] == 0


def test_grpc_deadline_frees_the_sessions(limited_app, grpc_stub):
    before = _wait_for(limited_app, _idle, "idle")
    with pytest.raises(grpc.RpcError) as raised:
        grpc_stub.Generate(pb.GenerateRequest(prompt=COUNTING, max_new_tokens=LONG_TOKENS, temperature=0),
                           metadata=GRPC_AUTH, timeout=3)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "limits.request_timeout_s" not in raised.value.details()  # the client's deadline, not the server's limit
    after = _wait_for(limited_app, _idle, "idle", timeout_s=10)
    assert after["cancelled_requests"] == before["cancelled_requests"] + 1


def test_request_timeout_http_408_and_grpc_deadline_exceeded(limited_app, grpc_stub):
    """A runner past limits.request_timeout_s gets 408; a request waiting behind it all that time, too."""
    before = _wait_for(limited_app, _idle, "idle")
    outcome: dict = {}

    def run_http():
        outcome["http"] = httpx.post(f"{limited_app.http_url}/v1/completions", json=_long_body(limited_app, False),
                                     headers=AUTH, timeout=60)

    runner = threading.Thread(target=run_http)
    runner.start()
    _wait_for(limited_app, lambda stats: stats["running_slots"] == 1, "running")
    # a waiter whose client deadline passes in line leaves the line (the runner holds the slot for REQUEST_TIMEOUT_S)
    with pytest.raises(grpc.RpcError) as short:
        grpc_stub.Generate(pb.GenerateRequest(prompt="Hi", max_new_tokens=2), metadata=GRPC_AUTH, timeout=2)
    assert short.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    left = _wait_for(limited_app, lambda stats: stats["waiting_requests"] == 0, "out of line")
    assert left["running_slots"] == 1
    # long too: should it get the slot in the moment before its own deadline, it still cannot finish in time
    waiter = pb.GenerateRequest(prompt=COUNTING, max_new_tokens=LONG_TOKENS, temperature=0)
    with pytest.raises(grpc.RpcError) as raised:  # no client deadline short enough: the server's limit stops it
        list(grpc_stub.GenerateStream(waiter, metadata=GRPC_AUTH, timeout=60))
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "limits.request_timeout_s" in raised.value.details()
    runner.join(timeout=60)
    response = outcome["http"]
    assert response.status_code == 408, response.text
    assert response.json()["error"]["code"] == "request_timeout"
    after = _wait_for(limited_app, _idle, "idle")
    assert after["timed_out_requests"] == before["timed_out_requests"] + 2
