"""Milliseconds of one model pass by tokens fed (after a 150-token context): is a wider pass nearly free?

Speculation and batching both pay only where feeding n tokens costs much less than n passes of one token.
Several Linear kernels (``--linear``, hetspec/linear.py) are measured in one process, interleaved size by size,
on two loaded copies of the model; the logits of the context pass are compared between them.

    python -m benchmarks.pass_cost --model qwen2.5-coder-1.5b --dtype float32 --linear torch onednn --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from hetspec import load_model
from hetspec.models import QUANTIZE

CONTEXT = list(range(1000, 1150))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantize", default="none", choices=QUANTIZE)
    parser.add_argument("--linear", nargs="+", default=["auto"], choices=["auto", "onednn", "torch"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 6, 8, 16, 32, 48])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sessions, context_logits = {}, {}
    for linear in args.linear:
        model = load_model(args.model, args.dtype, threads=args.threads, quantize=args.quantize, linear=linear)
        sessions[linear] = model.new_session()
        context_logits[linear] = sessions[linear].extend(CONTEXT, 1).clone()  # [1, vocab]
    first = args.linear[0]
    for linear in args.linear[1:]:
        difference = float((context_logits[linear] - context_logits[first]).abs().max())
        print(f"max |logit difference| {linear} vs {first}: {difference:.3g}")
    print("tokens  " + "  ".join(f"{linear} ms" for linear in args.linear) + "  (best of repeats)")
    for size in args.sizes:
        best = {linear: float("inf") for linear in args.linear}
        for _ in range(args.repeats):
            for linear, session in sessions.items():
                tick = time.perf_counter()
                session.extend(list(range(2000, 2000 + size)), 1)
                best[linear] = min(best[linear], time.perf_counter() - tick)
                session.rollback(len(CONTEXT))
        print(f"{size:6d}  " + "  ".join(f"{best[linear] * 1000:9.0f}" for linear in args.linear), flush=True)
    for session in sessions.values():
        session.release()


if __name__ == "__main__":
    main()
