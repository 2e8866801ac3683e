"""Property tests of every bad-input path that needs no cluster: request models, their conversions, the
coordinator's validation (real tokenizers), the HTTP error handlers, the Python API and the CLI.

The property: any input, JSON-ish values of wrong types, NaN, huge numbers, lone surrogates (invalid
UTF-8), control characters and unknown fields included, either validates into a well-formed request or
fails with a validation error naming a field; never another exception type. The live HTTP API is fuzzed
from its OpenAPI document by tests/test_fuzz_http.py.
"""

from __future__ import annotations

import asyncio
import io
import json
import math
import re

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from deployments.config import AppConfig
from deployments.serving.coordinator import Coordinator
from deployments.errors import InvalidRequest
from deployments.api.grpc_service import FIELD_NAMES as GRPC_FIELD_NAMES
from deployments.api.grpc_service import to_generation
from deployments.api.openai_api import _prepare, build_openai_app
from deployments.api.openai_protocol import ChatCompletionRequest, CompletionRequest, request_error
from deployments.api.openai_responses import ErrorResponse
from deployments.workers.api import ModelInfo
from hetspec import Engine, SamplingParams, SpeculationConfig, cli
from protos.hetspec.v1 import hetspec_pb2 as pb
from fuzz_strategies import GRPC_REQUESTS, JSONISH, TEXT
from serve_fixtures import small_app_args

FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

def bodies(base: dict, fields: list[str]) -> st.SearchStrategy[dict]:
    """``base`` with some known fields set to anything, some dropped, and maybe unknown fields added."""
    changes = st.dictionaries(st.sampled_from(fields), JSONISH, max_size=4)
    dropped = st.sets(st.sampled_from(sorted(base)), max_size=1)
    unknown = st.dictionaries(TEXT.filter(lambda name: name not in fields), JSONISH, max_size=1)
    return st.builds(lambda change, drop, extra: {**{k: v for k, v in base.items() if k not in drop}, **change,
                                                   **extra}, changes, dropped, unknown | st.just({}))


def _field_names(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


def validate_or_name_the_field(model: type[BaseModel], body: dict) -> BaseModel | None:
    """The model, well-formed, or None after a ValidationError whose every error names a field."""
    try:
        value = model.model_validate(body)
    except ValidationError as error:
        for problem in error.errors():
            named = problem["loc"] or [name for name in model.model_fields if name in problem["msg"]]
            assert named, problem  # a model-level error must at least name the fields in its message
        return None
    assert model.model_validate(value.model_dump()) == value  # well-formed: it survives a round trip
    return value


def _assert_finite(params: SamplingParams) -> None:
    assert math.isfinite(params.temperature) and math.isfinite(params.top_p)
    assert 1 <= params.max_new_tokens and (params.seed is None or 0 <= params.seed < 2**63) and params.top_k >= 0
    assert all(stop and stop.encode("utf-8") for stop in params.stop)  # valid Unicode (no lone surrogate)


SAMPLING_BASE = {"max_new_tokens": 8}
SPECULATION_BASE = {"algorithm": "slem"}


@FUZZ
@given(bodies(SAMPLING_BASE, _field_names(SamplingParams)))
@example({"temperature": float("nan")}).via("NaN")
@example({"stop": ["\ud800"]}).via("a stop string with a lone surrogate")
@example({"seed": 2**64}).via("a seed past uint64")
def test_sampling_params(body):
    params = validate_or_name_the_field(SamplingParams, body)
    if params is not None:
        _assert_finite(params)


@FUZZ
@given(bodies(SPECULATION_BASE, _field_names(SpeculationConfig)))
@example({"min_draft_tokens": 9, "max_draft_tokens": 3}).via("a model-level error names its fields")
def test_speculation_config(body):
    validate_or_name_the_field(SpeculationConfig, body)


# --- the OpenAI requests, through the coordinator's validation with the real tokenizers ---------------

@pytest.fixture(scope="module")
def coordinator(gemma, smollm):
    """The replica's coordinator with the small pair's real tokenizers; validation only, so no workers."""
    config = AppConfig.model_validate(small_app_args(limits={"max_prompt_tokens": 64, "max_new_tokens": 16,
                                                             "default_max_new_tokens": 8}))
    infos = [ModelInfo(model.name, model.tokenizer, model.vocab_size, model.eos_token_ids) for model in (gemma, smollm)]
    return Coordinator(config, None, None, *infos)


@pytest.fixture(scope="module")
def http(coordinator):
    """The real FastAPI app in process; only requests that fail validation are sent (no workers here)."""
    with TestClient(build_openai_app(lambda: coordinator), raise_server_exceptions=True) as client:
        yield client


def through_the_server(coordinator, http, request_model, route: str, body: dict) -> None:
    """Validate as the route does; a request that fails anywhere must come back 400 naming a field."""
    request = validate_or_name_the_field(request_model, body)
    if request is not None:
        try:
            runs = asyncio.run(_prepare(coordinator, request, "fuzz"))
        except InvalidRequest as error:
            param = request_error(error)["error"]["param"]  # in the client's own words
            assert param.split(".")[0] in request_model.model_fields, (param, error)
        else:
            assert len(runs) in (1, request.choices) and len({prepared.request_id for prepared in runs}) == len(runs)
            for prepared in runs:
                _assert_finite(prepared.params)
                assert 1 <= len(prepared.target_prompt_ids) <= 64
            return  # valid: generating needs the workers (the live fuzz test sends those)
    response = http.post(route, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = ErrorResponse.model_validate(response.json()).error
    assert error.type == "invalid_request_error"
    assert error.param == "body" or error.param.split(".")[0] in {*request_model.model_fields, *body}, error


COMPLETION_BASE = {"model": "gemma3-270m", "prompt": "hi", "max_tokens": 4}
CHAT_BASE = {"model": "gemma3-270m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
PLAUSIBLE_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool"]),
                                                     "content": TEXT | JSONISH}), max_size=3)


