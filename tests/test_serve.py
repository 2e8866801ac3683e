"""The Serve deployment end to end: gRPC and OpenAI HTTP against the library's own output.

One app for the whole module (tests/serve_fixtures.py): target gemma3-270m, drafter smollm2-135m,
float32, STRICT_SPREAD over three simulated nodes. Greedy output must be token for token the target's
alone (``ar``, computed in this process with the library's Engine).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import grpc
import httpx
import pytest

from hetspec import Engine, SamplingParams, SpeculationConfig
from hetspec.engine import prompt_ids
from protos.hetspec.v1 import hetspec_pb2 as pb
from protos.hetspec.v1 import hetspec_pb2_grpc as pb_grpc
from serve_fixtures import NEW_TOKENS, served_app  # noqa: F401 -- the module's fixture
from test_logprobs import independent_log_probs
from serve_fixtures import assert_nothing_logged_as_an_error, serve_log_sizes

REPO = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]

PROMPTS = [
    "def fibonacci(n):\n",
    "The capital of France is",
    "東京は日本の首都で、",
    "SELECT name, COUNT(*) FROM users WHERE",
]
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def engine(gemma, smollm, served_app):  # noqa: F811
    """The library in this process, with the chat template the app gives the (base) target model."""
    own_template = gemma.tokenizer.chat_template
    gemma.tokenizer.chat_template = own_template or served_app.args["chat_template"]
    yield Engine(gemma, smollm)
    gemma.tokenizer.chat_template = own_template  # the session-wide model is shared with other modules


@pytest.fixture(scope="module")
def reference(engine):
    """The target alone, greedy: what every algorithm and both runtimes must output."""
    cache = {}

    def generate(prompt: str | None = None, messages=None, max_new_tokens: int = NEW_TOKENS, **params):
        key = (prompt, json.dumps(messages), max_new_tokens, json.dumps(params, sort_keys=True))
        if key not in cache:
            cache[key] = engine.generate(prompt, SamplingParams(max_new_tokens=max_new_tokens, **params),
                                         messages=messages, speculation=SpeculationConfig(algorithm="ar"))
        return cache[key]

    return generate


@pytest.fixture(scope="module")
def grpc_stub(served_app):  # noqa: F811
    with grpc.insecure_channel(served_app.grpc_target) as channel:
        yield pb_grpc.HetSpecStub(channel)


@pytest.fixture(scope="module")
def openai_client(served_app):  # noqa: F811
    import openai

    return openai.OpenAI(base_url=f"{served_app.http_url}/v1", api_key="unused", max_retries=0, timeout=300)


def _stats(served_app) -> dict:  # noqa: F811
    return httpx.get(f"{served_app.http_url}/v1/stats", timeout=30).json()


def _wait_until_idle(served_app, timeout_s: float = 60) -> dict:  # noqa: F811
    """Closing a session is asynchronous (fire and forget): poll the stats route, bounded."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = _stats(served_app)
        if stats["target"]["active_sessions"] == 0 and stats["drafter"]["active_sessions"] == 0:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"sessions still open after {timeout_s} s: {stats}")
        time.sleep(0.2)


def test_grpc_generate_matches_library(grpc_stub, reference):
    expected = reference(PROMPTS[0])
    response = grpc_stub.Generate(pb.GenerateRequest(prompt=PROMPTS[0], temperature=0.0), timeout=300)
    assert list(response.token_ids) == expected.token_ids
    assert response.text == expected.text
    assert response.finish_reason == expected.finish_reason
    assert response.usage.completion_tokens == len(expected.token_ids)
    assert response.usage.prompt_tokens == expected.stats.prompt_tokens
    assert response.stats.algorithm == "slem"  # auto, greedy, different tokenizers
    assert response.stats.target_forwards <= len(expected.token_ids)
    assert response.stats.drafted_tokens >= response.stats.accepted_tokens
    # what batching and the draft length policy gave it: itself in every pass at least, and slem drafted
    assert response.stats.mean_batch_size >= 1.0
    assert response.stats.mean_draft_length > 0.0


