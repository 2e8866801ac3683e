"""Milliseconds of one batched pass, padded against packed (hetspec/layouts.py), by the widths of its feeds.

Each case is a list of feed widths, one row each, every row after its own context of ``--context`` tokens:
``1x8`` is eight decoding rows, ``1x7+21`` seven decoding rows and a prompt's last chunk of 21 tokens. Both
layouts run case by case, interleaved, best of ``--repeats``, on one loaded model; the logits of the two are
compared. ``auto`` is the layout ``hetspec.forward.forward`` picks.

    python -m benchmarks.layout_cost --model qwen2.5-coder-1.5b --dtype float32 --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from hetspec import load_model
from hetspec.forward import PACK_ABOVE_PADDING, forward
from hetspec.kv import Feed

CASES = ["1x1", "1x8", "4x8", "1x4+2x2+4x2", "1x7+21", "1x7+128", "4x7+21", "128"]


def widths(case: str) -> list[int]:
    """'1x7+21' -> [1] * 7 + [21]"""
    out: list[int] = []
    for part in case.split("+"):
        width, _, count = part.partition("x")
        out += [int(width)] * int(count or 1)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=150)
    parser.add_argument("--cases", nargs="+", default=CASES)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(args.model, args.dtype, threads=args.threads)
    rows = max(len(widths(case)) for case in args.cases)
    sessions = [model.new_session() for _ in range(rows)]
    for index, session in enumerate(sessions):  # contexts of different tokens, as different requests
        session.extend([1000 + index + step for step in range(args.context)], 1)
    print(f"{args.model} {args.dtype}, {args.threads} threads, context {args.context} tokens a row")
    print("case            tokens  padded ms  packed ms  packed/padded  auto    max |logit difference|")
    for case in args.cases:
        feed_widths = widths(case)
        best = {False: float("inf"), True: float("inf")}
        logits = {}
        for _ in range(args.repeats):
            for packed in (False, True):
                feeds = [Feed(session, [2000 + step for step in range(width)], width)
                         for session, width in zip(sessions, feed_widths)]
                tick = time.perf_counter()
                logits[packed] = forward(model, feeds, packed=packed)
                best[packed] = min(best[packed], time.perf_counter() - tick)
                for session in sessions:
                    session.rollback(args.context)
        difference = max(float((padded - packed).abs().max()) for padded, packed in zip(logits[False], logits[True]))
        auto = "packed" if len(feed_widths) * max(feed_widths) > PACK_ABOVE_PADDING * sum(feed_widths) else "padded"
        print(f"{case:14s}  {sum(feed_widths):6d}  {best[False] * 1000:9.0f}  {best[True] * 1000:9.0f}  "
              f"{best[True] / best[False]:13.2f}  {auto:6s}  {difference:.3g}", flush=True)
    for session in sessions:
        session.release()


if __name__ == "__main__":
    main()
