"""Where a batch's time goes: prompt (prefill) against decoding, transformers' padded batch against the library.

At 8 clients the server trails transformers' batched ``generate`` by ~10%, and a third of each request is before
its first token. This splits both, in one process, on the same loaded target and prompts, methods in turn:

- transformers: ``generate`` of the left-padded batch for 1 new token (its padded prefill) and for ``1 + steps``;
  a decoding pass is the difference over ``steps``;
- the library (hetspec/kv.py ``forward``): the prompts packed into one pass, or one prompt a pass (as the
  server's ``_Lockstep`` feeds them: one long feed per pass), then ``steps`` decoding passes of one token a row.

Greedy ids are not compared here (the batch benchmarks do); this prices passes.

    python -m benchmarks.batch_split --batch 8 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.batch_bench import hf_batched
from benchmarks.prompts import load_prompts
from hetspec import load_model
from hetspec.forward import forward
from hetspec.kv import Feed


def library_batch(target, prompt_ids: list[list[int]], packed: bool, steps: int) -> tuple[float, float]:
    """(prefill seconds, median seconds of a decoding pass over every row)."""
    sessions = [target.new_session() for _ in prompt_ids]
    try:
        tick = time.perf_counter()
        if packed:
            logits = forward(target, [Feed(session, list(ids), 1) for session, ids in zip(sessions, prompt_ids)])
        else:
            logits = [forward(target, [Feed(session, list(ids), 1)])[0] for session, ids in zip(sessions, prompt_ids)]
        prefill = time.perf_counter() - tick
        next_ids = [int(row[-1].argmax()) for row in logits]
        passes = []
        for _ in range(steps):
            tick = time.perf_counter()
            logits = forward(target, [Feed(session, [token], 1) for session, token in zip(sessions, next_ids)])
            passes.append(time.perf_counter() - tick)
            next_ids = [int(row[-1].argmax()) for row in logits]
        return prefill, statistics.median(passes) if passes else 0.0
    finally:
        for session in sessions:
            session.release()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--task", default="humaneval")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=24, help="decoding passes timed per method and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_model(args.model, args.dtype, threads=args.threads)
    prompts = [case.text for case in load_prompts(args.task, args.batch)]
    prompt_ids = [target.encode_prompt(prompt) for prompt in prompts]
    print(f"prompt tokens {[len(ids) for ids in prompt_ids]}: {sum(map(len, prompt_ids))} real, "
          f"{args.batch * max(map(len, prompt_ids))} padded")
    hf_batched(target, prompts[:1], 2)  # warm-up
    for round_ in range(args.rounds):
        _, prefill, _ = hf_batched(target, prompts, 1)
        _, whole, _ = hf_batched(target, prompts, 1 + args.steps)
        decoding = (whole - prefill) / args.steps
        print(f"round {round_}: transformers padded prefill {prefill:.2f} s, decoding pass {decoding:.3f} s")
        for packed in (True, False):
            prefill, decoding = library_batch(target, prompt_ids, packed, args.steps if packed else 0)
            layout = "packed prefill" if packed else "one prompt a pass"
            passes = f", decoding pass {decoding:.3f} s" if packed else ""
            print(f"round {round_}: hetspec {layout} {prefill:.2f} s{passes}", flush=True)


if __name__ == "__main__":
    main()
