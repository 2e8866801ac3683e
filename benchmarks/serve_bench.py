"""Load test of a running hetspec server (``serve run deployments/config.yaml``) over gRPC and HTTP.

    python -m benchmarks.serve_bench --protocol both --concurrency 1 4 8 --requests 16 --label pipelined-1replica

N closed-loop clients (each sends its next request when the last one finished) stream completions
from the gRPC API (``hetspec.v1.HetSpec/GenerateStream``, port 9000) or the OpenAI-compatible HTTP API
(``/v1/completions`` with ``stream: true``, port 8000). It talks only to those public APIs.
Reported per protocol and concurrency: output tokens/s over the whole run, requests/s, time to first
token (TTFT), time per output token after the first (TPOT, one value per request), per-token latency
(each streamed chunk's gap spread over the tokens it carries) as p50/p99, the longest wait between two
chunks of any request (a stalled request), and the server's acceptance
statistics. Pipelined vs not is a request option (``--pipelined on|off``); one vs two replicas, or
another pair, is a change of the Serve config (benchmarks/README.md).

``--library deployments/config.yaml`` also loads that config's pair in this process (``hetspec.Engine``,
the library the server wraps) and, at concurrency 1, runs each request through it right before sending
it to the server, so load drift hits both alike: the server's overhead is the ratio of the two times per
output token over the same requests, reported with whether every output is the library's token for token.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

import numpy as np

from benchmarks import cpu_by_process, report
from benchmarks.prompts import TASKS, load_prompts

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass
class RequestOptions:
    max_new_tokens: int = 128
    temperature: float = 0.0
    algorithm: str = ""  # empty: the server's default
    draft_tokens: int | None = None
    pipelined: bool | None = None  # None: the server's default


@dataclass
class RequestTiming:
    protocol: str
    prompt_id: str
    seconds: float = 0.0  # request sent to last byte
    first_token_seconds: float | None = None
    tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    token_latencies: list[float] = field(default_factory=list)  # seconds per token, from chunk gaps
    # the longest wait between two chunks after the first: a request stalled while others ran shows here, where a
    # p99 over every token of a level hid a 22.7 s one among 512 (benchmarks/results/serve-scaling-first-token-
    # rounds2-f32/NOTES.md)
    longest_gap_seconds: float = 0.0
    stats: dict | None = None
    error: str | None = None

    @property
    def time_per_output_token(self) -> float | None:
        if self.first_token_seconds is None or self.tokens < 2:
            return None
        return (self.seconds - self.first_token_seconds) / (self.tokens - 1)


class ChunkClock:
    """Turns the arrival of streamed chunks into TTFT and per-token latencies."""

    def __init__(self, timing: RequestTiming):
        self.timing = timing
        self.started = self.last = time.perf_counter()

    def chunk(self, token_ids: list[int]) -> None:
        tokens = len(token_ids)
        if tokens <= 0:
            return
        self.timing.token_ids.extend(token_ids)
        now = time.perf_counter()
        if self.timing.first_token_seconds is None:
            self.timing.first_token_seconds = now - self.started
        else:
            self.timing.token_latencies.extend([(now - self.last) / tokens] * tokens)
            self.timing.longest_gap_seconds = max(self.timing.longest_gap_seconds, now - self.last)
        self.last = now
        self.timing.tokens += tokens

    def done(self) -> RequestTiming:
        self.timing.seconds = time.perf_counter() - self.started
        return self.timing


def http_body(model: str, prompt: str, options: RequestOptions) -> dict:
    extension = {"algorithm": options.algorithm or None, "draft_tokens": options.draft_tokens,
                 "pipelined": options.pipelined}
    return {"model": model, "prompt": prompt, "max_tokens": options.max_new_tokens,
            "temperature": options.temperature, "stream": True, "stream_options": {"include_usage": True},
            "hetspec": {key: value for key, value in extension.items() if value is not None}}


async def http_request(client, model: str, prompt_id: str, prompt: str, options: RequestOptions) -> RequestTiming:
    """One streamed ``/v1/completions`` request; ``client`` is an ``httpx.AsyncClient`` with the base URL."""
    timing = RequestTiming("http", prompt_id)
    clock = ChunkClock(timing)
    async with client.stream("POST", "/v1/completions", json=http_body(model, prompt, options)) as response:
        if response.status_code != 200:
            timing.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
            return clock.done()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            body = json.loads(line[len("data: "):])
            if "error" in body:
                timing.error = body["error"].get("message", str(body["error"]))
                continue
            extension = body.get("hetspec") or {}
            clock.chunk(list(extension.get("token_ids", [])))
            if extension.get("stats"):
                timing.stats = extension["stats"]
    return clock.done()


def grpc_request_message(prompt: str, options: RequestOptions):
    from protos.hetspec.v1 import hetspec_pb2 as pb

    fields = {"prompt": prompt, "max_new_tokens": options.max_new_tokens, "temperature": options.temperature,
              "algorithm": options.algorithm}
    if options.draft_tokens is not None:
        fields["draft_tokens"] = options.draft_tokens
    if options.pipelined is not None:
        fields["pipelined"] = options.pipelined
    return pb.GenerateRequest(**fields)


async def grpc_request(stub, metadata, prompt_id: str, prompt: str, options: RequestOptions) -> RequestTiming:
    """One ``GenerateStream`` call; ``stub`` is a ``HetSpecStub`` on a ``grpc.aio`` channel."""
    import grpc
    from google.protobuf.json_format import MessageToDict

    timing = RequestTiming("grpc", prompt_id)
    clock = ChunkClock(timing)
    try:
        async for response in stub.GenerateStream(grpc_request_message(prompt, options), metadata=metadata):
            clock.chunk(list(response.token_ids))
            if response.finish_reason and response.HasField("stats"):
                timing.stats = MessageToDict(response.stats, preserving_proto_field_name=True)
    except grpc.aio.AioRpcError as error:
        timing.error = f"{error.code().name}: {error.details()}"
    return clock.done()


Send = Callable[[str, str], Awaitable[RequestTiming]]


class InProcess:
    """A Serve config's pair in this process: what a request costs the library without the server."""

    def __init__(self, config_path: Path, options: RequestOptions):
        import yaml

        from deployments.config import AppConfig
        from deployments.serving.request import request_speculation
        from hetspec import Engine, SamplingParams, load_model

        document = yaml.safe_load(config_path.read_text())
        config = AppConfig.model_validate(document["applications"][0]["args"])
        # one process, one torch thread pool: the target's thread count (load_model sets it process-wide)
        drafter = load_model(config.drafter.model, dtype=config.drafter.dtype, device=config.drafter.device,
                             threads=config.target.threads, quantize=config.drafter.quantize,
                             linear=config.drafter.linear)
        target = load_model(config.target.model, dtype=config.target.dtype, device=config.target.device,
                            threads=config.target.threads, linear=config.target.linear)
        self.engine = Engine(target, drafter)
        self.speculation = request_speculation(config.speculation, options.algorithm or None, options.draft_tokens)
        self.params = SamplingParams(max_new_tokens=options.max_new_tokens, temperature=options.temperature)

    def request(self, prompt_id: str, prompt: str) -> RequestTiming:
        timing = RequestTiming("library", prompt_id)
        clock = ChunkClock(timing)
        for event in self.engine.stream(prompt, self.params, speculation=self.speculation):
            clock.chunk(event.token_ids)
            if event.finish_reason:
                timing.stats = event.stats.to_dict()
        return clock.done()

    def divergence(self, prompt: str, server_ids: list[int], library_ids: list[int]) -> dict | None:
        """Where the server's output first parts from the library's (None: equal), and the target's top-2 logit
        margin there after the library's prefix: a tie (a margin of a rounding step) is the one difference the
        two may show, where passes of other widths round differently (bfloat16 above all)."""
        from benchmarks import analysis

        position = analysis.first_difference(library_ids, server_ids)
        if position is None:
            return None
        item = {"position": position,
                "server_id": server_ids[position] if position < len(server_ids) else None,
                "library_id": library_ids[position] if position < len(library_ids) else None}
        target = self.engine.target
        margin, top2 = analysis.top2_margin(target, target.encode_prompt(prompt), library_ids[:position])
        return {**item, "target_top2_margin": margin, "target_top2_ids": top2}


