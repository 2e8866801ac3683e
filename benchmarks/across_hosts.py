"""Served across hosts with their own network stacks, by round-trip time: what a millisecond between the
drafter, the target and the coordinator costs, and how much step pipelining recovers.

    sudo .venv/bin/python -m benchmarks.across_hosts --config deployments/config.yaml --rtt-ms 0 1 5 20 \
        --concurrency 1 4 --pipelined off on --fixed-draft-tokens 5 --max-new-tokens 32 --library \
        --out benchmarks/results/across-hosts

Three hosts in network namespaces (cluster/netns/hosts.py; root): the coordinator on host 1, the drafter on
host 2, the target on host 3, every packet between them held by the delay forwarder for RTT/2. For each
pipelining setting the config is deployed once; then, over the RTTs forward and back (``--repeats``: drift between
cells cancels in the pooled figures), for each RTT (changed on the running forwarder) and each concurrency,
closed-loop HTTP clients send greedy completions of HumanEval prompts. Reported per cell: output
tokens/s, tokens per target pass, the time per target pass, the extra time per pass over RTT 0 (what the
network costs a step), and the bytes on the wire per target pass between the coordinator and each model's
host (counted by the forwarder, from which an idle period's rate is subtracted). With ``--library`` the same
requests run in this process first, one at a time, as the reference. Writes result.json and README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import yaml

from benchmarks import report
from benchmarks.prompts import load_prompts
from cluster.netns.delay import DelaySettings
from cluster.netns.hosts import TestHosts, namespaces_can_be_made, test_hosts

APP = "hetspec"
ROLE_HOSTS = {"coordinator": 1, "drafter": 2, "target": 3}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("deployments/config.yaml"))
    parser.add_argument("--rtt-ms", type=float, nargs="+", default=[0.0, 1.0, 5.0, 20.0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--pipelined", choices=["off", "on"], nargs="+", default=["off", "on"])
    parser.add_argument("--num-prompts", type=int, default=4, help="HumanEval prompts (every 16th)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--cpus-per-host", type=int, default=2, help="Ray CPUs each host offers")
    parser.add_argument("--repeats", type=int, default=2,
                        help="passes over the RTTs, every other one in reverse order (drift cancels in the pooled "
                             "cells)")
    parser.add_argument("--fixed-draft-tokens", type=int, default=None,
                        help="load-adaptive off, every step drafts this many: the network's cost alone, not the "
                             "policy's answer to it")
    parser.add_argument("--library", action="store_true", help="also the same requests in process, alone")
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args(argv)


def hosts_config(path: Path, pipelined: bool, fixed_draft_tokens: int | None = None) -> dict:
    """The config with each pipeline member pinned to its host and the proxy on the head's addresses."""
    config = yaml.safe_load(path.read_text())
    config["http_options"] = {"host": "0.0.0.0", "port": 8000}
    args = config["applications"][0]["args"]
    if fixed_draft_tokens is not None:
        args["speculation"] = {**args.get("speculation", {}), "load_adaptive": False,
                               "draft_tokens": fixed_draft_tokens}
    args["pipeline"] = {**args.get("pipeline", {}), "placement_strategy": "STRICT_SPREAD", "pipelined": pipelined}
    for role, index in ROLE_HOSTS.items():
        resources = args.setdefault(f"{role}_resources", {})
        resources["resources"] = {f"host_{index}": 1.0}
    return config


