"""Milliseconds of one target pass by tokens fed (after a 150-token context): is a wider pass nearly free?

Speculation and batching both pay only where feeding n tokens costs much less than n passes of one token.

    python -m benchmarks.pass_cost --model qwen2.5-coder-1.5b --dtype bfloat16 --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from hetspec import load_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 6, 8, 16, 32, 48])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(args.model, args.dtype, threads=args.threads)
    session = model.new_session()
    session.extend(list(range(1000, 1150)), 1)
    print("tokens  ms (best of repeats)")
    for size in args.sizes:
        best = float("inf")
        for _ in range(args.repeats):
            tick = time.perf_counter()
            session.extend(list(range(2000, 2000 + size)), 1)
            best = min(best, time.perf_counter() - tick)
            session.rollback(150)
        print(f"{size:6d}  {best * 1000:.0f}", flush=True)
    session.release()


if __name__ == "__main__":
    main()