def paired_differences(library: InProcess, prompts: list[tuple[str, str]], timings: list[RequestTiming],
                       library_timings: list[RequestTiming]) -> list[dict]:
    """Each paired request whose server output is not the library's: where, and how close to a tie."""
    texts = dict(prompts)
    differences = []
    for server, own in zip(timings, library_timings):
        if server.error is None and (item := library.divergence(texts[server.prompt_id], server.token_ids,
                                                                own.token_ids)):
            differences.append({"prompt_id": server.prompt_id, **item})
    return differences


async def run_paired(send: Send, library: InProcess, prompts: list[tuple[str, str]],
                     total_requests: int) -> tuple[list[RequestTiming], list[RequestTiming], float]:
    """Concurrency 1, each request through the library then the server: (server timings, library's, wall)."""
    timings, library_timings, wall = [], [], 0.0
    for index in range(total_requests):
        prompt_id, prompt = prompts[index % len(prompts)]
        library_timings.append(library.request(prompt_id, prompt))  # blocks the loop: nothing else is in flight
        started = time.perf_counter()
        timings.append(await send(prompt_id, prompt))
        wall += time.perf_counter() - started
    return timings, library_timings, wall


def overhead(timings: list[RequestTiming], library_timings: list[RequestTiming]) -> dict:
    """The server against the library over the same requests: time per output token, prefill included."""
    pairs = [(server, library) for server, library in zip(timings, library_timings) if server.error is None]
    server_ms = 1000 * sum(s.seconds for s, _ in pairs) / max(1, sum(s.tokens for s, _ in pairs))
    library_ms = 1000 * sum(lib.seconds for _, lib in pairs) / max(1, sum(lib.tokens for _, lib in pairs))
    return {"library_ms_per_token": library_ms, "server_ms_per_token": server_ms,
            "server_over_library": server_ms / library_ms if library_ms else None,
            "library_tokens_per_second": 1000 / library_ms if library_ms else None,
            "identical_tokens": all(s.token_ids == lib.token_ids for s, lib in pairs) and len(pairs) == len(timings),
            "library_tokens_per_target_pass": float(np.mean([lib.stats["mean_accepted_per_pass"]
                                                             for _, lib in pairs if lib.stats] or [0.0]))}