def test_grpc_stream_matches_library(grpc_stub, reference):
    expected = reference(PROMPTS[2])
    request = pb.GenerateRequest(prompt=PROMPTS[2], algorithm="tli", draft_tokens=3)
    messages = list(grpc_stub.GenerateStream(request, timeout=300))
    assert [token for message in messages for token in message.token_ids] == expected.token_ids
    assert "".join(message.text for message in messages) == expected.text
    assert [message.finish_reason for message in messages[:-1]] == [""] * (len(messages) - 1)
    assert messages[-1].finish_reason == expected.finish_reason
    assert messages[-1].stats.algorithm == "tli"
    assert messages[-1].usage.completion_tokens == len(expected.token_ids)


@pytest.mark.parametrize("pipelined", [False, True])
def test_grpc_sampling_tli_matches_library(grpc_stub, engine, pipelined):
    """TLI at temperature 0.8: draft_probs travel by object reference; non-pipelined is the library's sample."""
    params = SamplingParams(max_new_tokens=12, temperature=0.8, seed=7)
    expected = engine.generate(PROMPTS[1], params, speculation=SpeculationConfig(algorithm="tli", draft_tokens=3))
    request = pb.GenerateRequest(prompt=PROMPTS[1], max_new_tokens=12, temperature=0.8, seed=7, algorithm="tli",
                                 draft_tokens=3, pipelined=pipelined)
    response = grpc_stub.Generate(request, timeout=300)
    assert response.stats.algorithm == "tli" and response.stats.drafted_tokens > 0
    assert len(response.token_ids) == len(expected.token_ids)
    if not pipelined:  # pipelined drafts differ, so the sample is another one of the same distribution
        assert list(response.token_ids) == expected.token_ids


def test_unseeded_sampling_is_random_and_the_reported_seed_reproduces_it(grpc_stub, openai_client, served_app):  # noqa: F811
    """An unseeded request draws a seed (reported); sent with that seed, a request reproduces an exact-matching
    sample (SLEM: what auto runs for a seed) at any load, a TLI sample at the same drafts (here: idle)."""
    def http(seed=None, algorithm=None):
        completion = openai_client.completions.create(
            model=served_app.model_id, prompt=PROMPTS[1], max_tokens=6, temperature=1.0, seed=seed,
            extra_body={"hetspec": {"algorithm": algorithm}} if algorithm else None)
        return completion.model_extra["hetspec"]["token_ids"], completion.model_extra["hetspec"]["stats"]["seed"]

    (first_ids, first_seed), (_, second_seed) = http(algorithm="slem"), http(algorithm="slem")
    assert first_seed != second_seed
    assert http(first_seed) == (first_ids, first_seed)  # auto with a seed: SLEM
    request = pb.GenerateRequest(prompt=PROMPTS[1], max_new_tokens=6, temperature=1.0)
    unseeded = grpc_stub.Generate(request, timeout=300)
    assert unseeded.stats.algorithm == "tli"  # auto without a seed: free to use rejection sampling
    assert unseeded.stats.seed not in (0, first_seed)
    request.seed, request.algorithm = unseeded.stats.seed, "tli"
    assert list(grpc_stub.Generate(request, timeout=300).token_ids) == list(unseeded.token_ids)


def test_http_completion_openai_client(openai_client, served_app, reference):  # noqa: F811
    expected = reference(PROMPTS[3])
    completion = openai_client.completions.create(
        model=served_app.model_id, prompt=PROMPTS[3], max_tokens=NEW_TOKENS, temperature=0,
        extra_body={"hetspec": {"algorithm": "slrs", "draft_tokens": 2}})
    assert completion.choices[0].text == expected.text
    assert completion.choices[0].finish_reason == expected.finish_reason
    assert completion.usage.completion_tokens == len(expected.token_ids)
    extension = completion.model_extra["hetspec"]
    assert extension["token_ids"] == expected.token_ids
    assert extension["stats"]["algorithm"] == "slrs"


