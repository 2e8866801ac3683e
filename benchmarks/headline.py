"""The README's headline table, regenerated on the machine at hand in one run, peers included.

    python -m benchmarks.headline                      # ~25 minutes on a 2-core CPU (models cached)
    python -m benchmarks.headline --no-served          # the single-request row only (~15 minutes)
    python -m benchmarks.headline --pair small --num-prompts 1 --max-new-tokens 8 --no-served   # a smoke run

1. One request at a time (``benchmarks.bench``, every method on the same loaded models, interleaved prompt by
   prompt): the target alone, hetspec SLEM, transformers' assisted generation with the same drafter object,
   and llama.cpp on the very GGUF file hetspec loads (``benchmarks/llama_peer.py``; skipped with a message
   when llama-cpp-python is not installed).
2. Served (``benchmarks.serve_scaling``, unless ``--no-served``): ``serve run`` of deployments/config.yaml at
   1 and 8 closed-loop clients against transformers' padded batch of the target alone and the server with
   speculation off.

Writes ``<out>/single/`` (bench's results), ``<out>/served/`` (serve_scaling's), and ``<out>/headline.md`` and
``headline.json``: one row per load with tokens/s of each method, which the README's table copies.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from benchmarks import bench, report

REPO = Path(__file__).resolve().parent.parent
# the README's single-request settings for the realistic pair (docs/performance.md): SLEM at k=9 with an early
# draft stop, the drafter in weight-only int8, transformers' assisted generation at its best setting (3 tokens)
PAIR_SETTINGS = {
    "realistic": {"draft_tokens": 9, "confidence_threshold": 0.5, "drafter_quantize": "int8-weight-only",
                  "hf_draft": "3"},
    "small": {"draft_tokens": 3, "confidence_threshold": 0.0, "drafter_quantize": "none", "hf_draft": "3"},
    "same-vocab": {"draft_tokens": 5, "confidence_threshold": 0.0, "drafter_quantize": "none", "hf_draft": "3"},
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.headline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", choices=sorted(PAIR_SETTINGS), default="realistic")
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--prompt-stride", type=int, default=16,
                        help="every N-th HumanEval prompt (HumanEval/0, /16...)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2, help="torch (and llama.cpp) threads")
    parser.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out")
    parser.add_argument("--no-served", action="store_true", help="only the single-request row (no Ray, no server)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="served levels")
    parser.add_argument("--served-tokens", type=int, default=64, help="new tokens of each served request")
    parser.add_argument("--config", type=Path, default=REPO / "deployments" / "config.yaml", help="the served config")
    parser.add_argument("--out", type=Path, help="default benchmarks/results/headline-<date>")
    return parser.parse_args(argv)


def bench_argv(args: argparse.Namespace, out: Path) -> list[str]:
    settings = PAIR_SETTINGS[args.pair]
    argv = ["--pair", args.pair, "--task", "humaneval", "--num-prompts", str(args.num_prompts),
            "--prompt-stride", str(args.prompt_stride), "--max-new-tokens", str(args.max_new_tokens),
            "--threads", str(args.threads), "--algorithms", "ar,slem,hf-assisted",
            "--draft-tokens", str(settings["draft_tokens"]), "--hf-drafts", settings["hf_draft"],
            "--confidence-threshold", str(settings["confidence_threshold"]),
            "--drafter-quantize", settings["drafter_quantize"], "--cost-repeats", "0", "--no-plots", "--out", str(out)]
    return argv + ([] if args.no_llama_cpp else ["--llama-cpp"])


def served_argv(args: argparse.Namespace, out: Path) -> list[str]:
    return ["--config", str(args.config), "--concurrency", *map(str, args.concurrency), "--rounds", "2",
            "--max-new-tokens", str(args.served_tokens), "--skip", "baseline", "--out", str(out)] + (
                [] if args.no_llama_cpp else ["--llama-cpp"])


def single_row(result: dict) -> dict:
    """The single-request row from a bench result: tokens/s and speedup over the target alone per method."""
    rows = {row["method"]: row for row in result["summary"]}
    peers = {row["method"]: row for row in (result.get("peers") or {}).get("summary", [])}

    def cell(row: dict | None) -> dict | None:
        if row is None:
            return None
        return {"method": row["method"], "tokens_per_second": row["tokens_per_second"],
                "speedup": row["speedup_vs_ar_geomean"] if row["method"] != "ar" else 1.0}

    hetspec = [row for name, row in rows.items() if row["family"] == "slem"]
    hf = [row for name, row in rows.items() if row["family"] == "hf-assisted"]
    best = lambda candidates: max(candidates, key=lambda row: row["tokens_per_second"], default=None)  # noqa: E731
    settings = result["settings"]
    return {"load": f"1 request, {settings['num_prompts']} HumanEval prompts x {settings['max_new_tokens']} tokens, "
                    "greedy",
            "target_alone": cell(rows.get("ar")), "hetspec": cell(best(hetspec)), "transformers": cell(best(hf)),
            "llama_cpp": cell(peers.get("llama.cpp")),
            "llama_cpp_skipped": (result.get("peers") or {}).get("skipped"),
            "same_tokens_as_target_alone": best(hetspec) and best(hetspec)["output_identical_to_ar"]}


def served_rows(result: dict) -> list[dict]:
    """One row per served level from a serve_scaling result: the server (gRPC), speculation off, and
    transformers' padded batch of the target alone."""
    methods = result["methods"]
    rows = []
    for level in result["settings"]["concurrency"]:
        def tokens(name: str) -> float | None:
            entry = methods.get(name, {}).get(str(level), methods.get(name, {}).get(level))
            return entry["tokens_per_second"] if entry else None

        rows.append({"load": f"served, {level} client{'s' if level > 1 else ''} (closed loop, "
                             f"{result['settings']['max_new_tokens']} tokens)",
                     "hetspec": tokens("served-grpc"), "speculation_off": tokens("served-ar-grpc"),
                     "transformers": tokens("hf-batched"), "llama_cpp": tokens("llama.cpp-batched")})
    return rows


