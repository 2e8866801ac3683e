"""Benchmark hetspec's algorithms against the target alone and transformers' assisted generation.

    python -m benchmarks.bench --pair realistic --task humaneval --num-prompts 5 --max-new-tokens 128 \
        --draft-tokens 3 5 --adaptive --out benchmarks/results/realistic-humaneval

All methods run in one process on the same loaded models, after a warm-up, interleaved prompt by
prompt (the method order rotates between prompts so no method always runs first). Writes
results.json, results.md, speedup.png and acceptance.png to the output folder. benchmarks/README.md
explains every figure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks import analysis, llama_peer, plots, report
from benchmarks.meter import cost_sizes, pass_costs
from benchmarks.methods import FAMILIES, MethodSpec, RunRecord, Runner, build_methods
from benchmarks.prompts import TASKS, PromptCase, load_prompts
from hetspec import Engine, SamplingParams, load_model
from hetspec.models import QUANTIZE

PAIRS = {  # label: (target, drafter, dtype), see docs/models.md
    "small": ("gemma3-270m", "smollm2-135m", "float32"),
    "realistic": ("qwen2.5-coder-1.5b", "smollm2-135m", "bfloat16"),
    "same-vocab": ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "bfloat16"),
}
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", choices=sorted(PAIRS), default="realistic", help="model pair (docs/models.md)")
    parser.add_argument("--target", help="target model (short name, .gguf, folder or hub id); overrides --pair")
    parser.add_argument("--drafter", help="drafter model; overrides --pair")
    parser.add_argument("--label", help="name of the pair in reports (default: --pair, or 'custom')")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the pair's")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--task", choices=TASKS, default="humaneval")
    parser.add_argument("--num-prompts", type=int, default=3)
    parser.add_argument("--prompt-offset", type=int, default=0, help="skip this many prompts of the set")
    parser.add_argument("--prompt-stride", type=int, default=1,
                        help="take every N-th prompt from the offset on (e.g. 16: HumanEval/0, /16, /32...)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--algorithms", default=",".join(FAMILIES),
                        help=f"comma-separated, from {','.join(FAMILIES)} (sd only runs for a same-vocabulary pair)")
    parser.add_argument("--draft-tokens", type=int, nargs="+", default=[3, 5], help="fixed draft lengths k")
    parser.add_argument("--adaptive", action="store_true",
                        help="also run hetspec's adaptive draft length (starting at the largest k)")
    parser.add_argument("--confidence-threshold", type=float, default=0.0,
                        help="hetspec: stop a draft once the drafter's top probability is below this (0: never)")
    parser.add_argument("--drafter-quantize", choices=QUANTIZE, default="none",
                        help="int8 drafter (CPU; hetspec/int8.py, hetspec/config.py ModelConfig.quantize): hetspec and "
                        "transformers share that drafter")
    parser.add_argument("--tree-widths", type=int, nargs="+", default=[1],
                        help="slem: draft-tree widths to run (1: a chain; see SpeculationConfig.tree_width)")
    parser.add_argument("--hf-drafts", nargs="+",
                        help="hf-assisted settings: default, heuristic or numbers (default: default + --draft-tokens)")
    parser.add_argument("--lookup", nargs="+", choices=["off", "auto", "always"], default=["off"],
                        help="hetspec context lookup modes to run each hetspec method with (SpeculationConfig.lookup); "
                             "ar runs without lookup (the baseline) and with each other mode")
    parser.add_argument("--lookup-min-match", type=int, nargs="+",
                        help="SpeculationConfig.lookup_min_match settings (bytes) to run each lookup mode with "
                             "(default: its default alone)")
    parser.add_argument("--hf-lookup-tokens", type=int, nargs="+", default=[10],
                        help="hf-lookup: transformers' prompt_lookup_num_tokens settings")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="also run llama.cpp on the target's GGUF file, greedy (benchmarks/llama_peer.py; skipped "
                             "with a message when llama-cpp-python is not installed)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chat", action="store_true", help="wrap prompts in the models' chat templates")
    parser.add_argument("--warmup-tokens", type=int, default=8, help="tokens of the warm-up run of each method")
    parser.add_argument("--cost-repeats", type=int, default=3,
                        help="repeats of each isolated per-pass cost measurement; 0 skips the ideal speedup")
    parser.add_argument("--note", default="", help="a remark stored with the results (e.g. machine load)")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--out", type=Path, help="output folder (default benchmarks/results/<pair>-<task>-<date>)")
    return parser.parse_args(argv)


def resolve_models(args: argparse.Namespace) -> tuple[str, str, str, str]:
    """(label, target, drafter, dtype)."""
    target, drafter, dtype = PAIRS[args.pair]
    label = args.pair
    if args.target or args.drafter:
        label = "custom"
        target, drafter = args.target or target, args.drafter or drafter
    return args.label or label, target, drafter, args.dtype or dtype


def run_entry(runner: Runner, entry, case: PromptCase, max_new_tokens: int | None = None):
    """One run of a harness method (a RunRecord) or of a peer outside the harness (a llama_peer.PeerRun)."""
    if isinstance(entry, MethodSpec):
        return runner.run(entry, case, max_new_tokens=max_new_tokens)
    return entry.run(case.prompt_id, runner.prompt_ids(case), max_new_tokens or runner.params.max_new_tokens)


def warm_up(runner: Runner, entries: list, case: PromptCase, tokens: int) -> None:
    if tokens <= 0:
        return
    for entry in tqdm(entries, desc="warm-up", leave=False):
        run_entry(runner, entry, case, tokens)


def make_peers(args: argparse.Namespace, target_spec: str, target, greedy: bool) -> tuple[list, str | None]:
    """The peers outside the harness that ``args`` asks for, and why one was skipped (None: none was)."""
    if not args.llama_cpp:
        return [], None
    if not greedy:
        raise SystemExit("--llama-cpp: the llama.cpp peer decodes greedily only (drop --temperature)")
    if not llama_peer.available():
        print(llama_peer.INSTALL_HINT, file=sys.stderr)
        return [], llama_peer.INSTALL_HINT
    peer = llama_peer.LlamaCppPeer(llama_peer.gguf_of(target_spec), torch.get_num_threads(), target.eos_token_ids)
    return [peer], None


def measure_costs(runner: Runner, case: PromptCase, records: list[RunRecord], repeats: int) -> dict:
    """Isolated per-pass costs of both models at this prompt's mid-generation context."""
    reference = next(record for record in records if record.method == "ar").token_ids
    half = len(reference) // 2
    target_context = runner.prompt_ids(case) + reference[:half]
    later = [call.tokens for record in records for call in record.target_calls[1:]]
    costs = {"target": pass_costs(runner.target, target_context, reference[half:], cost_sizes(later), repeats,
                                  logits_rows="all")}
    drafter_later = [call.tokens for record in records for call in record.drafter_calls[1:]]
    if runner.drafter is not None and drafter_later:
        drafter = runner.drafter
        text = runner.target.tokenizer.decode(reference, skip_special_tokens=True)
        continuation = drafter.encode(text)
        context = drafter.encode_prompt(case.text) + continuation[:len(continuation) // 2]
        costs["drafter"] = pass_costs(drafter, context, continuation[len(continuation) // 2:],
                                      cost_sizes(drafter_later), repeats, logits_rows="last")
    else:
        costs["drafter"] = {1: 0.0}
    return costs


def find_divergences(runner: Runner, cases: list[PromptCase], records: list[RunRecord],
                     greedy: bool) -> dict[str, list[dict | None]]:
    """Per method, per prompt: None when the output equals ar's, else where it first differs and why."""
    by_key = {(record.prompt_id, record.method): record for record in records}
    result: dict[str, list[dict | None]] = {}
    for record in records:
        reference = by_key.get((record.prompt_id, "ar"))
        if reference is None or record.method == "ar":
            continue
        position = analysis.first_difference(reference.token_ids, record.token_ids)
        item = None
        if position is not None:
            item = {"prompt_id": record.prompt_id, "position": position,
                    "reference_token": reference.token_ids[position] if position < len(reference.token_ids) else None,
                    "method_token": record.token_ids[position] if position < len(record.token_ids) else None}
            if greedy and item["reference_token"] is not None:
                case = next(case for case in cases if case.prompt_id == record.prompt_id)
                margin, top2 = analysis.top2_margin(runner.target, runner.prompt_ids(case),
                                                    reference.token_ids[:position])
                item.update(target_top2_margin=margin, target_top2_ids=top2)
        result.setdefault(record.method, []).append(item)
    return result


def run_benchmark(args: argparse.Namespace, argv: list[str]) -> tuple[dict, Path]:
    label, target_spec, drafter_spec, dtype = resolve_models(args)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    cases = load_prompts(args.task, args.num_prompts, args.prompt_offset, args.prompt_stride)
    meta = report.provenance(argv, args.device)  # before loading: the load average says how busy the machine was
    progress = lambda message: print(message, file=sys.stderr)  # noqa: E731
    target = load_model(target_spec, dtype=dtype, device=args.device, threads=args.threads, progress=progress)
    drafter = load_model(drafter_spec, dtype=dtype, device=args.device, threads=args.threads, progress=progress,
                         quantize=args.drafter_quantize)
    meta["machine"]["torch_threads"] = torch.get_num_threads()
    engine = Engine(target, drafter)
    same_vocabulary = engine.maps.same_vocabulary
    families = [name.strip() for name in args.algorithms.split(",") if name.strip()]
    hf_drafts = args.hf_drafts or ["default", *map(str, args.draft_tokens)]
    methods = build_methods(families, args.draft_tokens, args.adaptive, hf_drafts, same_vocabulary,
                            tuple(args.tree_widths), tuple(args.lookup), tuple(args.hf_lookup_tokens),
                            tuple(args.lookup_min_match or [None]))
    runner = Runner(engine, params, args.chat, same_vocabulary, adaptive_start=max(args.draft_tokens),
                    confidence_threshold=args.confidence_threshold)
    peers, peer_skipped = make_peers(args, target_spec, target, params.greedy)
    entries = [*methods, *peers]
    records: list[RunRecord] = []
    peer_runs: list[llama_peer.PeerRun] = []
    costs: dict[str, dict] = {}
    try:
        warm_up(runner, entries, cases[0], args.warmup_tokens)
        with tqdm(total=len(cases) * len(entries), desc="runs") as bar:
            for index, case in enumerate(cases):
                order = entries[index % len(entries):] + entries[:index % len(entries)]
                prompt_records = []
                for entry in order:
                    bar.set_postfix_str(f"{case.prompt_id} {entry.name}")
                    run = run_entry(runner, entry, case)
                    (prompt_records if isinstance(entry, MethodSpec) else peer_runs).append(run)
                    bar.update()
                prompt_records.sort(key=lambda record: [spec.name for spec in methods].index(record.method))
                records += prompt_records
                if args.cost_repeats > 0 and any(record.method == "ar" for record in prompt_records):
                    costs[case.prompt_id] = measure_costs(runner, case, prompt_records, args.cost_repeats)
        divergences = find_divergences(runner, cases, records, params.greedy)
    finally:
        runner.close()
    summary = analysis.summarize(records, divergences, costs or None)
    reference = {record.prompt_id: (record.token_ids, record.seconds) for record in records if record.method == "ar"}
    peer_summary = [llama_peer.summarize_peer([run for run in peer_runs if run.method == peer.name], reference)
                    for peer in peers] if reference else []
    settings = {"pair_label": label, "target": target_spec, "drafter": drafter_spec, "dtype": dtype,
                "device": args.device, "task": args.task, "num_prompts": len(cases), "prompt_offset": args.prompt_offset,
                "prompt_stride": args.prompt_stride,
                "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_k": args.top_k,
                "top_p": args.top_p, "seed": args.seed, "chat": args.chat, "draft_tokens": args.draft_tokens,
                "adaptive": args.adaptive, "confidence_threshold": args.confidence_threshold,
                "tree_widths": args.tree_widths, "drafter_quantize": args.drafter_quantize,
                "lookup": args.lookup, "hf_lookup_tokens": args.hf_lookup_tokens,
                "lookup_min_match": args.lookup_min_match,
                "same_vocabulary": same_vocabulary, "methods": [m.name for m in methods],
                "hf_assisted_settings": {draft: runner.effective_assistant_settings(draft) for draft in hf_drafts}}
    result = {"meta": meta, "settings": settings, "note": args.note, "headline": analysis.headline(summary),
              "summary": summary,
              "prompts": [{"prompt_id": case.prompt_id, "task": case.task,
                           "prompt_tokens": len(runner.prompt_ids(case))} for case in cases],
              "pass_costs": {prompt: {model: {str(size): seconds for size, seconds in table.items()}
                                      for model, table in tables.items()} for prompt, tables in costs.items()},
              "runs": [{**asdict(record), **analysis.run_metrics(record)} for record in records],
              "peers": {"settings": {peer.name: peer.settings() for peer in peers}, "summary": peer_summary,
                        "skipped": peer_skipped, "runs": [asdict(run) for run in peer_runs]}}
    folder = args.out or RESULTS_DIR / f"{label}-{args.task}-{dtype}-{datetime.datetime.now():%Y%m%d-%H%M}"
    return result, folder


def to_json(result: dict) -> str:
    """Indented, except one line per run: the runs hold every forward call and would fill thousands of lines."""
    head = json.dumps({key: value for key, value in result.items() if key != "runs"}, indent=1)
    runs = ",\n".join("  " + json.dumps(run, separators=(",", ":")) for run in result["runs"])
    return head[:-2] + ',\n "runs": [\n' + runs + "\n ]\n}\n"


def write_results(result: dict, folder: Path, with_plots: bool) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(to_json(result))
    (folder / "results.md").write_text(report.markdown(result))
    written = [folder / "results.json", folder / "results.md"]
    if with_plots:
        written += [folder / name for name in plots.write_plots(result, folder)]
    return written


def run(argv: list[str]) -> dict:
    """Run the benchmark described by command-line ``argv``, write its files, return the result."""
    args = parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()  # generation-config notices on every call would bury the progress bars
    result, folder = run_benchmark(args, argv)
    for path in write_results(result, folder, not args.no_plots):
        print(path)
    print(report.summary_table(result["summary"]))
    if result["peers"]["summary"]:
        print(report.peer_table(result["peers"]["summary"]))
    return result


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m benchmarks.bench``; returns the exit status."""
    run(list(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