def test_http_chat_openai_client(openai_client, served_app, reference):  # noqa: F811
    expected = reference(messages=CHAT)
    chat = openai_client.chat.completions.create(model=served_app.model_id, messages=CHAT, temperature=0,
                                                 max_tokens=NEW_TOKENS)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == expected.text
    assert chat.model_extra["hetspec"]["token_ids"] == expected.token_ids
    assert chat.usage.prompt_tokens == expected.stats.prompt_tokens


def test_http_chat_stream_openai_client(openai_client, served_app, reference):  # noqa: F811
    expected = reference(messages=CHAT)
    stream = openai_client.chat.completions.create(model=served_app.model_id, messages=CHAT, temperature=0,
                                                   max_tokens=NEW_TOKENS, stream=True,
                                                   stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == expected.text
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == expected.finish_reason
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_stop_strings_in_multi_token_steps_match_library(grpc_stub, openai_client, served_app, reference):  # noqa: F811
    """Stop strings from the target's own output, SLEM committing several tokens a step: gRPC and HTTP, whole
    and streamed, return the library's text and ids for the target alone (one token a step). The longer stop
    starts first but completes after the shorter one, so the shorter one must win (issue 12)."""
    whole = reference(PROMPTS[1]).text
    middle = len(whole) // 2
    stops = [whole[middle:middle + 3], whole[middle - 2:middle + 4]]
    expected = reference(PROMPTS[1], stop=stops)
    assert expected.finish_reason == "stop" and whole.startswith(expected.text) and len(expected.text) <= middle
    request = pb.GenerateRequest(prompt=PROMPTS[1], algorithm="slem", draft_tokens=6, stop=stops)
    response = grpc_stub.Generate(request, timeout=300)
    assert (response.text, list(response.token_ids), response.finish_reason) == \
        (expected.text, expected.token_ids, "stop")
    assert response.stats.accepted_tokens > 0 and response.usage.completion_tokens == len(expected.token_ids)
    messages = list(grpc_stub.GenerateStream(request, timeout=300))
    assert "".join(message.text for message in messages) == expected.text
    assert [token for message in messages for token in message.token_ids] == expected.token_ids
    body = dict(model=served_app.model_id, prompt=PROMPTS[1], max_tokens=NEW_TOKENS, temperature=0, stop=stops,
                extra_body={"hetspec": {"algorithm": "slem", "draft_tokens": 6}})
    completion = openai_client.completions.create(**body)
    assert (completion.choices[0].text, completion.model_extra["hetspec"]["token_ids"]) == \
        (expected.text, expected.token_ids)
    assert completion.choices[0].finish_reason == "stop"
    chunks = list(openai_client.completions.create(**body, stream=True))
    assert "".join(chunk.choices[0].text for chunk in chunks) == expected.text
    assert [token for chunk in chunks for token in chunk.model_extra["hetspec"]["token_ids"]] == expected.token_ids


def test_eight_concurrent_streams_batched_over_grpc_and_http_equal_the_library(served_app, reference):  # noqa: F811
    """8 streams at once, half HTTP (pipelined and not), half gRPC (other algorithms, draft lengths and budgets),
    plus a 9th stream cancelled mid-way: every finished one is the library's, the actors' passes were shared
    (far fewer target passes than the requests' own), and the cancelled one's KV rows come back."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{served_app.http_url}/v1", api_key="unused", max_retries=0, timeout=600)
    before = _wait_until_idle(served_app)

    async def http_stream(prompt: str, pipelined: bool) -> tuple[list[int], str, dict]:
        token_ids, pieces, stats = [], [], {}
        chunks = await client.completions.create(model=served_app.model_id, prompt=prompt, max_tokens=NEW_TOKENS,
                                                 temperature=0, stream=True,
                                                 extra_body={"hetspec": {"pipelined": pipelined}})
        async for chunk in chunks:
            pieces.append(chunk.choices[0].text)
            token_ids.extend(chunk.model_extra["hetspec"]["token_ids"])
            stats = chunk.model_extra["hetspec"].get("stats", stats)
        return token_ids, "".join(pieces), stats

    async def grpc_stream(prompt: str, algorithm: str, draft_tokens: int, new_tokens: int):
        async with grpc.aio.insecure_channel(served_app.grpc_target) as channel:
            request = pb.GenerateRequest(prompt=prompt, temperature=0.0, algorithm=algorithm,
                                         draft_tokens=draft_tokens, max_new_tokens=new_tokens)
            token_ids, pieces, stats = [], [], None
            async for chunk in pb_grpc.HetSpecStub(channel).GenerateStream(request, timeout=600):
                token_ids.extend(chunk.token_ids)
                pieces.append(chunk.text)
                stats = chunk.stats if chunk.HasField("stats") else stats
            return token_ids, "".join(pieces), {"target_forwards": stats.target_forwards}

    async def cancelled_stream() -> None:  # gRPC cancels: tests/test_serve_faults.py
        body = {"model": served_app.model_id, "prompt": PROMPTS[0], "max_tokens": 256, "temperature": 0,
                "stream": True, "hetspec": {"ignore_eos": True}}
        async with httpx.AsyncClient(timeout=600) as http, \
                http.stream("POST", f"{served_app.http_url}/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break  # its first text: it is decoding in the batch; leaving disconnects

    grpc_jobs = [(PROMPTS[0], "tli", 3, NEW_TOKENS), (PROMPTS[1], "ar", 1, 10), (PROMPTS[2], "slrs", 6, NEW_TOKENS),
                 (PROMPTS[3], "slem", 2, 12)]
    http_jobs = [(prompt, pipelined) for prompt, pipelined in zip(PROMPTS, (False, True, True, False))]

    async def all_streams():
        return await asyncio.gather(*(http_stream(*job) for job in http_jobs),
                                    *(grpc_stream(*job) for job in grpc_jobs), cancelled_stream())

    results = asyncio.run(all_streams())
    for (prompt, pipelined), (token_ids, text, stats) in zip(http_jobs, results):
        expected = reference(prompt)
        assert (token_ids, text) == (expected.token_ids, expected.text), (prompt, pipelined)
        assert stats["pipelined"] is pipelined
        if not pipelined:
            assert stats["pipeline_hits"] == stats["pipeline_misses"] == 0
    for (prompt, algorithm, _, new_tokens), (token_ids, text, _) in zip(grpc_jobs, results[len(http_jobs):]):
        expected = reference(prompt, max_new_tokens=new_tokens)
        assert (token_ids, text) == (expected.token_ids, expected.text), (prompt, algorithm)
    after = _wait_until_idle(served_app)
    assert after["ongoing_requests"] == 0 and after["cancelled_requests"] == before["cancelled_requests"] + 1
    assert after["target"]["kv_reserved_bytes"] == after["drafter"]["kv_reserved_bytes"] == 0
    assert after["admitted_kv_bytes"] == 0
    # each request alone: a prefill pass and its verification passes; batched, the actors shared them
    own_passes = sum(1 + stats["target_forwards"] for _, _, stats in results[:-1])
    passes = after["target"]["forward_passes"] - before["target"]["forward_passes"]
    rows = after["target"]["pass_rows"] - before["target"]["pass_rows"]
    print(f"target passes {passes} for {own_passes} requests' own; {rows / passes:.2f} requests per pass")
    assert passes < 0.75 * own_passes and rows > passes


def test_sessions_freed_after_client_disconnects(served_app):  # noqa: F811
    before = _wait_until_idle(served_app)
    body = {"model": served_app.model_id, "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0,
            "stream": True, "hetspec": {"ignore_eos": True}}
    with httpx.Client(timeout=300) as client:
        with client.stream("POST", f"{served_app.http_url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[len("data: "):])["choices"][0]["finish_reason"] is None
            during = _stats(served_app)
            assert during["target"]["active_sessions"] == 1 and during["drafter"]["active_sessions"] == 1
        # leaving the block closes the connection mid-stream (200 tokens take far longer than we stay)
    after = _wait_until_idle(served_app)
    assert after["cancelled_requests"] == before["cancelled_requests"] + 1
    assert after["target"]["kv_reserved_bytes"] == after["drafter"]["kv_reserved_bytes"] == 0


def test_placement_strict_spread_puts_each_on_its_own_node(served_app):  # noqa: F811
    from ray import serve

    nodes = serve.get_deployment_handle("HetSpecServer", app_name="hetspec").actor_nodes.remote().result()
    assert None not in nodes.values()
    assert len(set(nodes.values())) == 3, nodes  # coordinator, drafter and target: three different nodes


def test_worker_env_vars_are_the_model_actors_environment(served_app):  # noqa: F811
    """pipeline.worker_env_vars (how a deployment preloads an allocator, docs/deploy.md) are set in the drafter's
    and the target's processes."""
    import os

    import ray
    from ray import serve

    expected = served_app.args["pipeline"]["worker_env_vars"]
    handle = serve.get_deployment_handle("HetSpecServer", app_name="hetspec")
    for role, actor in handle.actor_handles.remote().result(timeout_s=60).items():
        seen = ray.get(actor.__ray_call__.remote(lambda worker: {name: os.environ.get(name) for name in expected}))
        assert seen == expected, role


def test_model_actors_trim_their_heap(served_app):  # noqa: F811
    """pipeline.heap_trim_interval_s: the drafter and the target call malloc_trim on their own (glibc), and say so
    in /v1/stats."""
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc_trim is glibc's")
    deadline = time.monotonic() + 30
    while True:
        stats = httpx.get(f"{served_app.http_url}/v1/stats", timeout=30).json()
        trims = {role: stats[role]["heap_trims"] for role in ("drafter", "target")}
        if min(trims.values()) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert min(trims.values()) >= 2, trims
    assert all(stats[role]["heap_trim_seconds"] >= 0 for role in ("drafter", "target"))


def test_client_sends_the_application_metadata(served_app):  # noqa: F811
    import subprocess
    import sys

    def client(application: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "deployments.tools.client", "grpc", "--target", served_app.grpc_target,
                               "--prompt", PROMPTS[1], "--max-new-tokens", "3", "--application", application],
                              capture_output=True, text=True, timeout=300, cwd=REPO)

    answered = client("hetspec")
    assert answered.returncode == 0 and "tokens_per_second" in answered.stdout, answered.stderr
    # (with one application Serve routes every gRPC call to it whatever the metadata says: no negative case here)


