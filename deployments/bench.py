"""Per-token latency of the Serve app over gRPC against the library in process, at concurrency 1.

    RAY_AUTH_MODE=disabled PYTHONPATH=. python deployments/bench.py --config deployments/config.yaml

Same models, dtypes and thread counts on both sides (the config's, or --threads), same prompts, greedy. First the
library (``Engine.generate``) in this process, then a new local Ray instance serving the config's app:
every prompt over gRPC without and with pipelining (interleaved, so load drift hits both alike). Prints
ms per token, the ratios, tokens/s and whether every output is the library's token for token.
"""

from __future__ import annotations

import argparse
import gc
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


def library_runs(config, prompts: list[str], max_new_tokens: int, algorithm: str) -> list:
    from hetspec import Engine, SamplingParams, SpeculationConfig, load_model

    # One process, one torch thread pool: the target's thread count (load_model sets it process-wide).
    drafter = load_model(config.drafter.model, dtype=config.drafter.dtype, device=config.drafter.device,
                         threads=config.target.threads)
    target = load_model(config.target.model, dtype=config.target.dtype, device=config.target.device,
                        threads=config.target.threads)
    engine = Engine(target, drafter)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    speculation = SpeculationConfig(algorithm=algorithm, draft_tokens=config.speculation.draft_tokens)
    engine.generate(prompts[0], SamplingParams(max_new_tokens=4), speculation=speculation)  # warm-up
    results = []
    for prompt in prompts:
        started = time.perf_counter()
        result = engine.generate(prompt, params, speculation=speculation)
        results.append((result.token_ids, time.perf_counter() - started, result.stats.to_dict()))
    del engine, target, drafter
    gc.collect()
    return results


def serve_runs(args_dict: dict, grpc_servicers: list[str], prompts: list[str], max_new_tokens: int,
               algorithm: str) -> dict[bool, list]:
    import grpc
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions

    from deployments.app import build_app
    from protos.hetspec.v1 import hetspec_pb2 as pb
    from protos.hetspec.v1 import hetspec_pb2_grpc as pb_grpc

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    grpc_port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": _free_port()},
                grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=grpc_servicers))
    serve.run(build_app(args_dict), name="hetspec", route_prefix="/")
    results: dict[bool, list] = {False: [], True: []}
    try:
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = pb_grpc.HetSpecStub(channel)
            stub.Generate(pb.GenerateRequest(prompt=prompts[0], max_new_tokens=4, algorithm=algorithm), timeout=600)
            for prompt in prompts:
                for pipelined in (False, True):
                    request = pb.GenerateRequest(prompt=prompt, max_new_tokens=max_new_tokens, algorithm=algorithm,
                                                 pipelined=pipelined)
                    started = time.perf_counter()
                    response = stub.Generate(request, timeout=600)
                    results[pipelined].append((list(response.token_ids), time.perf_counter() - started,
                                               response.stats))
    finally:
        serve.shutdown()
        ray.shutdown()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="deployments/config.yaml")
    parser.add_argument("--prompts", type=int, default=3, help=f"how many of the {len(PROMPTS)} prompts")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--algorithm", default="slem")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of both models on both sides (default: the config's)")
    options = parser.parse_args()

    from deployments.config import AppConfig

    document = yaml.safe_load(Path(options.config).read_text())
    args_dict = document["applications"][0]["args"]
    if options.threads:
        for role in ("target", "drafter"):
            args_dict[role] = {**args_dict[role], "threads": options.threads}
    config = AppConfig.model_validate(args_dict)
    prompts = PROMPTS[:options.prompts]
    library = library_runs(config, prompts, options.max_new_tokens, options.algorithm)
    served = serve_runs(args_dict, document["grpc_options"]["grpc_servicer_functions"], prompts,
                        options.max_new_tokens, options.algorithm)

    def per_token_ms(runs) -> float:
        return 1000 * sum(seconds for _, seconds, _ in runs) / sum(len(ids) for ids, _, _ in runs)

    base = per_token_ms(library)
    print(f"config={options.config} algorithm={options.algorithm} prompts={len(prompts)} "
          f"max_new_tokens={options.max_new_tokens} target={config.target.model} drafter={config.drafter.model} "
          f"dtype={config.target.dtype}")
    print(f"{'runtime':28s} {'ms/token':>9s} {'vs library':>10s} {'tokens/s':>9s}  identical")
    print(f"{'library in process':28s} {base:9.1f} {1.0:10.2f} {1000 / base:9.2f}  -")
    for pipelined in (False, True):
        runs = served[pipelined]
        ms = per_token_ms(runs)
        same = all(ids == reference for (ids, _, _), (reference, _, _) in zip(runs, library))
        name = f"serve gRPC, pipelined={pipelined}"
        print(f"{name:28s} {ms:9.1f} {ms / base:10.2f} {1000 / ms:9.2f}  {same}")
        hits = sum(stats.pipeline_hits for _, _, stats in runs)
        misses = sum(stats.pipeline_misses for _, _, stats in runs)
        accepted = statistics.mean(stats.mean_accepted_per_pass for _, _, stats in runs)
        print(f"    tokens per target pass {accepted:.2f}, pipeline hits {hits}, misses {misses}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