@FUZZ
@given(bodies(COMPLETION_BASE, _field_names(CompletionRequest)) | st.fixed_dictionaries(
    {"model": st.just("gemma3-270m"), "prompt": TEXT, "stop": st.lists(TEXT, max_size=20) | TEXT}))
@example({**COMPLETION_BASE, "prompt": "\ud800"}).via("a lone surrogate prompt (the tokenizer raised TypeError)")
@example({**COMPLETION_BASE, "prompt": "\x00\x01\x1b[2J"}).via("control characters are text")
@example({**COMPLETION_BASE, "\udcff": 1}).via("an unknown field whose name is not valid Unicode")
@example({**COMPLETION_BASE, "max_tokens": 2**70}).via("a huge number")
@example({**COMPLETION_BASE, "max_tokens": 17}).via("above the server's limit: was named max_new_tokens")
def test_completion_requests(coordinator, http, body):
    through_the_server(coordinator, http, CompletionRequest, "/v1/completions", body)


@FUZZ
@given(bodies(CHAT_BASE, _field_names(ChatCompletionRequest))
       | st.builds(lambda messages: {**CHAT_BASE, "messages": messages}, PLAUSIBLE_MESSAGES))
@example({**CHAT_BASE, "messages": [{"role": "user", "content": "a\udfffb"}]}).via("a lone surrogate message")
def test_chat_requests(coordinator, http, body):
    through_the_server(coordinator, http, ChatCompletionRequest, "/v1/chat/completions", body)


def test_a_body_that_is_not_utf8_gets_an_openai_error(http):
    """Starlette's own 400 (it cannot decode the body) had FastAPI's {"detail": ...} shape."""
    response = http.post("/v1/completions", content=b'{"model": "m", "prompt": "\xff"}',
                         headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert ErrorResponse.model_validate(response.json()).error.param == "body"
    missing = http.get("/v1/no-such-route")
    assert missing.status_code == 404 and ErrorResponse.model_validate(missing.json()).error.message == "Not Found"


# --- gRPC: the proto's types bound what arrives; the conversion validates the rest ---------------------
@FUZZ
@given(GRPC_REQUESTS)
def test_grpc_requests(coordinator, request_message):
    try:
        generation = to_generation(request_message, default_max_new_tokens=8)
        prepared = coordinator.prepare(generation, "fuzz")
    except InvalidRequest as error:
        proto_fields = {field.name for field in pb.GenerateRequest.DESCRIPTOR.fields}
        field = error.field
        for ours, theirs in GRPC_FIELD_NAMES.items():
            field = field.replace(ours, theirs)
        assert field.split(".")[0] in proto_fields, error
        return
    _assert_finite(prepared.params)


# --- the Python API ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(gemma, smollm):
    return Engine(gemma, smollm)


@pytest.mark.parametrize("params,field", [
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -1}, "top_k"),
    ({"stop": ["x"] * 17}, "stop"), ({"stop": ["\ud800"]}, "stop"), ({"colour": "red"}, "colour")])
def test_engine_rejects_bad_sampling_params_by_field(engine, params, field):
    """A dict used to reach make_algorithm and fail there with an AttributeError."""
    with pytest.raises(ValidationError) as raised:
        engine.generate("hi", params)
    assert raised.value.errors()[0]["loc"][0] == field


@pytest.mark.parametrize("prompt,messages,error,words", [
    ("a\ud800b", None, ValueError, "lone surrogate U+D800"),  # was the tokenizer's TypeError
    (None, [{"role": "user", "content": "\udcff"}], ValueError, "messages[0].content"),
    (7, None, TypeError, "prompt must be a str"),
    ("", None, ValueError, "prompt must not be empty"),
    ("hi", [{"role": "user", "content": "hi"}], ValueError, "exactly one of prompt or messages")])
def test_engine_rejects_bad_prompts_clearly(engine, gemma, prompt, messages, error, words, monkeypatch):
    monkeypatch.setattr(gemma.tokenizer, "chat_template", small_app_args()["chat_template"])  # a base model
    with pytest.raises(error, match=re.escape(words)):
        engine.generate(prompt, SamplingParams(max_new_tokens=2), messages=messages)


# --- the command line (in process: argparse and validation come before any model loads) --------------

@pytest.mark.parametrize("arguments,stdin,words", [
    (["--max-new-tokens", "0", "hi"], None, "--max-new-tokens"),
    (["--temperature", "nan", "hi"], None, "--temperature"),
    (["--top-k", "-1", "hi"], None, "--top-k"),
    (["--seed", "-1", "hi"], None, "--seed"),
    (["--stop", "", "hi"], None, "--stop"),
    (["--draft-tokens", "65", "hi"], None, "--draft-tokens"),
    (["a\udcffb"], None, "prompt: not valid UTF-8"),  # how Python hands over an invalid UTF-8 argument
    ([], b"\xff\xfeprompt", "prompt: not valid UTF-8"),  # was a UnicodeDecodeError traceback
    ([], b"", "the prompt is empty")])
def test_cli_rejects_bad_input_with_exit_2(arguments, stdin, words, monkeypatch, capsys):
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    assert cli.main(["generate", *arguments]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("arguments", [["--max-new-tokens", "many", "hi"], ["--dtype", "float8", "hi"],
                                       ["--no-such-option", "hi"]])
def test_cli_argument_types_are_argparse_errors(arguments, capsys):
    with pytest.raises(SystemExit) as raised:
        cli.main(["generate", *arguments])
    assert raised.value.code == 2 and arguments[0] in capsys.readouterr().err
