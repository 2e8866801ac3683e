"""Where the time of one hetspec generation goes.

    python -m benchmarks.profile_run --pair realistic --algorithm slem --draft-tokens 5 --out benchmarks/results/profile

Two timed runs of the same request after a warm-up: one with forward hooks only (an unbiased split
into target forwards, drafter forwards and everything else), one under cProfile (which slows Python
code, so its numbers say *what* the remainder is, not exactly how long it takes). Writes
breakdown.json, profile.txt (top functions) and profile.pstats (open with ``python -m pstats`` or snakeviz).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

from benchmarks import report
from benchmarks.bench import PAIRS
from benchmarks.meter import ForwardMeter
from benchmarks.prompts import TASKS, load_prompts
from hetspec import Engine, SamplingParams, SpeculationConfig, load_model

# cProfile rows grouped by what they are: (label, substrings of "file:function")
CATEGORIES = [
    ("tokenizer encode/decode", ("tokenization_utils", "tokenizers", "encode", "decode")),
    ("alignment (hetspec/align.py)", ("hetspec/align.py",)),
    ("verification (hetspec/verify.py, sampling.py)", ("hetspec/verify.py", "hetspec/sampling.py")),
    ("output text (hetspec/engine.py)", ("hetspec/engine.py",)),
    ("algorithms (hetspec/algorithms)", ("hetspec/algorithms",)),
    ("KV cache (hetspec/models.py, cache_utils)", ("hetspec/models.py", "cache_utils")),
    ("model forward (torch, transformers)", ("torch", "transformers")),
]


def categorize(stats: pstats.Stats) -> dict[str, float]:
    """Own time (tottime) of profiled functions summed by category; model code is what is left."""
    totals = {label: 0.0 for label, _ in CATEGORIES}
    totals["other"] = 0.0
    for (filename, _, function), (_, _, tottime, _, _) in stats.stats.items():
        key = f"{filename}:{function}"
        for label, marks in CATEGORIES:
            if any(mark in key for mark in marks):
                totals[label] += tottime
                break
        else:
            totals["other"] += tottime
    return totals


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", choices=sorted(PAIRS), default="realistic")
    parser.add_argument("--algorithm", default="slem")
    parser.add_argument("--draft-tokens", type=int, default=5)
    parser.add_argument("--adaptive", action="store_true")
    parser.add_argument("--task", choices=TASKS, default="humaneval")
    parser.add_argument("--prompt-index", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    target_name, drafter_name, dtype = PAIRS[args.pair]
    target = load_model(target_name, dtype=dtype, threads=args.threads)
    drafter = load_model(drafter_name, dtype=dtype, threads=args.threads)
    engine = Engine(target, drafter)
    case = load_prompts(args.task, 1, args.prompt_index)[0]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    speculation = SpeculationConfig(algorithm=args.algorithm, draft_tokens=args.draft_tokens, adaptive=args.adaptive)
    engine.generate(case.text, params.model_copy(update={"max_new_tokens": 16}), speculation=speculation)

    meters = {"target": ForwardMeter(target, target.device), "drafter": ForwardMeter(drafter, drafter.device)}
    started = time.perf_counter()
    result = engine.generate(case.text, params, speculation=speculation)
    wall = time.perf_counter() - started
    forward = {name: sum(call.seconds for call in meter.take()) for name, meter in meters.items()}
    stats = result.stats.to_dict()
    tokens = len(result.token_ids)

    profiler = cProfile.Profile()
    profiler.enable()
    engine.generate(case.text, params, speculation=speculation)
    profiler.disable()
    for meter in meters.values():
        meter.close()

    args.out.mkdir(parents=True, exist_ok=True)
    profiler.dump_stats(args.out / "profile.pstats")
    text = io.StringIO()
    profile_stats = pstats.Stats(profiler, stream=text)
    profile_stats.sort_stats("cumulative").print_stats(45)
    profile_stats.sort_stats("tottime").print_stats(45)
    (args.out / "profile.txt").write_text(text.getvalue())
    remainder = wall - forward["target"] - forward["drafter"]
    breakdown = {
        "meta": report.provenance(argv, "cpu", module="benchmarks.profile_run"), "prompt_id": case.prompt_id,
        "algorithm": args.algorithm, "draft_tokens": args.draft_tokens, "tokens": tokens, "wall_seconds": wall,
        "ms_per_token": 1000 * wall / tokens,
        "target_forward_seconds": forward["target"], "drafter_forward_seconds": forward["drafter"],
        "outside_forwards_seconds": remainder, "outside_forwards_ms_per_token": 1000 * remainder / tokens,
        "target_forward_ms_per_pass": 1000 * forward["target"] / stats["target_forwards"],
        "drafter_forward_ms_per_call": 1000 * forward["drafter"] / max(stats["drafter_forwards"], 1),
        "hetspec_stats": stats, "cprofile_own_time_by_category": categorize(profile_stats),
    }
    (args.out / "breakdown.json").write_text(json.dumps(breakdown, indent=1) + "\n")
    print(json.dumps({key: value for key, value in breakdown.items() if key != "meta"}, indent=1))
    return breakdown


if __name__ == "__main__":
    main()