def test_latency_and_load_metrics_reach_rays_prometheus_endpoint(openai_client, served_app):  # noqa: F811
    """What a user scrapes: each node's metrics export port (the replica runs on one of the three)."""
    import re

    openai_client.completions.create(model=served_app.model_id, prompt=PROMPTS[1], max_tokens=4, temperature=0)
    wanted = ["ray_hetspec_time_to_first_token_seconds_count", "ray_hetspec_time_per_output_token_seconds_count",
              "ray_hetspec_request_latency_seconds_count", "ray_hetspec_queue_time_seconds_count",
              "ray_hetspec_running_requests", "ray_hetspec_waiting_requests", "ray_hetspec_kv_reserved_bytes",
              "ray_hetspec_forward_passes_total"]

    def scraped() -> dict[str, float]:
        values: dict[str, float] = {}
        for url in served_app.metrics_urls:
            for line in httpx.get(url, timeout=30).text.splitlines():
                found = re.match(r"^(ray_hetspec_\w+)(?:\{[^}]*\})? ([0-9.eE+-]+)$", line)
                if found:
                    values[found[1]] = values.get(found[1], 0.0) + float(found[2])
        return values

    deadline = time.monotonic() + 90  # Ray's agents export every few seconds
    while not set(wanted) <= set(values := scraped()) and time.monotonic() < deadline:
        time.sleep(2)
    assert set(wanted) <= set(values), sorted(set(wanted) - set(values))
    assert values["ray_hetspec_time_to_first_token_seconds_count"] >= 1
    assert values["ray_hetspec_time_per_output_token_seconds_sum"] > 0
    assert values["ray_hetspec_request_latency_seconds_sum"] > 0 and values["ray_hetspec_queue_time_seconds_sum"] >= 0
    assert values["ray_hetspec_forward_passes_total"] >= 1


