"""Served throughput by concurrency: the batching server against the target alone, speculation off and the
unbatched server, in one run on the same prompts and threads.

    python -m benchmarks.serve_scaling --config deployments/config.yaml --target-dtype float32 \
        --baseline-commit 4661b7f --out benchmarks/results/serve-scaling-f32

Steps, one after the other (never two at once on this machine):
1. ``hf-batched``: transformers' ``generate`` of the target alone, greedy, on a left-padded batch of the first
   c prompts, for each concurrency c (what a user gets without a server);
2. the server of this checkout (``serve run`` of the config, with deployments/cpu.env): at each concurrency in
   turn, ``serve_bench`` with the config's speculation (gRPC and HTTP), then with ``algorithm: ar``
   (speculation off, gRPC); with ``--pipelined-too`` then with per-request pipelining on (gRPC,
   ``served-pipelined``);
3. the server of ``--baseline-commit`` (a git worktree; the unbatched server) with the config's speculation;
4. with ``--hf-after``, step 1 again (``hf-batched-after``): this shared machine's speed drifts (the same
   in-process decoding took 15 s and 22 s twenty minutes apart), and the server's levels sit between the two
   transformers runs; the ratios to transformers are then to the mean of both.
5. with ``--hf-beside``, step 1 also at each level right before the server's methods (``hf-beside``, in a
   process of its own while the server idles): measured minutes apart, not half an hour, so the ratio to it is
   the one drift moves least. It runs beside the idle server's processes, which a user of transformers alone
   would not have: that ratio leans towards the server, the one to steps 1 and 4 against it (a wave of 8 x 64
   tokens: transformers 45.1 s beside the idle server, 47.9 s alone minutes later, the server 43.0-43.4 s;
   the machine's drift larger than the idle server's cost).
7. with ``--versus-commit C``, this checkout's server against commit C's (a git worktree, its own config at the
   same path) with the config's speculation over gRPC, in ABBA order (this, C, C, this) at every level: each
   side's tokens/s and time per token, and the ratio of each pair measured side by side.
6. with ``--repeats n``, each level's server methods n times, the order reversed every other time (ABBA): a
   level's rows pool the repeats' requests, and each repeat's ratio to speculation off is reported, so a
   difference can be told from the drift between two runs of one method (10% a level in two runs of 16e42ca).

Each level sends ``--rounds`` times as many requests as clients (at least two), closed loop, ``--max-new-tokens``
each; transformers runs as many batches. One round is one wave: requests that finish apart leave the batch
underfull until the last one ends; more rounds refill it, as steady load does.
Writes result.json, README.md (tokens/s by method and concurrency, ratios, TTFT/TPOT) and throughput.png.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks import report
from benchmarks.batch_bench import hf_batched
from benchmarks.prompts import load_prompts
from benchmarks.serve_bench import RequestTiming, summarize_load
from deployments.runtime.cpu_env import cpu_env
from deployments.tools.local_serve import port_free

REPO = Path(__file__).resolve().parent.parent
HEALTH_TIMEOUT_S = 1200


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "deployments" / "config.yaml")
    parser.add_argument("--target-dtype", help="override the config's target dtype (e.g. float32)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--baseline-concurrency", type=int, nargs="+", default=[1, 4],
                        help="levels run on the baseline server (it serves one request at a time: slow)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1, help="requests per client at each level")
    parser.add_argument("--task", default="humaneval")
    parser.add_argument("--baseline-commit", help="the unbatched server's commit; omitted: not run")
    parser.add_argument("--versus-commit", help="another commit's server, measured against this checkout's in "
                        "ABBA order at every level (gRPC, the config's speculation); omitted: not run")
    parser.add_argument("--skip", nargs="*", default=[], choices=["hf", "server", "baseline"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--pipelined-too", action="store_true",
                        help="also the config's speculation with per-request pipelining on (gRPC): the drafter drafts "
                        "a request's next chunk while the target verifies, so both models work on different requests")
    parser.add_argument("--hf-after", action="store_true",
                        help="run transformers' batched generate again after the servers, to bracket the machine's drift")
    parser.add_argument("--hf-beside", action="store_true",
                        help="also run transformers' batched generate at each level, right before the server's "
                        "methods")
    parser.add_argument("--transformers-only", action="store_true",
                        help="only transformers' batched generate at --concurrency, into --out/hf.json (a level of "
                        "--hf-beside; --config is taken as it is)")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="also llama.cpp's batched greedy decoding of the target's GGUF at each concurrency "
                        "(benchmarks/llama_peer.py; needs llama-cpp-python), before the servers")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run each level's server methods this many times, the order reversed every other time")
    parser.add_argument("--reuse", action="store_true", help="keep the steps already measured in --out (hf.json, "
                        "raw/<label>-c<n>): a run cut short resumes where it stopped")
    args = parser.parse_args(argv)
    args.out, args.config = args.out.resolve(), args.config.resolve()  # the baseline runs in another folder
    return args


def served_config(args: argparse.Namespace, folder: Path, source: Path | None = None) -> Path:
    """``source`` (default ``--config``) with ``--target-dtype`` applied, written to ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    config = yaml.safe_load((source or args.config).read_text())
    app = config["applications"][0]["args"]
    if args.target_dtype:
        app["target"]["dtype"] = args.target_dtype
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def run_hf(args: argparse.Namespace, config: Path) -> dict:
    from hetspec import load_model

    target_config = yaml.safe_load(config.read_text())["applications"][0]["args"]["target"]
    import torch
    torch.set_num_threads(target_config.get("threads") or torch.get_num_threads())
    # the server's own kernels (hetspec/linear.py), so the comparison is of decoding, not of matrix libraries
    target = load_model(target_config["model"], dtype=target_config.get("dtype", "float32"),
                        linear=target_config.get("linear", "auto"))
    prompts = [case.text for case in load_prompts(args.task, max(args.concurrency))]
    hf_batched(target, prompts[:1], 4)  # warm-up
    levels = {}
    for concurrency in args.concurrency:
        repeats = max(2, concurrency) * args.rounds // concurrency  # batches: as many requests as the servers send
        tokens, seconds = 0, 0.0
        for _ in range(repeats):
            made, took, _ = hf_batched(target, prompts[:concurrency], args.max_new_tokens)
            tokens, seconds = tokens + made, seconds + took
        levels[concurrency] = {"tokens_per_second": tokens / seconds, "output_tokens": tokens, "wall_seconds": seconds}
        print(f"hf-batched c={concurrency}: {tokens / seconds:.2f} tok/s", flush=True)
    del target
    gc.collect()
    return levels