def deploy(hosts: TestHosts, config: dict, timeout_s: float = 1200.0) -> None:
    httpx.put(f"{hosts.dashboard_url}/api/serve/applications/", json=config, timeout=60).raise_for_status()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{hosts.http_url}/health", timeout=10).status_code == 200:
                status = httpx.get(f"{hosts.dashboard_url}/api/serve/applications/", timeout=30).json()
                if status["applications"][APP]["status"] == "RUNNING":
                    return
        except (httpx.HTTPError, KeyError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the app was not healthy after {timeout_s} s")
        time.sleep(2.0)


def complete(hosts: TestHosts, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "hetspec": {"ignore_eos": True}}
    response = httpx.post(f"{hosts.http_url}/v1/completions", json=body, timeout=600)
    response.raise_for_status()
    return response.json()["hetspec"]


def wire_between(hosts: TestHosts) -> dict[str, int]:
    """Bytes so far between the coordinator's host and each model's host (both directions)."""
    counted = hosts.network.wire_bytes()
    coordinator, drafter, target = (host.address for host in hosts.network.hosts)
    pair = lambda a, b: counted.get((a, b), 0) + counted.get((b, a), 0)  # noqa: E731
    return {"coordinator-drafter": pair(coordinator, drafter), "coordinator-target": pair(coordinator, target),
            "drafter-target": pair(drafter, target)}


def run_cell(hosts: TestHosts, model: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    """Every prompt once per client slot, closed loop; wall time, tokens, target passes, wire bytes."""
    work = [prompts[i % len(prompts)] for i in range(max(len(prompts), 2 * concurrency))]
    time.sleep(0.3)
    wire_before, started = wire_between(hosts), time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda prompt: complete(hosts, model, prompt, max_tokens), work))
    wall = time.monotonic() - started
    time.sleep(0.3)  # the forwarder rewrites its counts every 0.1 s
    wire_after = wire_between(hosts)
    tokens = sum(len(result["token_ids"]) for result in results)
    passes = sum(result["stats"]["target_forwards"] for result in results)
    return {"requests": len(results), "wall_s": wall, "tokens": tokens, "target_passes": passes,
            "tokens_per_s": tokens / wall, "tokens_per_pass": tokens / max(passes, 1),
            "wire_bytes": {key: wire_after[key] - wire_before[key] for key in wire_after},
            "token_ids": [result["token_ids"] for result in results]}


def idle_wire_rate(hosts: TestHosts, seconds: float = 10.0) -> dict[str, float]:
    """Bytes per second between the hosts with no request running (Ray's heartbeats, metrics, health)."""
    before = wire_between(hosts)
    time.sleep(seconds)
    after = wire_between(hosts)
    return {key: (after[key] - before[key]) / seconds for key in after}


def library_reference(config_path: Path, prompts: list[str], max_tokens: int) -> dict:
    from deployments.config import AppConfig
    from hetspec import Engine, SamplingParams, load_model

    args = AppConfig.model_validate(yaml.safe_load(config_path.read_text())["applications"][0]["args"])
    target = load_model(args.target.model, dtype=args.target.dtype)
    drafter = load_model(args.drafter.model, dtype=args.drafter.dtype, quantize=args.drafter.quantize)
    engine = Engine(target, drafter, args.speculation)
    params = SamplingParams(max_new_tokens=max_tokens, ignore_eos=True)
    started = time.monotonic()
    outputs = [engine.generate(prompt, params) for prompt in prompts]
    wall = time.monotonic() - started
    tokens = sum(len(output.token_ids) for output in outputs)
    return {"tokens_per_s": tokens / wall, "tokens_per_pass": tokens / sum(o.stats.target_forwards for o in outputs),
            "token_ids": {prompt: output.token_ids for prompt, output in zip(prompts, outputs)}}


def pooled(cells: list[dict]) -> list[dict]:
    """The repeats of each (pipelining, RTT, clients) cell summed: tokens/s over their whole wall time."""
    groups: dict[tuple, list[dict]] = {}
    for cell in cells:
        groups.setdefault((cell["pipelined"], cell["rtt_ms"], cell["concurrency"]), []).append(cell)
    rows = []
    for (pipelined, rtt, concurrency), repeats in sorted(groups.items(), key=lambda item: (
            item[0][0] != "off", item[0][1], item[0][2])):
        wall, tokens = sum(c["wall_s"] for c in repeats), sum(c["tokens"] for c in repeats)
        passes = sum(c["target_passes"] for c in repeats)
        wire = {key: sum(c["wire_bytes_per_pass"][key] * c["target_passes"] for c in repeats) / max(passes, 1)
                for key in repeats[0]["wire_bytes_per_pass"]}
        rows.append({"pipelined": pipelined, "rtt_ms": rtt, "concurrency": concurrency, "wall_s": wall,
                     "tokens": tokens, "target_passes": passes, "tokens_per_s": tokens / wall,
                     "tokens_per_pass": tokens / max(passes, 1), "wire_bytes_per_pass": wire,
                     "tokens_per_s_by_repeat": [round(c["tokens_per_s"], 2) for c in repeats]})
    return rows