def test_logprobs_over_http_and_grpc_are_the_targets_own(openai_client, served_app, engine, gemma, reference,  # noqa: F811
                                                         grpc_stub):
    expected = reference(PROMPTS[0])
    own = independent_log_probs(gemma, gemma.encode_prompt(PROMPTS[0]), expected.token_ids)
    completion = openai_client.completions.create(model=served_app.model_id, prompt=PROMPTS[0], temperature=0,
                                                  max_tokens=NEW_TOKENS, logprobs=2,
                                                  extra_body={"hetspec": {"algorithm": "slem"}})
    logprobs = completion.choices[0].logprobs
    assert logprobs.token_logprobs == pytest.approx(
        [float(own[index, token_id]) for index, token_id in enumerate(expected.token_ids)], abs=2e-3)
    assert "".join(logprobs.tokens) == completion.choices[0].text  # ASCII code: no token splits a character
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:index])) for index in range(len(logprobs.tokens))]
    for token, top in zip(logprobs.tokens, logprobs.top_logprobs):  # the two best, the greedy token among them
        assert len(top) == 2 and max(top, key=top.get) == token

    chat_expected = reference(messages=CHAT)
    chat_ids = prompt_ids(None, CHAT, gemma)
    chat_own = independent_log_probs(gemma, chat_ids, chat_expected.token_ids)
    chat = openai_client.chat.completions.create(model=served_app.model_id, messages=CHAT, temperature=0,
                                                 max_tokens=NEW_TOKENS, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert [entry.logprob for entry in content] == pytest.approx(
        [float(chat_own[index, token_id]) for index, token_id in enumerate(chat_expected.token_ids)], abs=2e-3)
    assert b"".join(bytes(entry.bytes) for entry in content).decode() == chat.choices[0].message.content
    assert all(len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token for entry in content)

    request = pb.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=NEW_TOKENS, algorithm="tli", logprobs=1)
    streamed = [entry for response in grpc_stub.GenerateStream(request, timeout=300) for entry in response.logprobs]
    assert [entry.token_id for entry in streamed] == expected.token_ids
    assert [entry.logprob for entry in streamed] == pytest.approx(logprobs.token_logprobs, abs=2e-3)
    assert all(len(entry.top) == 1 and entry.top[0].token_id == entry.token_id for entry in streamed)


