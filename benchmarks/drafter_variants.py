"""One drafter model in several variants (quantization x forward) against each other, in one process.

Each variant is the same drafter loaded with another ``quantize`` (none, int8, int8-weight-only) and ``forward``
(transformers, lean: hetspec/lean.py). Per variant, on the same loaded target and prompts:

- agreement: how often its next-token argmax equals the float32 drafter's, over each prompt followed by the
  target's own greedy output (teacher-forced, one pass): what decides how often its drafts are accepted;
- step: its one-token pass at the prompt's context (median over interleaved rounds);
- decoding: SLEM with it as the drafter, prompt by prompt, the variants and the target alone (`ar`) in rotating
  order: ms per output token, speedup over `ar` (geometric mean of the per-prompt ratios), tokens per target pass,
  drafter ms per forward, and whether every output equals `ar`'s.

    python -m benchmarks.drafter_variants --variants int8:transformers int8:lean int8-weight-only:lean \\
        --num-prompts 5 --out benchmarks/results/drafter-variants-smollm2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.analysis import geometric_mean
from benchmarks.prompts import load_prompts
from benchmarks.report import describe_machine, provenance
from hetspec import Engine, SamplingParams, SpeculationConfig, load_model
from hetspec.models import QUANTIZE, LanguageModel


def agreement(variant: LanguageModel, reference: LanguageModel, texts: list[str]) -> float:
    """Share of positions where ``variant``'s argmax equals ``reference``'s, over ``texts`` teacher-forced."""
    agree = total = 0
    for text in texts:
        ids = reference.encode_prompt(text)
        logits = []
        for model in (reference, variant):
            session = model.new_session()
            try:
                logits.append(session.extend(ids).argmax(-1))
            finally:
                session.release()
        agree += int((logits[0] == logits[1]).sum())
        total += len(ids)
    return agree / total


def step_seconds(model: LanguageModel, ids: list[int], repeats: int = 5) -> float:
    """Median of ``repeats`` one-token passes after ``ids`` (each rolled back)."""
    session = model.new_session()
    try:
        session.extend(ids[:-1], 1)
        samples = []
        for _ in range(repeats):
            tick = time.perf_counter()
            session.extend(ids[-1:], 1)
            samples.append(time.perf_counter() - tick)
            session.rollback(session.length - 1)
        return statistics.median(samples)
    finally:
        session.release()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--target-dtype", default="bfloat16")
    parser.add_argument("--drafter", default="smollm2-135m")
    parser.add_argument("--variants", nargs="+", default=["int8:transformers", "int8:lean", "int8-weight-only:lean"],
                        help=f"quantize:forward pairs; quantize from {QUANTIZE}, forward transformers or lean")
    parser.add_argument("--task", default="humaneval")
    parser.add_argument("--num-prompts", type=int, default=5)
    parser.add_argument("--prompt-stride", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft-tokens", type=int, default=5)
    parser.add_argument("--confidence-threshold", type=float, default=0.5)
    parser.add_argument("--step-rounds", type=int, default=8, help="interleaved rounds of one-token passes per prompt")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    meta = provenance(sys.argv[1:] if argv is None else argv, "cpu", "benchmarks.drafter_variants")
    target = load_model(args.target, dtype=args.target_dtype, threads=args.threads)
    reference = load_model(args.drafter, dtype="float32", forward="transformers")
    drafters = {}
    for variant in args.variants:
        quantize, forward = variant.split(":")
        drafters[variant] = load_model(args.drafter, quantize=quantize, forward=forward)
    speculation = SpeculationConfig(algorithm="slem", draft_tokens=args.draft_tokens,
                                    confidence_threshold=args.confidence_threshold)
    engines = {"ar": Engine(target, None, SpeculationConfig(algorithm="ar"))}
    engines.update({variant: Engine(target, drafter, speculation) for variant, drafter in drafters.items()})
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    cases = load_prompts(args.task, args.num_prompts, stride=args.prompt_stride)
    for engine in engines.values():  # warm-up
        engine.generate(cases[0].text, SamplingParams(max_new_tokens=8))
    runs = {name: [] for name in engines}
    for index, case in enumerate(cases):
        order = list(engines)[index % len(engines):] + list(engines)[:index % len(engines)]
        for name in order:
            tick = time.perf_counter()
            result = engines[name].generate(case.text, params)
            seconds = time.perf_counter() - tick
            stats = result.stats
            runs[name].append({"prompt": case.prompt_id, "seconds": seconds, "token_ids": result.token_ids,
                               "target_forwards": stats.target_forwards, "drafter_forwards": stats.drafter_forwards,
                               "drafter_seconds": stats.drafter_seconds, "accepted_tokens": stats.accepted_tokens,
                               "drafted_tokens": stats.drafted_tokens})
            print(f"{case.prompt_id} {name}: {seconds:.1f} s, {len(result.token_ids)} tokens, "
                  f"{stats.target_forwards} target passes", flush=True)
    texts = [case.text + target.tokenizer.decode(run["token_ids"]) for case, run in zip(cases, runs["ar"])]
    step_ids = reference.encode_prompt(texts[0])[:200]
    steps = {variant: [] for variant in drafters}
    for _ in range(args.step_rounds):
        for variant, drafter in drafters.items():
            steps[variant].append(step_seconds(drafter, step_ids))
    rows = []
    for name, records in runs.items():
        tokens = sum(len(run["token_ids"]) for run in records)
        ratios = [ar["seconds"] / len(ar["token_ids"]) / (run["seconds"] / len(run["token_ids"]))
                  for ar, run in zip(runs["ar"], records)]
        drafter_forwards = sum(run["drafter_forwards"] for run in records)
        rows.append({
            "variant": name, "ms_per_token": 1000 * sum(run["seconds"] for run in records) / tokens,
            "speedup_geo": geometric_mean(ratios), "tokens_per_target_pass": tokens / sum(
                run["target_forwards"] for run in records),
            "drafter_ms_per_forward": (1000 * sum(run["drafter_seconds"] for run in records) / drafter_forwards
                                       if drafter_forwards else None),
            "step_ms": 1000 * statistics.median(steps[name]) if name in steps else None,
            "agreement": agreement(drafters[name], reference, texts) if name in drafters else None,
            "same_as_ar": all(run["token_ids"] == ar["token_ids"] for ar, run in zip(runs["ar"], records))})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "settings": vars(args), "rows": rows,
                                                  "runs": runs, "step_seconds": steps}, indent=1))
    lines = [f"# Drafter variants: {args.drafter} drafting for {args.target} ({args.target_dtype})", "",
             f"- {len(cases)} {args.task} prompts (stride {args.prompt_stride}), {args.max_new_tokens} new tokens, "
             f"greedy, SLEM k={args.draft_tokens}, confidence threshold {args.confidence_threshold}",
             f"- machine: {describe_machine(meta['machine'])}, torch threads {args.threads}, load average at start "
             f"{meta['machine']['load_average']}",
             f"- date {meta['date']}, commit {meta['git_commit']}", f"- command: `{meta['command']}`", "",
             "| variant | ms/token | speedup over ar (geo) | tokens/target pass | drafter ms/forward | step ms "
             "| agreement with float32 | same as ar |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        cells = [row["variant"], f"{row['ms_per_token']:.1f}", f"{row['speedup_geo']:.2f}",
                 f"{row['tokens_per_target_pass']:.2f}"]
        cells += ["-" if row[key] is None else f"{row[key]:.{digits}f}"
                  for key, digits in (("drafter_ms_per_forward", 1), ("step_ms", 1), ("agreement", 3))]
        cells.append("yes" if row["same_as_ar"] else "**no**")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "variant: quantize:forward of the drafter (hetspec/config.py ModelConfig). agreement: its next-token "
              "argmax equals the float32 drafter's, over the prompts and the target's outputs. step ms: one one-token "
              "pass at a 200-token context, median over rounds interleaved between the variants."]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
