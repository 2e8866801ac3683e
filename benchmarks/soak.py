"""Soak test of a hetspec server: many clients for minutes, mixing every kind of traffic, then the bill.

    python -m benchmarks.soak --start --clients 30 --minutes 10 --name small     # starts config.small.yaml
    python -m benchmarks.soak --url http://127.0.0.1:8000 --grpc 127.0.0.1:9000  # a running `serve run`
    MALLOC_ARENA_MAX=2 python -m benchmarks.soak --start ...  # allocator settings reach the actors (--start)

N closed-loop clients each pick their next request at random (seeded) among: HTTP completions and chat,
streamed and whole; gRPC Generate and GenerateStream; streams cancelled after their first chunk (the
HTTP client disconnects, the gRPC call is cancelled); bad input (HTTP must answer 400 with the field
named, gRPC INVALID_ARGUMENT). A loaded server's designed answers are expected kinds, reported by
status: overloaded (HTTP 429, RESOURCE_EXHAUSTED; the client backs off 1 s) and past the server's request
timeout (HTTP 408, DEADLINE_EXCEEDED). Everything else is an unexpected error.

Reported (results.json, results.md under benchmarks/results/soak-<name>/): requests by kind, outcomes
(expected vs unexpected, by status), latency p50/p99 by kind, each Ray actor's resident memory (RSS of
its pid, read through Ray's state API and psutil; only for actors on this machine) after a warm-up, every
30 s and at the end, with its slope over the last ``--slope-minutes``, and the KV sessions still open in each actor once the clients stopped (must be 0).
Not part of the default test run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from benchmarks import report
from deployments.tools.local_serve import local_serve

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["def fibonacci(n):\n", "The capital of France is", "SELECT name, COUNT(*) FROM users WHERE",
           "東京は日本の首都で、", "Once upon a time, in a small village,",
           "import numpy as np\n\ndef normalize("]
# kind -> weight: the mix each client draws from. The last five are hostile clients (--hostile, on by default):
# 20 MB prompts over HTTP (413) and gRPC (the proxy's RESOURCE_EXHAUSTED), a burst of keyless POSTs (401, only
# when the server has a key), two concurrent streams with one X-Request-ID (both must finish), and a storm of
# streams that disconnect after their first chunk.
MIX = {"http_completion": 2, "http_completion_stream": 2, "http_chat": 1, "http_chat_stream": 1,
       "grpc_unary": 2, "grpc_stream": 2, "http_cancel": 1, "grpc_cancel": 1, "http_bad": 1, "grpc_bad": 1,
       "http_oversized": 1, "grpc_oversized": 1, "keyless_flood": 1, "duplicate_ids": 1, "disconnect_storm": 1}
HOSTILE = ("http_oversized", "grpc_oversized", "keyless_flood", "duplicate_ids", "disconnect_storm")
OVERSIZED = 20 * 1024 * 1024  # characters of a hostile prompt
# Answers a loaded server is designed to give: overloaded (the client backs off) or past its request timeout.
EXPECTED_HTTP = {429, 408}
EXPECTED_GRPC = {"RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}
EXPECTED_STREAM_CODES = {"server_busy", "request_timeout"}
BACK_OFF = {"HTTP 429", "RESOURCE_EXHAUSTED"}


@dataclass
class Outcome:
    kind: str
    status: str  # "ok", or what came back: "HTTP 400", "INVALID_ARGUMENT", "timeout", ...
    expected: bool
    seconds: float
    detail: str = ""


# --- bad input: each case names the field the error must name ------------------------------------------

def bad_http_bodies(model: str) -> list[tuple[str, dict | bytes]]:
    good = {"model": model, "prompt": "hi", "max_tokens": 4}
    cases = [("max_tokens", {"max_tokens": 0}), ("max_tokens", {"max_tokens": 10**9}),
             ("temperature", {"temperature": -1}), ("top_p", {"top_p": 0}), ("top_k", {"top_k": -1}),
             ("prompt", {"prompt": ""}), ("model", {"model": "nope"}),
             ("hetspec.algorithm", {"hetspec": {"algorithm": "magic"}}),
             ("algorithm", {"hetspec": {"algorithm": "sd"}}),  # sd needs one vocabulary
             ("stop", {"stop": ["x"] * 17}), ("colour", {"colour": "red"}), ("prompt", {"prompt": "a\ud800b"}),
             ("prompt", {"prompt": "word " * 5000})]
    return [(field, {**good, **change}) for field, change in cases] + [("body", b'{"model": '), ("body", b"\xff\xfe")]


def bad_grpc_requests():
    from protos.hetspec.v1 import hetspec_pb2 as pb

    return [("prompt", pb.GenerateRequest(prompt="")),
            ("max_new_tokens", pb.GenerateRequest(prompt="hi", max_new_tokens=0)),
            ("temperature", pb.GenerateRequest(prompt="hi", temperature=math.nan)),
            ("top_p", pb.GenerateRequest(prompt="hi", top_p=1.5)),
            ("algorithm", pb.GenerateRequest(prompt="hi", algorithm="magic")),
            ("draft_tokens", pb.GenerateRequest(prompt="hi", draft_tokens=65)),
            ("stop", pb.GenerateRequest(prompt="hi", stop=[""])),
            ("request", b"\x0a\x02\xff\xfe")]  # not UTF-8: raw bytes no client library sends


# --- the clients ------------------------------------------------------------------------------------------

class Traffic:
    def __init__(self, http, grpc_channel, model: str, max_new_tokens: int, cancel_tokens: int, timeout: float,
                 metadata=None, temperatures: tuple[float, ...] = (0.0, 0.8), storm: int = 4):
        from protos.hetspec.v1 import hetspec_pb2_grpc

        self.http, self.channel, self.model = http, grpc_channel, model
        self.stub = hetspec_pb2_grpc.HetSpecStub(grpc_channel)
        self.raw_generate = grpc_channel.unary_unary("/hetspec.v1.HetSpec/Generate", request_serializer=lambda raw: raw,
                                                     response_deserializer=lambda raw: raw)
        self.max_new_tokens, self.timeout, self.metadata = max_new_tokens, timeout, metadata
        self.cancel_tokens = cancel_tokens  # a stream to cancel asks for more, so it is still running
        self.bad_http, self.bad_grpc = bad_http_bodies(model), bad_grpc_requests()
        self.temperatures = temperatures  # each request draws one (0: greedy)
        self.storm = storm  # keyless POSTs of a keyless flood, streams of a disconnect storm
        self.oversized = json.dumps({"model": model, "prompt": "a" * OVERSIZED, "max_tokens": 4}).encode()

    def _body(self, rng: random.Random, chat: bool, stream: bool) -> dict:
        prompt = rng.choice(PROMPTS)
        body = {"model": self.model, "max_tokens": self.max_new_tokens, "temperature": rng.choice(self.temperatures),
                "seed": rng.randrange(1000), "stream": stream}
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body

    async def run(self, kind: str, rng: random.Random) -> Outcome:
        started = time.perf_counter()
        try:
            status, expected, detail = await asyncio.wait_for(getattr(self, kind)(rng), self.timeout)
        except asyncio.TimeoutError:
            status, expected, detail = "timeout", False, f"no answer in {self.timeout} s"
        except Exception as error:  # noqa: BLE001 -- the soak reports every failure, it does not stop
            status, expected, detail = type(error).__name__, False, str(error)[:300]
        return Outcome(kind, status, expected, time.perf_counter() - started, detail)

    # each method returns (status, expected, detail)

    async def _http_whole(self, body: dict):
        route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        response = await self.http.post(route, json=body)
        if response.status_code == 200:
            choice = response.json()["choices"][0]
            return ("ok", True, "") if choice["finish_reason"] in ("stop", "length") else ("no finish", False, "")
        return _http_error(response.status_code, response.text)

    async def _http_stream(self, body: dict, cancel: bool, headers: dict | None = None):
        route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        async with self.http.stream("POST", route, json=body, headers=headers) as response:
            if response.status_code != 200:
                return _http_error(response.status_code, (await response.aread()).decode(errors="replace"))
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if cancel:
                    return "cancelled", True, ""  # leaving the block closes the connection mid-stream
                if line == "data: [DONE]":
                    return "ok", True, ""
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    error = event["error"]
                    return f"stream {error.get('code') or error.get('type')}", \
                        error.get("code") in EXPECTED_STREAM_CODES, error.get("message", "")[:300]
        return "stream cut", False, "no [DONE]"

    async def http_completion(self, rng):
        return await self._http_whole(self._body(rng, chat=False, stream=False))

    async def http_chat(self, rng):
        return await self._http_whole(self._body(rng, chat=True, stream=False))

    async def http_completion_stream(self, rng):
        return await self._http_stream(self._body(rng, chat=False, stream=True), cancel=False)

    async def http_chat_stream(self, rng):
        return await self._http_stream(self._body(rng, chat=True, stream=True), cancel=False)

    async def http_cancel(self, rng):
        body = {**self._body(rng, chat=False, stream=True), "max_tokens": self.cancel_tokens}
        return await self._http_stream(body, cancel=True)

    async def http_bad(self, rng):
        field, body = rng.choice(self.bad_http)
        # serialized here: httpx's json= cannot encode a lone surrogate, json.dumps escapes it (\\ud800)
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = await self.http.post("/v1/completions", content=content,
                                        headers={"content-type": "application/json"})
        if response.status_code == 400:
            param = response.json()["error"]["param"]
            return ("HTTP 400", True, "") if param == field else ("HTTP 400 wrong param", False, f"{param} != {field}")
        return _http_error(response.status_code, response.text, wanted=f"400 naming {field}")

    def _grpc_request(self, rng: random.Random):
        from protos.hetspec.v1 import hetspec_pb2 as pb

        return pb.GenerateRequest(prompt=rng.choice(PROMPTS), max_new_tokens=self.max_new_tokens,
                                  temperature=rng.choice(self.temperatures), seed=rng.randrange(1000))

    async def grpc_unary(self, rng):
        import grpc

        try:
            response = await self.stub.Generate(self._grpc_request(rng), metadata=self.metadata)
        except grpc.aio.AioRpcError as error:
            return _grpc_error(error)
        return ("ok", True, "") if response.finish_reason in ("stop", "length") else ("no finish", False, "")

    async def grpc_stream(self, rng, cancel: bool = False):
        import grpc

        request = self._grpc_request(rng)
        if cancel:
            request.max_new_tokens = self.cancel_tokens
        call = self.stub.GenerateStream(request, metadata=self.metadata)
        try:
            async for response in call:
                if cancel and response.token_ids:  # not the empty last message of a refused stream
                    call.cancel()
                    return "cancelled", True, ""
                if response.finish_reason:
                    return "ok", True, ""
        except grpc.aio.AioRpcError as error:
            return _grpc_error(error)
        return "stream cut", False, "no finish_reason"

    async def grpc_cancel(self, rng):
        return await self.grpc_stream(rng, cancel=True)

    async def grpc_bad(self, rng):
        import grpc

        field, request = rng.choice(self.bad_grpc)
        try:
            if isinstance(request, bytes):
                await self.raw_generate(request, metadata=self.metadata)
            else:
                await self.stub.Generate(request, metadata=self.metadata)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
                named = (error.details() or "").startswith(f"{field}:")
                return ("INVALID_ARGUMENT", True, "") if named else ("INVALID_ARGUMENT wrong field", False,
                                                                      error.details())
            return _grpc_error(error, wanted=f"INVALID_ARGUMENT naming {field}")
        return "accepted", False, f"bad {field} was served"


    # --- hostile clients ---

    async def http_oversized(self, rng):
        response = await self.http.post("/v1/completions", content=self.oversized,
                                        headers={"content-type": "application/json"})
        if response.status_code == 413:
            return "HTTP 413", True, ""
        return _http_error(response.status_code, response.text, wanted="413")

    async def grpc_oversized(self, rng):
        import grpc

        from protos.hetspec.v1 import hetspec_pb2 as pb

        try:
            await self.stub.Generate(pb.GenerateRequest(prompt="a" * OVERSIZED, max_new_tokens=4),
                                     metadata=self.metadata)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # the proxy's message bound: no back-off
                return "oversized RESOURCE_EXHAUSTED", True, ""
            return _grpc_error(error, wanted="RESOURCE_EXHAUSTED")
        return "accepted", False, "a 20 MB prompt was served"

    async def keyless_flood(self, rng):
        if "Authorization" not in self.http.headers:
            return "no key configured", True, ""
        body = self._body(rng, chat=False, stream=False)
        # the same connection pool, without the key: a careless or hostile client next to the paying ones
        answers = await asyncio.gather(*(self.http.post("/v1/completions", json=body, headers={"Authorization": ""})
                                         for _ in range(self.storm)))
        codes = sorted({answer.status_code for answer in answers})
        return ("HTTP 401", True, "") if codes == [401] else (f"keyless HTTP {codes}", False, "wanted only 401")

    async def duplicate_ids(self, rng):
        request_id = f"soak-duplicate-{rng.randrange(10**9)}"
        bodies = [{**self._body(rng, chat=False, stream=True), "temperature": 0} for _ in range(2)]
        results = await asyncio.gather(*(self._http_stream(body, cancel=False, headers={"X-Request-ID": request_id})
                                         for body in bodies))
        statuses = [status for status, _, _ in results]
        if statuses == ["ok", "ok"]:
            return "ok", True, ""
        return (f"duplicate id {statuses}", all(expected for _, expected, _ in results),
                "; ".join(detail for _, _, detail in results))

    async def disconnect_storm(self, rng):
        body = {**self._body(rng, chat=False, stream=True), "max_tokens": self.cancel_tokens}
        results = await asyncio.gather(*(self._http_stream(body, cancel=True) for _ in range(self.storm)))
        statuses = sorted({status for status, _, _ in results})
        if statuses == ["cancelled"]:
            return "cancelled", True, ""
        return f"storm {statuses}", all(expected for _, expected, _ in results), ""


def _http_error(code: int, text: str, wanted: str = "200"):
    return f"HTTP {code}", code in EXPECTED_HTTP, f"wanted {wanted}: {text[:300]}"


def _grpc_error(error, wanted: str = "OK"):
    return error.code().name, error.code().name in EXPECTED_GRPC, f"wanted {wanted}: {(error.details() or '')[:300]}"


async def run_clients(traffic: Traffic, clients: int, seconds: float, seed: int,
                      memory_samples: list[dict] | None = None, mix: dict[str, int] = MIX,
                      replica_pids: set | None = None) -> list[Outcome]:
    """The clients' outcomes; every 30 s a progress line, (if ``memory_samples``) each actor's RSS and (if
    ``replica_pids``) the pid of the replica that answers /v1/stats (a restarted replica has a new one)."""
    outcomes: list[Outcome] = []
    stop_at = time.monotonic() + seconds
    kinds, weights = list(mix), list(mix.values())

    async def client(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        while time.monotonic() < stop_at:
            outcome = await traffic.run(rng.choices(kinds, weights)[0], rng)
            outcomes.append(outcome)
            if outcome.status in BACK_OFF:
                await asyncio.sleep(1.0)  # back off as a well-behaved client does (the configs' retry_after_s)

    async def progress() -> None:
        while time.monotonic() < stop_at:
            await asyncio.sleep(30)
            if replica_pids is not None:
                replica_pids.add((await traffic.http.get("/v1/stats")).json().get("replica_pid"))
            if memory_samples is not None:  # a leak grows steadily; warming allocators level off
                memory = await asyncio.to_thread(actor_memory)
                memory_samples.append({"seconds": round(seconds - (stop_at - time.monotonic())),
                                       "rss_mib": {name: row["rss_mib"] for name, row in (memory or {}).items()}})
            bad = sum(not outcome.expected for outcome in outcomes)
            print(f"  {len(outcomes)} requests, {bad} unexpected, {max(0, stop_at - time.monotonic()):.0f} s left",
                  file=sys.stderr, flush=True)

    reporter = asyncio.ensure_future(progress())
    await asyncio.gather(*(client(index) for index in range(clients)))
    reporter.cancel()
    return outcomes


# --- the server's side: actor memory and open sessions ----------------------------------------------------

def actor_memory() -> dict[str, dict] | None:
    """RSS of every live Ray actor on this machine, by actor name; None when no Ray cluster is reachable."""
    try:
        import psutil
        import ray
        from ray.util.state import list_actors

        if not ray.is_initialized():
            ray.init(address="auto", log_to_driver=False)
        # this instance's address: with no address the state API looks one up, and fails on a machine running
        # several Ray instances ("Found multiple active Ray instances")
        actors = list_actors(address=ray.get_runtime_context().gcs_address, filters=[("state", "=", "ALIVE")],
                             limit=1000)
    except Exception as error:  # noqa: BLE001 -- memory is reported as unavailable, the soak still counts
        print(f"actor memory unavailable: {error}", file=sys.stderr)
        return None
    memory = {}
    for actor in actors:
        name = f"{actor.class_name}:{actor.actor_id[:8]}"
        try:
            process = psutil.Process(actor.pid)
            environment = process.environ()  # the actor's own: a config's worker_env_vars reach only its workers
            memory[name] = {"pid": actor.pid, "rss_mib": process.memory_info().rss / 2**20,
                            "allocator": {key: environment[key] for key in ALLOCATOR_ENV if key in environment}}
        except (psutil.Error, TypeError):
            memory[name] = {"pid": actor.pid, "rss_mib": None}  # on another machine
    return memory


async def open_sessions(http, settle_seconds: float, polls_per_sweep: int = 4) -> dict:
    """Each replica's /v1/stats once its requests are done (closing is asynchronous: poll, bounded).

    A sweep polls a few times (Serve routes each poll to some replica); it ends when all it saw are idle.
    """
    deadline = time.monotonic() + settle_seconds
    while True:
        seen: dict[str, dict] = {}
        for _ in range(polls_per_sweep):
            stats = (await http.get("/v1/stats")).json()
            seen[stats["replica"]] = stats
        busy = [s for s in seen.values() if s["ongoing_requests"] or any(_sessions(s).values())]
        if not busy or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    return {replica: {"ongoing_requests": stats["ongoing_requests"], "open_sessions": _sessions(stats),
                      "outcomes": {k: v for k, v in stats.items() if k.endswith("_requests")},
                      "heap_trims": _heap_trims(stats)}
            for replica, stats in seen.items()}


def _heap_trims(stats: dict) -> dict:
    """Per model actor: its malloc_trim calls, their seconds and the resident MiB they gave back."""
    return {role: {"trims": stats[role].get("heap_trims"), "seconds": stats[role].get("heap_trim_seconds"),
                   "released_mib": round(stats[role].get("heap_trim_released_bytes", 0) / 2**20, 1)}
            for role in ("target", "drafter") if "error" not in stats[role]}


def _sessions(stats: dict) -> dict:
    return {role: stats[role].get("active_sessions", stats[role].get("error")) for role in ("target", "drafter")}


def rss_slope(samples: list[dict], name: str, window_s: float) -> float | None:
    """Least-squares slope of one actor's RSS (MiB per minute) over the samples of the last ``window_s``
    seconds: a leak keeps climbing at the end of a long run, a warming allocator levels off."""
    points = [(sample["seconds"], sample["rss_mib"].get(name)) for sample in samples]
    points = [(seconds, rss) for seconds, rss in points if rss is not None]
    if not points:
        return None
    recent = [(seconds, rss) for seconds, rss in points if seconds >= points[-1][0] - window_s]
    if len(recent) < 3:
        return None
    slope, _ = np.polyfit([seconds / 60 for seconds, _ in recent], [rss for _, rss in recent], 1)
    return float(slope)


# the allocator's settings a process runs with (the actors get theirs from pipeline.worker_env_vars)
ALLOCATOR_ENV = ("MALLOC_ARENA_MAX", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "LD_PRELOAD", "MALLOC_CONF")


# --- the report ---------------------------------------------------------------------------------------------

def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50_ms": None, "p99_ms": None}
    return {"p50_ms": float(np.percentile(values, 50)) * 1000, "p99_ms": float(np.percentile(values, 99)) * 1000}


def summarize(outcomes: list[Outcome], memory_start: dict | None, memory_end: dict | None, sessions: dict,
              mix: dict[str, int] = MIX) -> dict:
    by_kind: dict[str, dict] = {}
    for kind in mix:
        mine = [outcome for outcome in outcomes if outcome.kind == kind]
        statuses = Counter(outcome.status for outcome in mine)
        by_kind[kind] = {"requests": len(mine), "statuses": dict(statuses),
                         "unexpected": sum(not outcome.expected for outcome in mine),
                         "latency": _percentiles([o.seconds for o in mine if o.status in ("ok", "cancelled")]),
                         "rejected_latency": _percentiles([o.seconds for o in mine if o.expected
                                                           and o.status not in ("ok", "cancelled")])}
    unexpected: dict[str, list[str]] = defaultdict(list)
    for outcome in outcomes:
        if not outcome.expected and len(unexpected[f"{outcome.kind} {outcome.status}"]) < 5:
            unexpected[f"{outcome.kind} {outcome.status}"].append(outcome.detail)
    memory = {}
    for name in sorted(set(memory_start or {}) | set(memory_end or {})):
        start = (memory_start or {}).get(name, {}).get("rss_mib")
        end = (memory_end or {}).get(name, {}).get("rss_mib")
        memory[name] = {"start_mib": start, "end_mib": end,
                        "growth_mib": end - start if start is not None and end is not None else None,
                        "allocator": (memory_end or memory_start or {}).get(name, {}).get("allocator") or {}}
    leaked = sum(value for replica in sessions.values() for value in replica["open_sessions"].values()
                 if isinstance(value, int))
    return {"requests": len(outcomes), "unexpected_errors": sum(not o.expected for o in outcomes),
            "expected_errors": Counter(o.status for o in outcomes if o.expected and o.status not in ("ok",)),
            "served_ok": sum(o.status == "ok" for o in outcomes), "by_kind": by_kind,
            "unexpected_examples": dict(unexpected), "memory": memory, "sessions_after": sessions,
            "sessions_leaked": leaked}


def markdown(result: dict) -> str:
    meta, settings, summary = result["meta"], result["settings"], result["summary"]

    def number(value, digits=0):
        return "-" if value is None else f"{value:.{digits}f}"

    lines = [f"# hetspec soak: {settings['name']}", "",
             f"- {settings['clients']} clients for {settings['seconds'] / 60:.1f} min against {settings['url']} / "
             f"{settings['grpc']} (model {settings['model']}), {settings['max_new_tokens']} new tokens per request",
             f"- machine {report.describe_machine(meta['machine'])}, load average at start "
             f"{meta['machine']['load_average']}; date {meta['date']}, commit {meta['git_commit']}",
             f"- command: `{meta['command']}`", "",
             f"**{summary['requests']} requests, {summary['served_ok']} served, {summary['unexpected_errors']} "
             f"unexpected errors, {summary['sessions_leaked']} KV sessions leaked, "
             f"{summary.get('replica_restarts', '-')} replica restarts, {summary.get('authenticated_429', '-')} "
             "authenticated requests refused as overloaded.**", ""]
    if result.get("note"):
        lines += [f"> {result['note']}", ""]
    lines += ["| kind | requests | outcomes | unexpected | served p50 ms | served p99 ms | refused p50 ms | "
              "refused p99 ms |", "|---|---|---|---|---|---|---|---|"]
    for kind, row in summary["by_kind"].items():
        outcomes = ", ".join(f"{status} {count}" for status, count in sorted(row["statuses"].items()))
        lines.append(f"| {kind} | {row['requests']} | {outcomes} | {row['unexpected']} | "
                     f"{number(row['latency']['p50_ms'])} | {number(row['latency']['p99_ms'])} | "
                     f"{number(row['rejected_latency']['p50_ms'])} | {number(row['rejected_latency']['p99_ms'])} |")
    lines += ["", "Latency: send to last byte. Served: ok, or cancelled by the client (to its first chunk). Refused: "
              "the expected answers (400 / INVALID_ARGUMENT for bad input, 429 / RESOURCE_EXHAUSTED, 408 / "
              "DEADLINE_EXCEEDED).", "",
              f"| actor | RSS after warm-up MiB | peak during the run MiB | RSS at end MiB | growth MiB | "
              f"slope over the last {settings.get('slope_minutes', 30):g} min, MiB/min | allocator settings |",
              "|---|---|---|---|---|---|---|"]
    for name, row in summary["memory"].items():
        allocator = ", ".join(f"{key}={value}" for key, value in row.get("allocator", {}).items()) or "glibc default"
        lines.append(f"| {name} | {number(row['start_mib'])} | {number(row.get('peak_during_mib'))} | "
                     f"{number(row['end_mib'])} | {number(row['growth_mib'])} | "
                     f"{number(row.get('slope_mib_per_min'), 2)} | {allocator} |")
    if settings.get("allocator_env"):
        lines += ["", f"Allocator settings of the soak's own environment (a started Ray passes them to every "
                  f"process): {settings['allocator_env']}"]
    if summary.get("memory_samples"):
        lines += ["", "RSS every 30 s (MiB), per actor: "
                  + "; ".join(f"{name.split(':')[0]}: " + " ".join(number(sample['rss_mib'].get(name))
                                                                for sample in summary["memory_samples"])
                              for name in summary["memory"])]
    lines += ["", "| replica | open sessions after the run | ongoing requests | replica's request outcomes | "
              "heap trims (deployments/runtime/heap_trim.py) |", "|---|---|---|---|---|"]
    for replica, row in summary["sessions_after"].items():
        lines.append(f"| {replica} | {row['open_sessions']} | {row['ongoing_requests']} | {row['outcomes']} | "
                     f"{row.get('heap_trims', '-')} |")
    if summary["unexpected_examples"]:
        lines += ["", "Unexpected errors (up to 5 examples each):", ""]
        for key, details in summary["unexpected_examples"].items():
            lines.append(f"- {key}: {details}")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--start", action="store_true", help="start a private Ray instance serving --config")
    where.add_argument("--url", default="http://127.0.0.1:8000", help="base URL of a running server's HTTP proxy")
    parser.add_argument("--grpc", default="127.0.0.1:9000", help="host:port of its gRPC proxy (ignored with --start)")
    parser.add_argument("--config", type=Path, default=REPO / "deployments" / "config.small.yaml",
                        help="Serve config started by --start")
    parser.add_argument("--application", help="Serve application name, sent as gRPC 'application' metadata")
    parser.add_argument("--api-key", default=os.environ.get("HETSPEC_API_KEY"),
                        help="the server's API key (default: $HETSPEC_API_KEY)")
    parser.add_argument("--clients", type=int, default=30)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--cancel-tokens", type=int, default=64, help="max_new_tokens of the streams cancelled")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    parser.add_argument("--settle", type=float, default=60.0, help="seconds to wait for sessions to close")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8],
                        help="each request draws its temperature from these (0 alone: greedy traffic only)")
    parser.add_argument("--slope-minutes", type=float, default=30.0,
                        help="the RSS slope is fitted over this many last minutes of the run")
    parser.add_argument("--no-hostile", dest="hostile", action="store_false",
                        help="leave the hostile clients (oversized, keyless, duplicate ids, disconnect storms) out")
    parser.add_argument("--storm", type=int, default=4, help="requests of one keyless flood or disconnect storm")
    parser.add_argument("--name", default="soak", help="names the result folder: soak-<name>")
    parser.add_argument("--note", default="")
    parser.add_argument("--out", type=Path)
    return parser.parse_args(argv)


async def soak(args: argparse.Namespace, url: str, grpc_target: str) -> dict:
    import grpc
    import httpx

    limits = httpx.Limits(max_connections=args.clients * 2, max_keepalive_connections=args.clients)
    metadata = (("application", args.application),) if args.application else ()
    headers = {}
    if args.api_key:
        metadata += (("authorization", f"Bearer {args.api_key}"),)
        headers["Authorization"] = f"Bearer {args.api_key}"
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits, headers=headers) as http:
        async with grpc.aio.insecure_channel(grpc_target) as channel:
            model = (await http.get("/v1/models")).json()["data"][0]["id"]
            traffic = Traffic(http, channel, model, args.max_new_tokens, args.cancel_tokens, args.timeout,
                              metadata or None, tuple(args.temperatures), args.storm)
            mix = {kind: weight for kind, weight in MIX.items() if args.hostile or kind not in HOSTILE}
            replica_pids = {(await http.get("/v1/stats")).json().get("replica_pid")}
            warmup = [await traffic.run(kind, random.Random(args.seed)) for kind in mix]  # every kind once
            memory_start = await asyncio.to_thread(actor_memory)
            print(f"soak: {args.clients} clients for {args.minutes} min on {url} / {grpc_target}", file=sys.stderr)
            memory_samples: list[dict] = []
            outcomes = await run_clients(traffic, args.clients, args.minutes * 60, args.seed, memory_samples, mix,
                                         replica_pids)
            sessions = await open_sessions(http, args.settle)
            replica_pids.add((await http.get("/v1/stats")).json().get("replica_pid"))
            memory_end = await asyncio.to_thread(actor_memory)
            health = (await http.get("/health")).status_code
    summary = summarize(outcomes, memory_start, memory_end, sessions, mix)
    summary["memory_samples"] = memory_samples
    # a replica that Serve restarted answers with a new pid (one replica: the configs' min = max = 1)
    summary["replica_restarts"] = len(replica_pids) - 1
    summary["authenticated_429"] = sum(outcome.status in BACK_OFF for outcome in outcomes)
    for name, row in summary["memory"].items():
        during = [sample["rss_mib"].get(name) for sample in memory_samples]
        row["peak_during_mib"] = max((value for value in during if value is not None), default=None)
        row["slope_mib_per_min"] = rss_slope(memory_samples, name, args.slope_minutes * 60)
    summary["warmup"] = [{"kind": outcome.kind, "status": outcome.status, "expected": outcome.expected,
                          "detail": outcome.detail} for outcome in warmup]
    summary["health_after"] = health
    return {"settings": {"name": args.name, "url": url, "grpc": grpc_target, "model": model, "clients": args.clients,
                         "seconds": args.minutes * 60, "max_new_tokens": args.max_new_tokens, "mix": mix,
                         "seed": args.seed, "slope_minutes": args.slope_minutes, "temperatures": args.temperatures,
                         "allocator_env": {key: os.environ[key] for key in ALLOCATOR_ENV if key in os.environ}},
            "summary": summary}


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    meta = report.provenance(argv, "server", module="benchmarks.soak")
    if args.start:
        # the whole machine as one node; $HETSPEC_API_KEY reaches the replicas, as --api-key's default the client
        serve_config = yaml.safe_load(args.config.read_text())
        with local_serve(serve_config, ready_timeout_s=600, keep_api_key=True) as served:
            result = asyncio.run(soak(args, served.http_url, served.grpc_target))
    else:
        result = asyncio.run(soak(args, args.url.rstrip("/"), args.grpc))
    result = {"meta": meta, "note": args.note, **result}
    folder = args.out or RESULTS_DIR / f"soak-{args.name}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (folder / "results.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