def test_n_choices_echo_and_stop_token_ids_through_the_openai_client(openai_client, served_app, reference):  # noqa: F811
    sampled = {"temperature": 1.0, "seed": 11, "max_tokens": 6, "extra_body": {"hetspec": {"algorithm": "slem"}}}
    completion = openai_client.completions.create(model=served_app.model_id, prompt=PROMPTS[1], n=3, **sampled)
    # choice i is the target's own seeded sample with seed 11 + i (seeded SLEM reproduces the target's)
    samples = [reference(PROMPTS[1], max_new_tokens=6, temperature=1.0, seed=11 + index) for index in range(3)]
    assert [choice.index for choice in completion.choices] == [0, 1, 2]
    assert [choice.model_extra["hetspec"]["token_ids"] for choice in completion.choices] == \
        [sample.token_ids for sample in samples]
    assert completion.usage.completion_tokens == sum(len(sample.token_ids) for sample in samples)
    texts = ["", "", ""]
    for chunk in openai_client.completions.create(model=served_app.model_id, prompt=PROMPTS[1], n=3, stream=True,
                                                  stream_options={"include_usage": True}, **sampled):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [sample.text for sample in samples] and chunk.usage.completion_tokens == \
        completion.usage.completion_tokens

    expected = reference(PROMPTS[0])
    greedy = openai_client.completions.create(model=served_app.model_id, prompt=PROMPTS[0], n=2, temperature=0,
                                              max_tokens=NEW_TOKENS, echo=True)
    assert [choice.text for choice in greedy.choices] == [PROMPTS[0] + expected.text] * 2
    assert greedy.usage.completion_tokens == 2 * len(expected.token_ids)

    stop_id = expected.token_ids[3]
    stopped = openai_client.completions.create(model=served_app.model_id, prompt=PROMPTS[0], temperature=0,
                                               max_tokens=NEW_TOKENS, extra_body={"stop_token_ids": [stop_id]})
    first = expected.token_ids.index(stop_id)
    assert stopped.model_extra["hetspec"]["token_ids"] == expected.token_ids[:first + 1]
    assert stopped.choices[0].finish_reason == "stop"


