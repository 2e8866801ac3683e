"""Where a served worker's model work runs, and what it costs: one token of a model, by thread setup.

    OMP_NUM_THREADS=1 python -m benchmarks.model_threads_bench --model smollm2-135m --quantize int8

Each setting loads the model anew in a fresh process (libgomp's teams and MKL's thread counts are
per process) with OMP_NUM_THREADS=1, as Ray sets it for an actor with ``num_cpus`` 1 or less. It then
times single-token forwards (KV cache, 200-token context):
- ``loading thread``: the forwards on the thread that loaded the model, as the library runs in process;
- ``second thread``: loaded on one thread, run on another. Each thread that runs a parallel region keeps
  its own libgomp team, so the teams outnumber the CPUs. This is what a worker did before
  deployments/runtime/model_threads.py;
- ``first lane``: ``ModelThreads`` (loads on its first lane, runs there), alone;
- ``first lane after a burst``: the same after two calls at once (a side lane came and went);
- ``first lane, other requests in flight``: a one-thread share, as while the other model holds requests;
- ``batched, from the callers' threads``: two requests decoding through ``hetspec.passes.SharedPasses`` (one pass
  of 2 rows per token, as a served worker batches them) driven from two caller threads, the way an actor's
  call threads would drive it without ``ModelThreads``; ms per pass;
- ``batched, on ModelThreads``: the same with the passes on ``ModelThreads`` (``execute=lanes.run``), as
  deployments/workers/model_workers.py runs them;
- ``first lane beside leftover lanes``: ``first lane`` while ``LEFTOVER_LANES`` other ``ModelThreads`` live on, each
  with the team of a parallel op it ran: what in-process workers never shut down (``_Worker.shutdown``) leave.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

SETTINGS = ["loading thread", "second thread", "first lane", "first lane after a burst",
            "first lane, other requests in flight", "batched, from the callers' threads", "batched, on ModelThreads",
            "first lane beside leftover lanes"]
CALLERS = 2  # requests decoding together in the batched settings
LEFTOVER_LANES = 22  # the workers a run of the test suite had left running before they were shut down after each test


def _token_ms(language_model, tokens: int) -> float:
    """Milliseconds per token of ``KVSession.extend``, one token at a time: the drafter's step."""
    session = language_model.new_session()
    try:
        next_id = int(session.extend(list(range(100, 300)), logits_to_keep=1)[-1].argmax())  # a 200-token context
        started = time.perf_counter()
        for _ in range(tokens):
            next_id = int(session.extend([next_id], logits_to_keep=1)[-1].argmax())
        return (time.perf_counter() - started) / tokens * 1000
    finally:
        session.release()


def _decode(session, first_id: int, tokens: int):
    """One request's greedy decoding as ``SharedPasses`` computations take it: a Feed per token."""
    from hetspec.kv import Feed

    next_id = first_id
    for _ in range(tokens):
        logits = yield Feed(session, [next_id])
        next_id = int(logits[-1].argmax())
    return next_id


def _prefill(session, offset: int):
    from hetspec.kv import Feed

    logits = yield Feed(session, list(range(100 + offset, 300 + offset)))  # a 200-token context
    return int(logits[-1].argmax())


def _batched_pass_ms(passes, language_model, tokens: int) -> float:
    """Milliseconds per shared pass while ``CALLERS`` requests decode ``tokens`` tokens each from their own
    threads (a pass feeds one token of every request)."""
    sessions = [language_model.new_session() for _ in range(CALLERS)]
    try:
        with ThreadPoolExecutor(CALLERS) as callers:
            first = list(callers.map(lambda index: passes.run(_prefill(sessions[index], index)), range(CALLERS)))
            list(callers.map(lambda index: passes.run(_decode(sessions[index], first[index], 3)), range(CALLERS)))
            started, before = time.perf_counter(), passes.passes
            list(callers.map(lambda index: passes.run(_decode(sessions[index], first[index], tokens)),
                             range(CALLERS)))
            return (time.perf_counter() - started) / (passes.passes - before) * 1000
    finally:
        for session in sessions:
            session.release()


def measure(setting: str, model_id: str, quantize: str, threads: int, tokens: int, dtype: str = "float32") -> float:
    """Milliseconds per token in this process for ``setting``."""
    from deployments.runtime.model_threads import ModelThreads
    from hetspec.models import load_model

    def load():
        return load_model(model_id, dtype=dtype, quantize=quantize, threads=threads)

    if setting == "batched, from the callers' threads":
        from hetspec.passes import SharedPasses

        model = ThreadPoolExecutor(1).submit(load).result()
        return _batched_pass_ms(SharedPasses(model), model, tokens)
    if setting in ("loading thread", "second thread"):
        loader, runner = ThreadPoolExecutor(1), ThreadPoolExecutor(1)
        model = loader.submit(load).result()
        pool = loader if setting == "loading thread" else runner
        pool.submit(_token_ms, model, 3).result()
        return pool.submit(_token_ms, model, tokens).result()
    at_other_model = [0]
    lanes = ModelThreads("bench", lanes=2, threads=threads, at_other_model=lambda: at_other_model[0])
    model = lanes.run(load)[0]
    lanes.run(_token_ms, model, 3)
    if setting == "first lane after a burst":
        with ThreadPoolExecutor(2) as callers:
            list(callers.map(lambda _: lanes.run(_token_ms, model, 10), range(2)))
    if setting == "first lane, other requests in flight":
        at_other_model[0] = 1
    if setting == "first lane beside leftover lanes":
        import torch

        leftover = [ModelThreads(f"leftover{index}", lanes=1, threads=threads) for index in range(LEFTOVER_LANES)]
        for other in leftover:
            other.run(lambda: torch.ones(512, 512) @ torch.ones(512, 512))  # a parallel op: the lane's team
    if setting == "batched, on ModelThreads":
        from hetspec.passes import SharedPasses

        return _batched_pass_ms(SharedPasses(model, execute=lanes.run), model, tokens)
    return lanes.run(_token_ms, model, tokens)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--quantize", default="int8", choices=["none", "int8", "int8-weight-only"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the model's dtype (int8 quantization loads float32 whatever this says)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per setting")
    parser.add_argument("--setting", help=argparse.SUPPRESS)  # one measurement, in a child process
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    if args.setting:
        print(json.dumps(measure(args.setting, args.model, args.quantize, args.threads, args.tokens, args.dtype)))
        return
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    results = {}
    for setting in SETTINGS:
        runs = []
        for _ in range(args.repeats):
            child = subprocess.run([sys.executable, "-m", "benchmarks.model_threads_bench", "--setting", setting,
                                    "--model", args.model, "--quantize", args.quantize, "--dtype", args.dtype,
                                    "--threads", str(args.threads), "--tokens", str(args.tokens)],
                                   env=environment, capture_output=True, text=True, check=True)
            runs.append(json.loads(child.stdout.strip().splitlines()[-1]))
        results[setting] = sorted(runs)[len(runs) // 2]
        print(f"| {setting} | {results[setting]:.1f} | {', '.join(f'{run:.1f}' for run in runs)} |", flush=True)
    if args.out:
        with open(args.out, "w") as out:
            json.dump({"model": args.model, "quantize": args.quantize, "dtype": args.dtype,
                       "threads": args.threads, "tokens": args.tokens, "ms_per_token_median": results}, out, indent=2)


if __name__ == "__main__":
    main()
