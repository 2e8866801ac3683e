"""Throughput by batch size: hetspec's batched speculative decoding against plain batched decoding.

One run, one process, the methods interleaved per batch size (order rotated), on the first N prompts of a
task, greedy, ``--max-new-tokens`` each (EOS ends a request early; only tokens up to EOS count):

- ``hf-batched``: transformers ``target.generate`` on one left-padded batch of the B prompts (the peer);
- ``hetspec-ar``: ``Engine.generate_batch`` with speculation off (plain batched decoding, hetspec's loop);
- ``hetspec-<alg>``: ``Engine.generate_batch`` with the algorithm at a fixed draft length;
- ``hetspec-<alg>-adaptive``: the same with the load-adaptive draft length (``load_adaptive``);
- ``hetspec-<alg>-k<K>``: the algorithm at another fixed draft length K (``--also-draft-tokens``): would a shorter
  draft pay at a batch size where the adaptive policy (which chooses 0 or the request's own k) stops drafting?
- ``hetspec-<alg>-one-at-a-time``: ``Engine.generate`` per prompt, one after the other (today's serving), timed
  once per prompt; batch B's figure is its first B prompts' tokens over their summed seconds.

Writes result.json, README.md (table, ratios) and throughput.png into ``--out``.

    python -m benchmarks.batch_bench --out benchmarks/results/batch-realistic
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.prompts import load_prompts
from benchmarks import report
from benchmarks.report import provenance
from hetspec import Engine, SamplingParams, SpeculationConfig, load_model
from hetspec.config import BatchingConfig
from hetspec.models import QUANTIZE


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.batch_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--drafter", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--drafter-quantize", default="int8", choices=QUANTIZE)
    parser.add_argument("--algorithm", default="slem")
    parser.add_argument("--draft-tokens", type=int, default=5)
    parser.add_argument("--confidence-threshold", type=float, default=0.0,
                        help="SpeculationConfig.confidence_threshold of every drafting method (config.yaml: 0.5)")
    parser.add_argument("--also-draft-tokens", type=int, nargs="+", default=[],
                        help="more fixed draft lengths, each its own method hetspec-<alg>-k<K>")
    parser.add_argument("--task", default="humaneval")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bit-exact", action="store_true",
                        help="load the target with bit_exact (hetspec/exact.py): its cost against a run without")
    parser.add_argument("--bit-exact-beside", action="store_true",
                        help="also a second copy of the target loaded with bit_exact: methods hetspec-ar-exact and "
                             "hetspec-<alg>-exact interleaved with the others (bit_exact's cost in one run)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--skip-one-at-a-time", action="store_true",
                        help="leave out the one-request-at-a-time method (its 8 sequential requests dominate the run)")
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args(argv)


def counted(token_ids: list[int], eos_ids: frozenset[int]) -> int:
    """Generated tokens up to and including the first EOS."""
    for index, token_id in enumerate(token_ids):
        if token_id in eos_ids:
            return index + 1
    return len(token_ids)


def hf_batched(target, prompts: list[str], max_new_tokens: int) -> tuple[int, float, list[list[int]]]:
    tokenizer = target.tokenizer
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(target.eos_token_ids)
    encoded = [target.encode_prompt(prompt) for prompt in prompts]
    width = max(len(ids) for ids in encoded)
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in encoded])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded])
    tick = time.perf_counter()
    with torch.inference_mode():
        output = target.model.generate(input_ids.to(target.device), attention_mask=mask.to(target.device),
                                       max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad,
                                       eos_token_id=sorted(target.eos_token_ids))
    seconds = time.perf_counter() - tick
    rows = [row[width:].tolist() for row in output]
    rows = [row[:counted(row, target.eos_token_ids)] for row in rows]
    return sum(len(row) for row in rows), seconds, rows


def hetspec_batched(engine: Engine, prompts: list[str], params: SamplingParams,
                    speculation: SpeculationConfig) -> tuple[int, float, list[list[int]], list[dict]]:
    tick = time.perf_counter()
    results = engine.generate_batch(prompts, params, speculation=speculation)
    seconds = time.perf_counter() - tick
    return (sum(len(result.token_ids) for result in results), seconds, [result.token_ids for result in results],
            [result.stats.to_dict() for result in results])


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    meta = provenance(argv, args.device, "benchmarks.batch_bench")  # at the start: its commit and load average
    torch.set_num_threads(args.threads)
    target = load_model(args.target, args.dtype, args.device, args.threads, bit_exact=args.bit_exact)
    drafter = load_model(args.drafter, args.dtype, args.device, args.threads, quantize=args.drafter_quantize)
    largest = max(args.batch_sizes)
    engine = Engine(target, drafter, batching=BatchingConfig(max_batch_size=largest))
    exact_engine = None
    if args.bit_exact_beside:
        exact_target = load_model(args.target, args.dtype, args.device, args.threads, bit_exact=True)
        exact_engine = Engine(exact_target, drafter, batching=BatchingConfig(max_batch_size=largest))
    prompts = [case.text for case in load_prompts(args.task, largest)]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    algorithm = args.algorithm
    drafting = {"algorithm": algorithm, "confidence_threshold": args.confidence_threshold}
    fixed = SpeculationConfig(**drafting, draft_tokens=args.draft_tokens)
    adaptive = SpeculationConfig(**drafting, draft_tokens=args.draft_tokens, load_adaptive=True)
    plain = SpeculationConfig(algorithm="ar")
    others = {k: SpeculationConfig(**drafting, draft_tokens=k) for k in args.also_draft_tokens
              if k != args.draft_tokens}  # --draft-tokens runs as hetspec-<alg> already
    engine.generate_batch(prompts[:2], SamplingParams(max_new_tokens=4), speculation=fixed)  # warm-up
    if exact_engine is not None:
        exact_engine.generate_batch(prompts[:2], SamplingParams(max_new_tokens=4), speculation=fixed)
    hf_batched(target, prompts[:2], 4)

    one_at_a_time = []  # per prompt: (tokens, seconds, ids)
    for prompt in [] if args.skip_one_at_a_time else prompts:
        tick = time.perf_counter()
        result = engine.generate(prompt, params, speculation=fixed)
        one_at_a_time.append((len(result.token_ids), time.perf_counter() - tick, result.token_ids))

    rows = []
    for rotation, batch in enumerate(args.batch_sizes):
        chosen = prompts[:batch]
        methods = [
            ("hf-batched", lambda: hf_batched(target, chosen, args.max_new_tokens) + ([],)),
            ("hetspec-ar", lambda: hetspec_batched(engine, chosen, params, plain)),
            (f"hetspec-{algorithm}", lambda: hetspec_batched(engine, chosen, params, fixed)),
            (f"hetspec-{algorithm}-adaptive", lambda: hetspec_batched(engine, chosen, params, adaptive)),
        ] + [(f"hetspec-{algorithm}-k{k}", lambda speculation=speculation: hetspec_batched(
            engine, chosen, params, speculation)) for k, speculation in others.items()]
        if exact_engine is not None:
            methods += [("hetspec-ar-exact", lambda: hetspec_batched(exact_engine, chosen, params, plain)),
                        (f"hetspec-{algorithm}-exact", lambda: hetspec_batched(exact_engine, chosen, params, fixed))]
        methods = methods[rotation % len(methods):] + methods[:rotation % len(methods)]
        measured = {}
        for name, method in methods:
            tokens, seconds, token_ids, stats = method()
            measured[name] = {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds,
                              "token_ids": token_ids, "stats": stats}
        if one_at_a_time:
            tokens = sum(entry[0] for entry in one_at_a_time[:batch])
            seconds = sum(entry[1] for entry in one_at_a_time[:batch])
            measured[f"hetspec-{algorithm}-one-at-a-time"] = {
                "tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds,
                "token_ids": [entry[2] for entry in one_at_a_time[:batch]], "stats": []}
            reference = measured[f"hetspec-{algorithm}-one-at-a-time"]["token_ids"]
        else:  # batch 1's reference is then plain decoding's own output in this batch
            reference = measured["hetspec-ar"]["token_ids"]
        for name, entry in measured.items():
            entry["equal_to_batch_1"] = sum(ids == ref for ids, ref in zip(entry["token_ids"], reference))
            entry["mean_draft_length"] = (sum(stat["mean_draft_length"] for stat in entry["stats"]) / len(entry["stats"])
                                          if entry["stats"] else None)
        rows.append({"batch_size": batch, "methods": measured})
        print(json.dumps({"batch_size": batch, **{name: round(entry["tokens_per_second"], 2)
                                                   for name, entry in measured.items()}}), flush=True)
    return {"provenance": meta,
            "settings": {key: str(value) for key, value in vars(args).items()}, "rows": rows}


def markdown(result: dict, algorithm: str) -> str:
    names = list(result["rows"][0]["methods"])
    lines = [f"# Throughput by batch size ({result['settings']['target']} <- {result['settings']['drafter']})", "",
             f"Command: `{result['provenance']['command']}`  ", f"Commit: {result['provenance']['git_commit']} "
             f"(dirty: {result['provenance']['git_dirty']}), {result['provenance']['date']}  ",
             f"Machine: {report.describe_machine(result['provenance']['machine'])}, torch threads "
             f"{result['provenance']['machine']['torch_threads']}", "",
             "Tokens per second (generated tokens up to EOS, all requests of the batch, over the batch's wall time):",
             "", "| batch | " + " | ".join(names) + f" | hetspec-{algorithm} / hf-batched | "
             f"hetspec-{algorithm} / hetspec-ar | adaptive / hf-batched | adaptive / hetspec-ar | adaptive mean k |",
             "|---|" + "---|" * (len(names) + 5)]
    for row in result["rows"]:
        methods = row["methods"]
        rate = {name: methods[name]["tokens_per_second"] for name in names}
        fixed, adaptive = rate[f"hetspec-{algorithm}"], rate[f"hetspec-{algorithm}-adaptive"]
        mean_k = methods[f"hetspec-{algorithm}-adaptive"]["mean_draft_length"]
        lines.append(f"| {row['batch_size']} | " + " | ".join(f"{rate[name]:.2f}" for name in names)
                     + f" | {fixed / rate['hf-batched']:.2f}x | {fixed / rate['hetspec-ar']:.2f}x"
                     f" | {adaptive / rate['hf-batched']:.2f}x | {adaptive / rate['hetspec-ar']:.2f}x | {mean_k:.2f} |")
    if "hetspec-ar-exact" in names:
        lines += ["", "bit_exact's cost (the same target loaded with bit_exact, interleaved): tokens/s with it over "
                  "without; outputs equal between the two (greedy):", ""]
        for row in result["rows"]:
            methods = row["methods"]
            cells = []
            for plain in ("hetspec-ar", f"hetspec-{algorithm}"):
                exact = f"{plain}-exact"
                equal = sum(a == b for a, b in zip(methods[plain]["token_ids"], methods[exact]["token_ids"]))
                ratio = methods[exact]["tokens_per_second"] / methods[plain]["tokens_per_second"]
                cells.append(f"{exact} / {plain} {ratio:.3f}x ({equal}/{row['batch_size']} equal)")
            lines.append(f"- batch {row['batch_size']}: " + ", ".join(cells))
    lines += ["", "Requests whose tokens equal the one-at-a-time run's (or, without it, hetspec-ar's; greedy; a difference "
              "is a rounding tie):", ""]
    for row in result["rows"]:
        lines.append(f"- batch {row['batch_size']}: " + ", ".join(
            f"{name} {entry['equal_to_batch_1']}/{row['batch_size']}" for name, entry in row["methods"].items()))
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    sizes = [row["batch_size"] for row in result["rows"]]
    series = {name: [(row["batch_size"], row["methods"][name]["tokens_per_second"]) for row in result["rows"]]
              for name in result["rows"][0]["methods"]}
    report.line_plot(series, sizes, "batch size (requests decoded together)", "tokens per second",
                     f"{result['settings']['target']} <- {result['settings']['drafter']}, greedy, "
                     f"{result['settings']['max_new_tokens']} new tokens", path)


def main(argv: list[str] | None = None) -> int:
    import sys
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    result = run(args, argv)
    report.write_result(args.out, result, markdown(result, args.algorithm))
    plot(result, args.out / "throughput.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