def test_tokenize_and_detokenize_round_trip(served_app, gemma):  # noqa: F811
    tokenized = httpx.post(f"{served_app.http_url}/tokenize", json={"model": served_app.model_id,
                                                                   "prompt": PROMPTS[2]}, timeout=60).json()
    assert tokenized["tokens"] == gemma.encode_prompt(PROMPTS[2]) and tokenized["count"] == len(tokenized["tokens"])
    bare = httpx.post(f"{served_app.http_url}/tokenize", json={"prompt": PROMPTS[2], "add_special_tokens": False},
                      timeout=60).json()
    assert httpx.post(f"{served_app.http_url}/detokenize", json={"tokens": bare["tokens"]},
                      timeout=60).json() == {"prompt": PROMPTS[2]}
    chat = httpx.post(f"{served_app.http_url}/tokenize", json={"messages": CHAT}, timeout=60).json()
    assert chat["tokens"] == prompt_ids(None, CHAT, gemma)
    refused = httpx.post(f"{served_app.http_url}/detokenize", json={"tokens": [1, -5]}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens.1"


def test_models_and_health_routes(served_app, openai_client):  # noqa: F811
    import openai

    models = httpx.get(f"{served_app.http_url}/v1/models", timeout=30).json()
    assert [model["id"] for model in models["data"]] == [served_app.model_id]
    assert openai_client.models.retrieve(served_app.model_id).id == served_app.model_id
    with pytest.raises(openai.NotFoundError) as raised:
        openai_client.models.retrieve("gpt-4")
    assert raised.value.body["code"] == "model_not_found" and "gpt-4" in raised.value.body["message"]
    assert httpx.get(f"{served_app.http_url}/health", timeout=30).json() == {"status": "ok"}


BAD_HTTP = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 100000}, "max_tokens"),
    ({"temperature": 5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 17}, "n"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"echo": True, "logprobs": 2}, "logprobs"),
    ({"prompt": ""}, "prompt"),
    ({"model": "gpt-4"}, "model"),
    ({"hetspec": {"algorithm": "magic"}}, "hetspec.algorithm"),
    ({"hetspec": {"algorithm": "sd"}}, "algorithm"),  # sd needs a same-vocabulary drafter
    ({"hetspec": {"draft_tokens": 0}}, "hetspec.draft_tokens"),
    ({"best_of_luck": 1}, "best_of_luck"),
    ({"stop": [""]}, "stop"),
]