async def run_load(send: Send, prompts: list[tuple[str, str]], concurrency: int,
                   total_requests: int) -> tuple[list[RequestTiming], float]:
    """``concurrency`` closed-loop clients share ``total_requests`` requests (prompts in turn)."""
    queue: asyncio.Queue = asyncio.Queue()
    for index in range(total_requests):
        queue.put_nowait(prompts[index % len(prompts)])
    timings: list[RequestTiming] = []

    async def client() -> None:
        while not queue.empty():
            prompt_id, prompt = queue.get_nowait()
            timings.append(await send(prompt_id, prompt))

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return timings, time.perf_counter() - started


def _percentiles(values: list[float], scale: float = 1000.0) -> dict:
    if not values:
        return {"p50": None, "p99": None}
    return {"p50": float(np.percentile(values, 50)) * scale, "p99": float(np.percentile(values, 99)) * scale}


def summarize_load(protocol: str, concurrency: int, timings: list[RequestTiming], wall: float) -> dict:
    good = [timing for timing in timings if timing.error is None]
    tokens = sum(timing.tokens for timing in good)
    stats = [timing.stats for timing in good if timing.stats]
    return {
        "protocol": protocol, "concurrency": concurrency, "requests": len(timings),
        "errors": len(timings) - len(good), "wall_seconds": wall, "output_tokens": tokens,
        "tokens_per_second": tokens / wall if wall else 0.0, "requests_per_second": len(good) / wall if wall else 0.0,
        "ttft_ms": _percentiles([t.first_token_seconds for t in good if t.first_token_seconds is not None]),
        "tpot_ms": _percentiles([t.time_per_output_token for t in good if t.time_per_output_token is not None]),
        "token_latency_ms": _percentiles([latency for t in good for latency in t.token_latencies]),
        "longest_gap_ms": max((t.longest_gap_seconds for t in good), default=0.0) * 1000.0,
        "acceptance_rate": float(np.mean([s.get("acceptance_rate", 0.0) for s in stats])) if stats else None,
        "tokens_per_target_pass": float(np.mean([s.get("mean_accepted_per_pass", 0.0) for s in stats])) if stats else None,
        "first_error": next((t.error for t in timings if t.error), None),
    }


