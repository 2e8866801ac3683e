"""Fuzzing the live app: schemathesis from the HTTP API's OpenAPI document, hypothesis over gRPC requests.

One served small pair for the module, with a tiny token budget (every request the fuzzers make valid
generates at most 4 tokens). Checks: no 5xx, every response conforms to the schema the document
declares for its status (the 200 bodies and the OpenAI error body of 400/401/422/429/503), every status
is declared; over gRPC a request succeeds or is INVALID_ARGUMENT naming a proto field. Then
benchmarks/soak.py runs briefly against it, and afterwards no KV session is left open and the replica
still answers.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance

from protos.hetspec.v1 import hetspec_pb2 as pb
from fuzz_strategies import GRPC_REQUESTS
from protos.hetspec.v1 import hetspec_pb2_grpc as pb_grpc
from serve_fixtures import serve_app, small_app_args

pytestmark = [pytest.mark.real, pytest.mark.timeout(600)]

LIVE = settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def served_app():
    """The small pair, where every valid request is cheap and a long prompt is refused early."""
    args = small_app_args(pipeline={"placement_strategy": "STRICT_SPREAD"},
                          limits={"max_prompt_tokens": 64, "max_new_tokens": 4, "default_max_new_tokens": 4})
    with serve_app(args) as app:
        yield app


@pytest.fixture(scope="module")
def openapi(served_app):
    return schemathesis.openapi.from_url(f"{served_app.http_url}/openapi.json", timeout=30)


# schemathesis's Python API (its pytest loader, ``from_fixture``, does not run under pytest 9: it sets
# ``node._nodeid``): one hypothesis run per route and mode; negative cases break the schema on purpose.
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_http_api_from_its_openapi_document(served_app, openapi, path, mode):
    @LIVE
    @given(case=openapi[path]["POST"].as_strategy(generation_mode=mode))
    def call_and_validate(case):
        if mode == GenerationMode.POSITIVE and isinstance(case.body, dict):
            case.body["model"] = served_app.model_id  # the schema cannot say which id is served
        case.call_and_validate(checks=[not_a_server_error, response_schema_conformance, status_code_conformance],
                               timeout=120)

    call_and_validate()


@LIVE
@given(request_message=GRPC_REQUESTS)
def test_grpc_requests_succeed_or_name_the_field(grpc_stub, request_message):
    try:
        response = grpc_stub.Generate(request_message, timeout=120)
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
        field = error.details().split(":")[0]
        assert field in {field.name for field in pb.GenerateRequest.DESCRIPTOR.fields}, error.details()
    else:
        assert response.finish_reason in ("stop", "length") and len(response.token_ids) <= 4


@pytest.fixture(scope="module")
def grpc_channel(served_app):
    with grpc.insecure_channel(served_app.grpc_target) as channel:
        yield channel


@pytest.fixture(scope="module")
def grpc_stub(grpc_channel):
    return pb_grpc.HetSpecStub(grpc_channel)


def test_grpc_request_that_is_not_utf8_is_invalid_argument(grpc_channel):
    """Bytes no client library would send: protobuf's string field 1 (prompt) holding 0xff."""
    generate = grpc_channel.unary_unary("/hetspec.v1.HetSpec/Generate", request_serializer=lambda raw: raw,
                                        response_deserializer=lambda raw: raw)
    with pytest.raises(grpc.RpcError) as raised:
        generate(b"\x0a\x02\xff\xfe", timeout=60)
    # it was UNKNOWN ("Unexpected DecodeError"): the generated parser raised inside grpc
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (raised.value.code(), raised.value.details())
    assert raised.value.details().startswith("request: is not a valid hetspec.v1.GenerateRequest")


def test_soak_machinery_two_clients_for_ten_seconds(served_app):
    """benchmarks/soak.py's every kind of traffic against this app: all outcomes expected, nothing leaked."""
    from benchmarks.soak import MIX, parse_args, soak

    args = parse_args(["--clients", "2", "--minutes", str(10 / 60), "--max-new-tokens", "4", "--cancel-tokens", "4",
                       "--settle", "30", "--timeout", "120"])
    result = asyncio.run(soak(args, served_app.http_url, served_app.grpc_target))
    summary = result["summary"]
    assert [outcome["kind"] for outcome in summary["warmup"]] == list(MIX)
    assert all(outcome["expected"] for outcome in summary["warmup"]), summary["warmup"]
    assert summary["unexpected_errors"] == 0, summary["unexpected_examples"]
    assert summary["requests"] > 0 and summary["served_ok"] > 0
    assert summary["sessions_leaked"] == 0 and summary["health_after"] == 200
    roles = {name.split(":")[0] for name, row in summary["memory"].items() if row["end_mib"]}
    assert {"DrafterWorker", "TargetWorker"} <= roles, summary["memory"]


def test_nothing_leaked_and_the_replica_answers(served_app):
    """Runs last: every fuzzed request's sessions are closed (closing is asynchronous: poll, bounded)."""
    deadline = time.monotonic() + 30
    while True:
        stats = httpx.get(f"{served_app.http_url}/v1/stats", timeout=30).json()
        open_sessions = stats["target"]["active_sessions"] + stats["drafter"]["active_sessions"]
        if open_sessions == 0 and stats["ongoing_requests"] == 0:
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)
    assert stats["failed_requests"] == 0, stats
    assert httpx.get(f"{served_app.http_url}/health", timeout=30).json() == {"status": "ok"}