def hf_levels(args: argparse.Namespace, config: Path, file: str) -> dict:
    """``run_hf``'s levels, kept in ``file`` under --out (read back from there with --reuse)."""
    cached = args.out / file
    if args.reuse and cached.exists():
        return {int(c): row for c, row in json.loads(cached.read_text()).items()}
    levels = run_hf(args, config)
    cached.write_text(json.dumps(levels, indent=1) + "\n")
    return levels


def run_llama(args: argparse.Namespace, config: Path) -> dict:
    """llama.cpp decoding the target's GGUF, the first c prompts in one batch, at each concurrency c, as many
    requests as the servers send (the peer of a served level: llama-server -np c without its HTTP costs)."""
    from benchmarks import llama_peer

    if not llama_peer.available():
        print(llama_peer.INSTALL_HINT, file=sys.stderr)
        return {}
    target_config = yaml.safe_load(config.read_text())["applications"][0]["args"]["target"]
    peer = llama_peer.LlamaCppPeer(llama_peer.gguf_of(target_config["model"]), target_config.get("threads") or 2,
                                   set())
    prompts = [peer.llm.tokenize(case.text.encode(), add_bos=True)
               for case in load_prompts(args.task, max(args.concurrency))]
    levels = {}
    for concurrency in args.concurrency:
        batch = llama_peer.LlamaCppBatch(peer, concurrency, max(map(len, prompts)) + args.max_new_tokens + 1)
        try:
            batch.generate(prompts[:1], 4)  # warm-up
            tokens, seconds = 0, 0.0
            for _ in range(max(2, concurrency) * args.rounds // concurrency):
                tick = time.perf_counter()
                outputs = batch.generate(prompts[:concurrency], args.max_new_tokens)
                tokens, seconds = tokens + sum(map(len, outputs)), seconds + time.perf_counter() - tick
        finally:
            batch.close()
        levels[concurrency] = {"tokens_per_second": tokens / seconds, "output_tokens": tokens, "wall_seconds": seconds,
                               "settings": peer.settings()}
        print(f"llama.cpp c={concurrency}: {tokens / seconds:.2f} tok/s", flush=True)
    del peer
    gc.collect()
    return levels


SERVED_PORTS = (8000, 9000)  # the configs' HTTP and gRPC ports


def in_own_session(command: list[str], **popen: object) -> subprocess.Popen:
    """``command`` in a session (and process group) of its own, SIGINT at its default: a benchmark started in the
    background of a script (``nohup ... &``) inherits SIGINT ignored (POSIX), and so did `serve run`, whose Ctrl-C
    path (serve.shutdown()) then never ran: each stop waited out its timeout and ended in SIGKILL."""
    return subprocess.Popen(command, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **popen)


class Served:
    """``serve run`` of a config from a checkout, in its own process group; stopped by SIGINT (Serve's path)."""

    def __init__(self, checkout: Path, config: Path, log: Path, use_cpu_env: bool = True):
        # a server left running would answer the health check and be measured in this one's place (a `serve run`
        # left from a probe once ran beside a run's first transformers level)
        if taken := [port for port in SERVED_PORTS if not port_free(port)]:
            raise RuntimeError(f"ports {taken} are in use (another server?): stop it first")
        # the environment the checkout's scripts/main.sh gives `serve run` (none before deployments/cpu.env)
        env_file = checkout / "deployments" / "cpu.env"
        ray_env = cpu_env(env_file) if use_cpu_env and env_file.exists() else {}
        env = {**os.environ, "PYTHONPATH": str(checkout), "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **ray_env}
        self.log = log.open("w")
        self.log.write(f"# serve run {config} with {ray_env or 'no'} environment from deployments/cpu.env\n")
        self.log.flush()
        self.process = in_own_session([str(Path(sys.executable).parent / "serve"), "run", str(config)],
                                      cwd=checkout, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def __enter__(self) -> "Served":
        import httpx
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"serve run exited ({self.process.returncode}): see {self.log.name}")
            try:
                if httpx.get("http://127.0.0.1:8000/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(5)
        raise TimeoutError(f"the server was not healthy within {HEALTH_TIMEOUT_S} s: see {self.log.name}")

    def __exit__(self, *exc) -> None:
        os.killpg(self.process.pid, signal.SIGINT)
        try:
            self.process.wait(180)
        except subprocess.TimeoutExpired:
            print(f"serve run did not stop within 180 s of SIGINT: killed (see {self.log.name})", file=sys.stderr)
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)
        subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"], capture_output=True)
        self.log.close()


def hf_beside(args: argparse.Namespace, config: Path, concurrency: int) -> dict:
    """Transformers' level at ``concurrency`` in a process of its own (its memory goes when it ends), the
    server idle meanwhile."""
    out = args.out / "raw" / f"hf-beside-c{concurrency}"
    if not (args.reuse and (out / "hf.json").exists()):
        subprocess.run([sys.executable, "-m", "benchmarks.serve_scaling", "--transformers-only", "--config",
                        str(config), "--concurrency", str(concurrency), "--rounds", str(args.rounds),
                        "--max-new-tokens", str(args.max_new_tokens), "--task", args.task, "--out", str(out)],
                       cwd=REPO, check=True)
    return json.loads((out / "hf.json").read_text())[str(concurrency)]


def level_folder(label: str, concurrency: int, repeat: int) -> str:
    """Where a method's level (and repeat) keeps its serve_bench results under raw/ (the first repeat unnumbered,
    as runs without --repeats wrote it, so --reuse reads those)."""
    return f"{label}-c{concurrency}" + (f"-r{repeat}" if repeat else "")


def bench(args: argparse.Namespace, label: str, concurrencies: list[int], protocol: str, algorithm: str,
          folder: Path, extra: tuple[str, ...] = (), warmup: bool = True, repeat: int = 0) -> dict:
    """serve_bench at each concurrency: {concurrency: {protocol: level row}}; ``warmup``: one request first."""
    levels: dict = {}
    for concurrency in concurrencies:
        out = folder / level_folder(label, concurrency, repeat)
        if args.reuse and (out / "results.json").exists():
            rows = json.loads((out / "results.json").read_text())["levels"]
            levels[concurrency] = {row["protocol"]: row for row in rows}
            continue
        command = [sys.executable, "-m", "benchmarks.serve_bench", "--protocol", protocol, "--concurrency",
                   str(concurrency), "--requests", str(max(2, concurrency) * args.rounds), "--max-new-tokens",
                   str(args.max_new_tokens), "--task", args.task, "--num-prompts", str(max(args.concurrency)),
                   "--warmup", "1" if warmup and concurrency == concurrencies[0] else "0", "--label", label,
                   "--out", str(out)]
        if algorithm:
            command += ["--algorithm", algorithm]
        subprocess.run(command + list(extra), cwd=REPO, check=True)
        rows = json.loads((out / "results.json").read_text())["levels"]
        levels[concurrency] = {row["protocol"]: row for row in rows}
        print(label, concurrency, {p: round(r["tokens_per_second"], 2) for p, r in levels[concurrency].items()},
              flush=True)
    return levels


def pooled(rows: list[dict]) -> dict:
    """One level's rows from several repeats as one: every request's timings over the repeats' summed wall time,
    and each repeat's tokens/s."""
    if len(rows) == 1:
        return rows[0]
    timings = [RequestTiming(**timing) for row in rows for timing in row["timings"]]
    level = summarize_load(rows[0]["protocol"], rows[0]["concurrency"], timings,
                           sum(row["wall_seconds"] for row in rows))
    return level | {"tokens_per_second_by_repeat": [row["tokens_per_second"] for row in rows]}


def markdown(result: dict) -> str:
    meta, methods = result["meta"], result["methods"]
    lines = [f"# Served throughput by concurrency ({result['settings']['pair']})", "",
             f"Command: `{meta['command']}`  ", f"Commit: {meta['git_commit']}, {meta['date']}  ",
             f"Machine: {report.describe_machine(meta['machine'])}  ",
             f"Baseline (unbatched server): {result['settings']['baseline_commit']}", "",
             "Total output tokens per second over each level (closed-loop clients, greedy, "
             f"{result['settings']['max_new_tokens']} new tokens, HumanEval prompts):", ""]
    names = list(methods)
    levels = result["settings"]["concurrency"]
    transformers = "hf-batched (mean of both runs)" if "hf-batched-after" in methods else "hf-batched"
    beside = "hf-beside" in methods
    repeated = any("tokens_per_second_by_repeat" in row for row in methods.get("served-grpc", {}).values())
    llama = "llama.cpp-batched" in methods
    lines += ["| clients | " + " | ".join(names) + f" | served / 1 client | served / {transformers} | "
              + ("served / hf-beside | " if beside else "") + ("served / llama.cpp | " if llama else "")
              + "served / spec off |" + (" served / spec off, each repeat |" if repeated else ""),
              "|" + "---|" * (len(names) + 4 + beside + llama + repeated)]
    served = methods.get("served-grpc", {})
    for concurrency in levels:
        cells = [f"{methods[name][concurrency]['tokens_per_second']:.2f}" if concurrency in methods[name] else "-"
                 for name in names]

        def ratio(*others: str) -> str:  # to the mean of the others' measurements of this level
            mine = served.get(concurrency)
            theirs = [methods[other][concurrency]["tokens_per_second"] for other in others
                      if concurrency in methods.get(other, {})]
            return f"{mine['tokens_per_second'] * len(theirs) / sum(theirs):.2f}x" if mine and theirs else "-"

        scale = (f"{served[concurrency]['tokens_per_second'] / served[levels[0]]['tokens_per_second']:.2f}x"
                 if concurrency in served and levels[0] in served else "-")
        lines.append(f"| {concurrency} | " + " | ".join(cells) + f" | {scale} | {ratio('hf-batched', 'hf-batched-after')} | "
                     + (f"{ratio('hf-beside')} | " if beside else "")
                     + (f"{ratio('llama.cpp-batched')} | " if llama else "") + f"{ratio('served-ar-grpc')} |"
                     + (f" {each_repeat(methods, concurrency)} |" if repeated else ""))
    lines += ["", "Latency of the batching server (ms, p50 / p99; the longest wait between two chunks of any "
              "request):", "",
              "| clients | method | TTFT | TPOT | longest gap | tokens per target pass |", "|---|---|---|---|---|---|"]
    for name in ("served-grpc", "served-http", "served-ar-grpc"):
        for concurrency, row in methods.get(name, {}).items():
            gap = f"{row['longest_gap_ms']:.0f}" if row.get("longest_gap_ms") is not None else "-"
            lines.append(f"| {concurrency} | {name} | {row['ttft_ms']['p50']:.0f} / "
                         f"{row['ttft_ms']['p99']:.0f} | {row['tpot_ms']['p50']:.0f} / {row['tpot_ms']['p99']:.0f} | "
                         f"{gap} | {row['tokens_per_target_pass'] or 0:.2f} |")
    return "\n".join(lines + versus_table(result)) + "\n"


def versus(args: argparse.Namespace) -> dict:
    """{"this-grpc" and "versus-grpc": {concurrency: pooled row}}: this checkout's server and --versus-commit's, each
    with its own config, in ABBA order (one server start per side and turn: this, versus twice, this)."""
    rows: dict[str, dict[int, list[dict]]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        worktree = Path(scratch) / "versus"
        subprocess.run(["git", "worktree", "add", "--detach", str(worktree), args.versus_commit], cwd=REPO, check=True)
        try:
            for label, checkout, repeats in (("this", REPO, [0]), ("versus", worktree, [0, 1]), ("this", REPO, [1])):
                config = served_config(args, args.out / label, checkout / args.config.relative_to(REPO))
                with Served(checkout, config, args.out / f"serve-{label}-{repeats[0]}.log"):
                    for repeat in repeats:
                        levels = bench(args, label, args.concurrency, "grpc", "", args.out / "raw",
                                       warmup=repeat == repeats[0], repeat=repeat)
                        for concurrency, by_protocol in levels.items():
                            rows.setdefault(label, {}).setdefault(concurrency, []).append(by_protocol["grpc"])
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO)
    return {f"{label}-grpc": {concurrency: pooled(level) for concurrency, level in levels.items()}
            for label, levels in rows.items()}


def versus_table(result: dict) -> list[str]:
    """This checkout's server against --versus-commit's, per level: tokens/s, TPOT p50, the pooled ratio and each
    side-by-side pair's (A1/B1 and A2/B2 of the ABBA order)."""
    methods, commit = result["methods"], result["settings"].get("versus_commit")
    if not commit or "this-grpc" not in methods:
        return []
    lines = ["", f"This checkout's server against {commit}'s (gRPC, each its own config; ABBA: this, {commit}, "
             f"{commit}, this):", "", "| clients | this tok/s | versus tok/s | this / versus | each pair | "
             "TPOT p50 ms this / versus |", "|---|---|---|---|---|---|"]
    for concurrency, mine in methods["this-grpc"].items():
        theirs = methods["versus-grpc"][concurrency]
        pairs = zip(mine.get("tokens_per_second_by_repeat", []), theirs.get("tokens_per_second_by_repeat", []))
        lines.append(f"| {concurrency} | {mine['tokens_per_second']:.2f} | {theirs['tokens_per_second']:.2f} | "
                     f"{mine['tokens_per_second'] / theirs['tokens_per_second']:.3f}x | "
                     + ", ".join(f"{a / b:.3f}x" for a, b in pairs) + f" | {mine['tpot_ms']['p50']:.0f} / "
                     f"{theirs['tpot_ms']['p50']:.0f} |")
    return lines


def each_repeat(methods: dict, concurrency: int) -> str:
    """The served (gRPC) over speculation off ratio of each repeat of a level, the two measured back to back."""
    served = methods.get("served-grpc", {}).get(concurrency, {}).get("tokens_per_second_by_repeat", [])
    spec_off = methods.get("served-ar-grpc", {}).get(concurrency, {}).get("tokens_per_second_by_repeat", [])
    return ", ".join(f"{mine / theirs:.2f}x" for mine, theirs in zip(served, spec_off)) or "-"


def plot(result: dict, path: Path) -> None:
    series = {name: [(c, row["tokens_per_second"]) for c, row in sorted(levels.items())]
              for name, levels in result["methods"].items()}
    report.line_plot(series, result["settings"]["concurrency"], "concurrent clients",
                     "output tokens per second (all clients)",
                     f"{result['settings']['pair']}, greedy, {result['settings']['max_new_tokens']} new tokens", path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = report.provenance(argv, "cpu", "benchmarks.serve_scaling")  # at the start: its commit and load average
    if args.transformers_only:
        hf_levels(args, args.config, "hf.json")
        return 0
    config = served_config(args, args.out)
    app = yaml.safe_load(config.read_text())["applications"][0]["args"]
    methods: dict[str, dict] = {}
    if "hf" not in args.skip:
        methods["hf-batched"] = hf_levels(args, config, "hf.json")
    if args.llama_cpp:
        cached = args.out / "llama-cpp.json"
        if args.reuse and cached.exists():
            methods["llama.cpp-batched"] = {int(c): row for c, row in json.loads(cached.read_text()).items()}
        elif levels := run_llama(args, config):
            methods["llama.cpp-batched"] = levels
            cached.write_text(json.dumps(levels, indent=1) + "\n")
    runs = [("served", "both", "", ()), ("served-ar", "grpc", "ar", ())] + (
        [("served-pipelined", "grpc", "", ("--pipelined", "on"))] if args.pipelined_too else [])

    def measured(label: str, level: int) -> bool:
        return args.reuse and all((args.out / "raw" / level_folder(label, level, repeat) / "results.json").exists()
                                  for repeat in range(args.repeats))

    if "server" not in args.skip:
        with (contextlib.nullcontext() if all(measured(run[0], level) for run in runs for level in args.concurrency)
              else Served(REPO, config, args.out / "serve.log")):
            # a level's methods back to back, not one method over every level: this machine's speed drifts by
            # 10-16% in a run, which fell between speculation on and off when each ran all its levels in turn
            for concurrency in args.concurrency:
                first = concurrency == args.concurrency[0]
                if args.hf_beside and "hf" not in args.skip:
                    methods.setdefault("hf-beside", {})[concurrency] = hf_beside(args, config, concurrency)
                level_rows: dict[str, list[dict]] = {}
                for repeat in range(args.repeats):
                    for label, protocol, algorithm, extra in runs if repeat % 2 == 0 else runs[::-1]:
                        measured_level = bench(args, label, [concurrency], protocol, algorithm, args.out / "raw",
                                               extra, warmup=first and repeat == 0, repeat=repeat)
                        for served_protocol, row in measured_level[concurrency].items():
                            level_rows.setdefault(f"{label}-{served_protocol}", []).append(row)
                for name, rows in level_rows.items():
                    methods.setdefault(name, {})[concurrency] = pooled(rows)
    if args.baseline_commit and "baseline" not in args.skip:
        with tempfile.TemporaryDirectory() as scratch:
            worktree = Path(scratch) / "baseline"
            subprocess.run(["git", "worktree", "add", "--detach", str(worktree), args.baseline_commit], cwd=REPO,
                           check=True)
            try:
                with Served(worktree, config, args.out / "serve-baseline.log"):
                    old = bench(args, "unbatched", args.baseline_concurrency, "grpc", "", args.out / "raw")
                    methods["unbatched-server-grpc"] = {c: rows["grpc"] for c, rows in old.items()}
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO)
    if args.versus_commit:
        methods.update(versus(args))
    if args.hf_after and "hf" not in args.skip:
        methods["hf-batched-after"] = hf_levels(args, config, "hf-after.json")
    result = {"meta": meta,
              "settings": {"pair": f"{app['target']['model']} ({app['target']['dtype']}) <- {app['drafter']['model']}",
                           "concurrency": args.concurrency, "max_new_tokens": args.max_new_tokens,
                           "baseline_commit": args.baseline_commit, "versus_commit": args.versus_commit,
                           "speculation": app.get("speculation")},
              "methods": methods}
    report.write_result(args.out, result, markdown(result))
    plot(result, args.out / "throughput.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