@pytest.mark.parametrize("change,field", BAD_HTTP, ids=[field for _, field in BAD_HTTP])
def test_bad_http_input_is_400_naming_the_field(served_app, change, field):  # noqa: F811
    body = {"model": served_app.model_id, "prompt": "hello", "max_tokens": 4, **change}
    response = httpx.post(f"{served_app.http_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == field and field in error["message"]


def test_malformed_json_is_400(served_app):  # noqa: F811
    response = httpx.post(f"{served_app.http_url}/v1/completions", content=b'{"model": ', timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "body"


def test_bad_chat_input_through_openai_client(openai_client, served_app):  # noqa: F811
    import openai

    with pytest.raises(openai.BadRequestError) as raised:
        openai_client.chat.completions.create(model=served_app.model_id, messages=[], max_tokens=4)
    assert raised.value.status_code == 400 and raised.value.body["param"] == "messages"


BAD_GRPC = [
    (pb.GenerateRequest(prompt=""), "prompt"),
    (pb.GenerateRequest(prompt="hi", max_new_tokens=0), "max_new_tokens"),
    (pb.GenerateRequest(prompt="hi", temperature=-1), "temperature"),
    (pb.GenerateRequest(prompt="hi", top_p=1.5), "top_p"),
    (pb.GenerateRequest(prompt="hi", algorithm="magic"), "algorithm"),
    (pb.GenerateRequest(prompt="hi", draft_tokens=65), "draft_tokens"),
]


@pytest.mark.parametrize("request_message,field", BAD_GRPC, ids=[field for _, field in BAD_GRPC])
@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
def test_bad_grpc_input_is_invalid_argument_without_an_error_logged(grpc_stub, request_message, field, method):
    sizes, request_id = serve_log_sizes(), uuid.uuid4().hex
    with pytest.raises(grpc.RpcError) as raised:
        result = getattr(grpc_stub, method)(request_message, metadata=[("request_id", request_id)], timeout=60)
        list(result) if method == "GenerateStream" else result
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith(f"{field}:"), raised.value.details()
    # a client's mistake is answered, not raised: Serve logs a raised one as an ERROR with a traceback
    assert_nothing_logged_as_an_error(sizes, request_id)


def test_a_seed_reproduces_the_sample_alone_and_beside_concurrent_requests(  # noqa: F811
        grpc_stub, openai_client, served_app, reference):
    """The same seeded request (algorithm auto: exact matching for a seed) 5 times alone and 5 times beside 7
    other concurrent requests (greedy and sampled, other prompts and lengths: other batches and draft lengths),
    over HTTP and gRPC, streamed and not: one text, the library's seeded ``ar`` sample; n=2 with seed s
    returns the samples of seeds s and s + 1."""
    from concurrent.futures import ThreadPoolExecutor

    seed, tokens = 7, 10
    expected = reference(PROMPTS[1], max_new_tokens=tokens, temperature=1.0, seed=seed)

    def http() -> str:
        completion = openai_client.completions.create(model=served_app.model_id, prompt=PROMPTS[1], seed=seed,
                                                      temperature=1.0, max_tokens=tokens)
        assert completion.model_extra["hetspec"]["stats"]["algorithm"] == "slem"
        return completion.choices[0].text

    def http_stream() -> str:
        return "".join(chunk.choices[0].text for chunk in openai_client.completions.create(
            model=served_app.model_id, prompt=PROMPTS[1], seed=seed, temperature=1.0, max_tokens=tokens,
            stream=True) if chunk.choices)

    request = pb.GenerateRequest(prompt=PROMPTS[1], max_new_tokens=tokens, temperature=1.0, seed=seed)

    def grpc_once() -> str:
        response = grpc_stub.Generate(request, timeout=300)
        assert response.stats.algorithm == "slem"
        return response.text

    def grpc_stream() -> str:
        return "".join(message.text for message in grpc_stub.GenerateStream(request, timeout=300))

    def other(index: int) -> str:  # unseeded sampling (TLI), greedy, other prompts and lengths
        params = {"prompt": PROMPTS[index % len(PROMPTS)], "max_tokens": 4 + 2 * index,
                  "temperature": 0.0 if index % 2 else 0.9}
        return openai_client.completions.create(model=served_app.model_id, **params).choices[0].text

    texts = []
    with ThreadPoolExecutor(8) as pool:
        for send in (http, http_stream, grpc_once, grpc_stream):
            texts += [send() for _ in range(5)]  # alone
            for _ in range(5):  # beside 7 concurrent requests
                others = [pool.submit(other, index) for index in range(7)]
                texts.append(pool.submit(send).result())
                for future in others:
                    future.result()
    assert set(texts) == {expected.text}, texts

    choices = openai_client.completions.create(model=served_app.model_id, prompt=PROMPTS[1], seed=seed, n=2,
                                               temperature=1.0, max_tokens=tokens).choices
    assert [choice.text for choice in choices] == \
        [reference(PROMPTS[1], max_new_tokens=tokens, temperature=1.0, seed=seed + index).text for index in range(2)]