def markdown(result: dict) -> str:
    meta, settings = result["meta"], result["settings"]
    lines = [f"# hetspec serving benchmark: {settings['label']}", "",
             f"- grpc {settings['grpc']}, http {settings['http']}, model {settings['model']}",
             f"- {settings['requests']} requests per level, {settings['max_new_tokens']} new tokens, task "
             f"{settings['task']}, options {settings['options']}",
             f"- machine {report.describe_machine(meta['machine'])}; date {meta['date']}, "
             f"commit {meta['git_commit']}", f"- command: `{meta['command']}`", ""]
    if result.get("note"):
        lines += [f"> {result['note']}", ""]
    lines += ["| protocol | clients | requests | errors | tok/s | req/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | "
              "TPOT p99 ms | token p50 ms | token p99 ms | longest gap ms | acceptance | tokens/target pass |",
              "|" + "---|" * 15]
    for row in result["levels"]:
        def number(value, digits=1):
            return "-" if value is None else f"{value:.{digits}f}"
        lines.append(f"| {row['protocol']} | {row['concurrency']} | {row['requests']} | {row['errors']} | "
                     f"{number(row['tokens_per_second'], 2)} | {number(row['requests_per_second'], 3)} | "
                     f"{number(row['ttft_ms']['p50'])} | {number(row['ttft_ms']['p99'])} | "
                     f"{number(row['tpot_ms']['p50'])} | {number(row['tpot_ms']['p99'])} | "
                     f"{number(row['token_latency_ms']['p50'])} | {number(row['token_latency_ms']['p99'])} | "
                     f"{number(row.get('longest_gap_ms'))} | {number(row['acceptance_rate'], 2)} | "
                     f"{number(row['tokens_per_target_pass'], 2)} |")
    measured = [row for row in result["levels"] if row.get("cpu")]
    if measured:
        lines += ["", "CPU time by process over each level (share of what the machine's cores give in its wall time; "
                  "benchmarks/cpu_by_process.py):", ""]
        for row in measured:
            cpu = row["cpu"]
            lines.append(f"- {row['protocol']} x{row['concurrency']}: busy {cpu['busy_share']:.0%} of "
                         f"{cpu['cores']} cores; " + ", ".join(f"{group} {share['share']:.1%}"
                                                            for group, share in cpu["groups"].items()))
    paired = [row for row in result["levels"] if row.get("overhead")]
    if paired:
        lines += ["", "Server against the library in this process, concurrency 1, each request through both in turn "
                  "(ms per output token, prefill included):", "",
                  "| protocol | requests | library ms/token | server ms/token | server / library | library tok/s | "
                  "library tokens/target pass | same tokens |", "|" + "---|" * 8]
        for row in paired:
            cost = row["overhead"]
            lines.append(f"| {row['protocol']} | {row['requests']} | {cost['library_ms_per_token']:.1f} | "
                         f"{cost['server_ms_per_token']:.1f} | {cost['server_over_library']:.3f} | "
                         f"{cost['library_tokens_per_second']:.2f} | {cost['library_tokens_per_target_pass']:.2f} | "
                         f"{'yes' if cost['identical_tokens'] else 'NO'} |")
        differences = [(row, item) for row in paired for item in row.get("differences", [])]
        lines += [""] if differences else []
        for row, item in differences:
            lines.append(f"- {row['protocol']} {item['prompt_id']}: first differs at token {item['position']} "
                         f"(server {item['server_id']}, library {item['library_id']}); the target's top-2 logit "
                         f"margin there {item['target_top2_margin']:.4g} (ids {item['target_top2_ids']}, "
                         "one prefill of the library's prefix)")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--protocol", choices=["grpc", "http", "both"], default="both")
    parser.add_argument("--grpc", default="127.0.0.1:9000", help="host:port of Serve's gRPC proxy")
    parser.add_argument("--http", default="http://127.0.0.1:8000", help="base URL of the HTTP proxy")
    parser.add_argument("--application", help="Serve application name, sent as gRPC 'application' metadata")
    parser.add_argument("--model", help="OpenAI model id (default: the first of GET /v1/models)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4], help="client counts to run")
    parser.add_argument("--requests", type=int, default=8, help="requests per protocol and client count")
    parser.add_argument("--task", choices=TASKS, default="humaneval")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--algorithm", default="", help="auto, ar, sd, slem, tli, slrs; empty: server default")
    parser.add_argument("--draft-tokens", type=int)
    parser.add_argument("--pipelined", choices=["on", "off"], help="per-request pipelining (default: server's)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured requests per protocol first")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per HTTP request")
    parser.add_argument("--library", type=Path, help="a Serve config (e.g. deployments/config.yaml): run its pair "
                        "in this process too, before each concurrency-1 request, and report the server's overhead")
    parser.add_argument("--label", default="serve", help="names the result folder (e.g. pipelined-2replicas)")
    parser.add_argument("--note", default="")
    parser.add_argument("--out", type=Path)
    return parser.parse_args(argv)


async def first_model(client) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def run_protocols(args: argparse.Namespace, options: RequestOptions, prompts: list[tuple[str, str]],
                        library: InProcess | None = None) -> tuple[list[dict], str | None]:
    import httpx

    levels, model = [], args.model
    protocols = ["grpc", "http"] if args.protocol == "both" else [args.protocol]
    async with httpx.AsyncClient(base_url=args.http, timeout=args.timeout) as client:
        for protocol in protocols:
            if protocol == "http":
                model = model or await first_model(client)
                send = lambda pid, text: http_request(client, model, pid, text, options)  # noqa: E731
                channel = None
            else:
                import grpc

                from protos.hetspec.v1 import hetspec_pb2_grpc

                channel = grpc.aio.insecure_channel(args.grpc)
                stub = hetspec_pb2_grpc.HetSpecStub(channel)
                metadata = (("application", args.application),) if args.application else None
                send = lambda pid, text: grpc_request(stub, metadata, pid, text, options)  # noqa: E731
            try:
                for _ in range(args.warmup):
                    await send(*prompts[0])
                    if library is not None:
                        library.request(*prompts[0])
                for concurrency in args.concurrency:
                    level: dict = {}
                    before = cpu_by_process.snapshot()
                    if library is not None and concurrency == 1:
                        timings, library_timings, wall = await run_paired(send, library, prompts, args.requests)
                        level = {"overhead": overhead(timings, library_timings),
                                 "differences": paired_differences(library, prompts, timings, library_timings),
                                 "library_timings": [asdict(timing) for timing in library_timings]}
                    else:
                        timings, wall = await run_load(send, prompts, concurrency, args.requests)
                    level["cpu"] = cpu_by_process.spent(before, cpu_by_process.snapshot(), wall)
                    levels.append({**summarize_load(protocol, concurrency, timings, wall), **level,
                                   "timings": [asdict(timing) for timing in timings]})
                    print(f"{protocol} x{concurrency}: {levels[-1]['tokens_per_second']:.2f} tok/s, "
                          f"{levels[-1]['errors']} errors", file=sys.stderr)
            finally:
                if channel is not None:
                    await channel.close()
    return levels, model


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    options = RequestOptions(args.max_new_tokens, args.temperature, args.algorithm, args.draft_tokens,
                             None if args.pipelined is None else args.pipelined == "on")
    prompts = [(case.prompt_id, case.text) for case in load_prompts(args.task, args.num_prompts)]
    meta = report.provenance(argv, "server", module="benchmarks.serve_bench")
    library = InProcess(args.library, options) if args.library else None
    levels, model = asyncio.run(run_protocols(args, options, prompts, library))
    result = {"meta": meta, "note": args.note,
              "settings": {"label": args.label, "grpc": args.grpc, "http": args.http, "model": model,
                           "requests": args.requests, "max_new_tokens": args.max_new_tokens, "task": args.task,
                           "options": asdict(options), "library": str(args.library) if args.library else None},
              "levels": levels}
    folder = args.out or RESULTS_DIR / f"serve-{args.label}-{datetime.datetime.now():%Y%m%d-%H%M}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (folder / "results.md").write_text(markdown(result))
    print(folder / "results.md")
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