def markdown(result: dict) -> str:
    lines = ["| pipelined | RTT ms | clients | tokens/s | each repeat | / RTT 0 | tokens per target pass "
             "| ms per target pass | extra ms per pass over RTT 0 "
             "| wire bytes per pass (coordinator-drafter / -target) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    rows = pooled(result["cells"])
    for cell in rows:
        base = next(c for c in rows if c["pipelined"] == cell["pipelined"]
                    and c["concurrency"] == cell["concurrency"] and c["rtt_ms"] == min(result["rtt_ms"]))
        ms_per_pass = 1000 * cell["wall_s"] * cell["concurrency"] / max(cell["target_passes"], 1)
        base_ms = 1000 * base["wall_s"] * base["concurrency"] / max(base["target_passes"], 1)
        wire = cell["wire_bytes_per_pass"]
        repeats = ", ".join(f"{value:.2f}" for value in cell["tokens_per_s_by_repeat"])
        lines.append(f"| {cell['pipelined']} | {cell['rtt_ms']:g} | {cell['concurrency']} | "
                     f"{cell['tokens_per_s']:.2f} | {repeats} | {cell['tokens_per_s'] / base['tokens_per_s']:.3f} | "
                     f"{cell['tokens_per_pass']:.2f} | {ms_per_pass:.0f} | {ms_per_pass - base_ms:+.0f} | "
                     f"{wire['coordinator-drafter']:.0f} / {wire['coordinator-target']:.0f} |")
    if "library" in result:
        lines.append(f"\nLibrary in process, one request at a time: {result['library']['tokens_per_s']:.2f} "
                     f"tokens/s, {result['library']['tokens_per_pass']:.2f} tokens per target pass.")
    lines.append(f"\nIdle wire rate (bytes/s, subtracted): {result['idle_wire_rate']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    why_not = namespaces_can_be_made()
    if why_not:
        raise SystemExit(f"across_hosts needs network namespaces: {why_not}")
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = [case.text for case in load_prompts("humaneval", args.num_prompts, stride=16)]
    model = yaml.safe_load(args.config.read_text())["applications"][0]["args"]["model_id"]
    result: dict = {"provenance": report.provenance(sys.argv[1:] if argv is None else argv, "cpu",
                                                    module="benchmarks.across_hosts"),
                    "rtt_ms": args.rtt_ms, "cells": []}
    if args.library:
        result["library"] = library_reference(args.config, prompts, args.max_new_tokens)
    with test_hosts(3, one_way_ms=0.0, prefix="hetspec-b", num_cpus=args.cpus_per_host,
                    workdir=Path(tempfile.mkdtemp(prefix="hsn", dir="/tmp"))) as hosts:
        hosts.ray.start()
        for pipelined in args.pipelined:
            deploy(hosts, hosts_config(args.config, pipelined == "on", args.fixed_draft_tokens))
            result["idle_wire_rate"] = idle_wire_rate(hosts)
            run_cell(hosts, model, prompts[:1], 1, 8)  # warm-up: the first request's one-off costs
            order = [rtt for repeat in range(args.repeats)
                     for rtt in (args.rtt_ms[::-1] if repeat % 2 else args.rtt_ms)]
            for rtt in order:
                hosts.network.set_delay(DelaySettings(one_way_ms=rtt / 2))
                time.sleep(0.5)  # the forwarder re-reads its settings every 0.1 s
                measured_rtt = hosts.network.rtt_ms(hosts.network.hosts[0], hosts.network.hosts[2])
                for concurrency in args.concurrency:
                    cell = run_cell(hosts, model, prompts, concurrency, args.max_new_tokens)
                    idle = {key: rate * cell["wall_s"] for key, rate in result["idle_wire_rate"].items()}
                    cell["wire_bytes_per_pass"] = {key: (value - idle[key]) / max(cell["target_passes"], 1)
                                                   for key, value in cell["wire_bytes"].items()}
                    cell.update(pipelined=pipelined, rtt_ms=rtt, measured_rtt_ms=measured_rtt,
                                concurrency=concurrency)
                    result["cells"].append(cell)
                    print(json.dumps({k: v for k, v in cell.items() if k != "token_ids"}), flush=True)
    if args.library:
        reference = result["library"]["token_ids"]
        work_prompts = lambda cell: [prompts[i % len(prompts)] for i in range(cell["requests"])]  # noqa: E731
        result["same_tokens_as_library"] = all(
            ids == reference[prompt] for cell in result["cells"] for prompt, ids in zip(work_prompts(cell),
                                                                                        cell["token_ids"]))
    report.write_result(args.out, result, markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
