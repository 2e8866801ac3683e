"""Per-token latency of the Serve app over gRPC against the library in process, at concurrency 1.

    RAY_AUTH_MODE=disabled PYTHONPATH=. python deployments/bench.py --config deployments/config.yaml

Same models, dtypes and thread counts on both sides (the config's, or --threads), same prompts, greedy.
The library (``Engine.generate``) runs in this process, the app in a new local Ray instance; per prompt
the library, then gRPC without and with pipelining, so load drift hits all three alike. Prints ms per
token, the ratios, tokens/s, tokens per target pass, pipeline hits and misses, and whether every output
is the library's token for token.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPTS = [
    'def is_prime(n: int) -> bool:\n    """Return True if n is a prime number."""\n',
    "def merge_sorted(left: list[int], right: list[int]) -> list[int]:\n",
    "class Stack:\n    def __init__(self):\n",
    "import json\n\ndef load_config(path):\n",
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def library_engine(config):
    from hetspec import Engine, load_model

    # One process, one torch thread pool: the target's thread count (load_model sets it process-wide).
    drafter = load_model(config.drafter.model, dtype=config.drafter.dtype, device=config.drafter.device,
                         threads=config.target.threads)
    target = load_model(config.target.model, dtype=config.target.dtype, device=config.target.device,
                        threads=config.target.threads)
    return Engine(target, drafter)


def start_serve(args_dict: dict, grpc_servicers: list[str]) -> int:
    """A new local Ray instance serving the app; returns the gRPC port."""
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions

    from deployments.app import build_app

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    grpc_port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": _free_port()},
                grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=grpc_servicers))
    serve.run(build_app(args_dict), name="hetspec", route_prefix="/")
    return grpc_port


def interleaved_runs(engine, stub, prompts: list[str], max_new_tokens: int, algorithm: str,
                     draft_tokens: int) -> dict[str, list]:
    """Per prompt: the library, then gRPC without and with pipelining, so load drift hits all three alike."""
    from hetspec import SamplingParams, SpeculationConfig
    from protos.hetspec.v1 import hetspec_pb2 as pb

    params = SamplingParams(max_new_tokens=max_new_tokens)
    speculation = SpeculationConfig(algorithm=algorithm, draft_tokens=draft_tokens)
    engine.generate(prompts[0], SamplingParams(max_new_tokens=4), speculation=speculation)  # warm-up
    stub.Generate(pb.GenerateRequest(prompt=prompts[0], max_new_tokens=4, algorithm=algorithm), timeout=600)
    runs: dict[str, list] = {"library": [], "grpc": [], "grpc pipelined": []}
    for prompt in prompts:
        started = time.perf_counter()
        result = engine.generate(prompt, params, speculation=speculation)
        runs["library"].append((result.token_ids, time.perf_counter() - started, result.stats))
        for pipelined in (False, True):
            request = pb.GenerateRequest(prompt=prompt, max_new_tokens=max_new_tokens, algorithm=algorithm,
                                         draft_tokens=draft_tokens, pipelined=pipelined)
            started = time.perf_counter()
            response = stub.Generate(request, timeout=600)
            runs["grpc pipelined" if pipelined else "grpc"].append(
                (list(response.token_ids), time.perf_counter() - started, response.stats))
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="deployments/config.yaml")
    parser.add_argument("--prompts", type=int, default=3, help=f"how many of the {len(PROMPTS)} prompts")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--algorithm", default="slem")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of both models on both sides (default: the config's)")
    options = parser.parse_args()

    import grpc
    import ray
    from ray import serve

    from deployments.config import AppConfig
    from protos.hetspec.v1 import hetspec_pb2_grpc as pb_grpc

    document = yaml.safe_load(Path(options.config).read_text())
    args_dict = document["applications"][0]["args"]
    if options.threads:
        for role in ("target", "drafter"):
            args_dict[role] = {**args_dict[role], "threads": options.threads}
    config = AppConfig.model_validate(args_dict)
    prompts = PROMPTS[:options.prompts]
    engine = library_engine(config)
    grpc_port = start_serve(args_dict, document["grpc_options"]["grpc_servicer_functions"])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            runs = interleaved_runs(engine, pb_grpc.HetSpecStub(channel), prompts, options.max_new_tokens,
                                    options.algorithm, config.speculation.draft_tokens)
    finally:
        serve.shutdown()
        ray.shutdown()

    def per_token_ms(name: str) -> float:
        return 1000 * sum(seconds for _, seconds, _ in runs[name]) / sum(len(ids) for ids, _, _ in runs[name])

    base = per_token_ms("library")
    print(f"config={options.config} algorithm={options.algorithm} prompts={len(prompts)} "
          f"max_new_tokens={options.max_new_tokens} target={config.target.model} drafter={config.drafter.model} "
          f"dtype={config.target.dtype} threads={config.target.threads}")
    print(f"{'runtime':18s} {'ms/token':>9s} {'vs library':>10s} {'tokens/s':>9s} {'tok/pass':>8s} "
          f"{'hits':>5s} {'misses':>6s}  same tokens as library")
    for name in runs:
        ms = per_token_ms(name)
        same = all(ids == reference for (ids, _, _), (reference, _, _) in zip(runs[name], runs["library"]))
        passes = statistics.mean(stats.mean_accepted_per_pass for _, _, stats in runs[name])
        hits = sum(getattr(stats, "pipeline_hits", 0) for _, _, stats in runs[name])
        misses = sum(getattr(stats, "pipeline_misses", 0) for _, _, stats in runs[name])
        print(f"{name:18s} {ms:9.1f} {ms / base:10.2f} {1000 / ms:9.2f} {passes:8.2f} {hits:5d} {misses:6d}  {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