def _tps(cell) -> str:
    if cell is None:
        return "-"
    if isinstance(cell, dict):
        speedup = f" ({cell['speedup']:.2f}x)" if cell.get("speedup") and cell["method"] != "ar" else ""
        return f"{cell['tokens_per_second']:.2f}{speedup}"
    return f"{cell:.2f}"


def markdown(headline: dict) -> str:
    machine = headline["machine"]
    out = [f"# Headline: {headline['pair']}", "",
           f"- machine: {machine}", f"- date {headline['date']}, commit {headline['commit']}",
           f"- command: `{headline['command']}`", "",
           "| hardware | load | target alone | hetspec | transformers | llama.cpp | result |",
           "|---|---|---|---|---|---|---|"]
    single = headline["single"]
    out.append(f"| {machine} | {single['load']} | {_tps(single['target_alone'])} | {_tps(single['hetspec'])} | "
               f"{_tps(single['transformers'])} | {_tps(single['llama_cpp'])} | single/results.md |")
    for row in headline["served"]:
        out.append(f"| {machine} | {row['load']} | {_tps(row['speculation_off'])} (server, speculation off) | "
                   f"{_tps(row['hetspec'])} | {_tps(row['transformers'])} (padded batch) | "
                   f"{_tps(row.get('llama_cpp'))} (batched) | served/README.md |")
    out += ["", "tokens/s over all requests (speedup over the target alone: geometric mean over prompts). hetspec: "
            f"{single['hetspec'] and single['hetspec']['method']}; transformers: "
            f"{single['transformers'] and single['transformers']['method']} (the same drafter object). hetspec's "
            f"tokens equal the target alone's: {single['same_tokens_as_target_alone']}."]
    if single["llama_cpp_skipped"]:
        out += ["", f"> {single['llama_cpp_skipped']}"]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    out = args.out or REPO / "benchmarks" / "results" / f"headline-{datetime.datetime.now():%Y%m%d-%H%M}"
    out.mkdir(parents=True, exist_ok=True)
    meta = report.provenance(argv, "cpu", module="benchmarks.headline")
    single = bench.run(bench_argv(args, out / "single"))
    served = []
    if not args.no_served:
        from benchmarks import serve_scaling

        serve_scaling.main(served_argv(args, out / "served"))
        served = served_rows(json.loads((out / "served" / "result.json").read_text()))
    machine = single["meta"]["machine"]
    settings = single["settings"]
    headline = {"pair": f"{settings['target']} <- {settings['drafter']} ({settings['dtype']})",
                "machine": f"{report.describe_machine(machine)}, {machine['torch_threads']} threads",
                "date": meta["date"], "commit": meta["git_commit"], "command": meta["command"],
                "single": single_row(single), "served": served}
    (out / "headline.json").write_text(json.dumps(headline, indent=1) + "\n")
    (out / "headline.md").write_text(markdown(headline))
    print(markdown(headline))
    print(out / "headline.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
