"""Are the tokens the target's, bit for bit? Every algorithm against transformers' own greedy ``generate``.

A Serve config's pair (its target loaded with ``bit_exact``, docs/losslessness.md), greedy, the first N prompts
of a task, each output compared token for token with transformers' ``generate(do_sample=False)`` of the target
alone (the same ``bit_exact`` model, one prompt at a time), in three ways:

- ``alone``: ``Engine.generate``, one request at a time;
- ``batch``: every (prompt, variant) request of the run through one ``BatchDecoder``, up to ``--batch`` at once,
  the variants interleaved so that a pass mixes algorithms, draft trees, lookup drafts and prompt lengths;
- ``served``: the config's application (``local_serve``), ``--concurrency`` closed-loop clients, HTTP and gRPC
  alternating; one deployment per speculation setting (the draft tree and lookup are deployment settings).

Variants: ar, slem, tli, slrs (the config's speculation, draft length fixed: load-adaptive off, so every
request drafts), slem with a draft tree (``--tree-width``), slem with context lookup drafts (``always``).
Where an output parts from the reference, the target's top-2 logit margin there is recorded. Also reported: the
same outputs against plain transformers (the target loaded without ``bit_exact``, default attention), whose
prefill computes the prompt in one pass and so rounds differently.

Writes result.json and README.md into ``--out``; exits 1 if any output differs from the ``bit_exact`` reference.

    python -m benchmarks.exactness --config deployments/config.yaml --out benchmarks/results/exactness-realistic
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import torch
import yaml

from benchmarks import analysis, report
from benchmarks.prompts import load_prompts
from benchmarks.serve_bench import RequestOptions, grpc_request, http_request
from deployments.config import AppConfig
from deployments.serving.request import request_speculation
from hetspec import Engine, SamplingParams, SpeculationConfig, load_model
from hetspec.config import BatchingConfig
from hetspec.output import ResultBuilder

MODES = ("alone", "batch", "served")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.exactness", description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=Path("deployments/config.yaml"))
    parser.add_argument("--task", default="humaneval")
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--draft-tokens", type=int, default=5)
    parser.add_argument("--tree-width", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="requests decoded together in the batch mode")
    parser.add_argument("--concurrency", type=int, default=8, help="clients in the served mode")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--no-plain-reference", action="store_true",
                        help="skip the comparison with plain transformers (a second copy of the target)")
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args(argv)


def app_config(path: Path) -> tuple[dict, AppConfig]:
    document = yaml.safe_load(path.read_text())
    return document, AppConfig.model_validate(document["applications"][0]["args"])


def variants(config: AppConfig, draft_tokens: int, tree_width: int) -> dict[str, SpeculationConfig]:
    """name -> a request's speculation, as the server builds it from its config and a request's algorithm."""
    base = config.speculation.model_copy(update={"load_adaptive": False, "draft_tokens": draft_tokens,
                                                 "lookup": "off", "tree_width": 1})
    chosen = {name: request_speculation(base, name, None) for name in ("ar", "slem", "tli", "slrs")}
    chosen["slem-tree"] = request_speculation(base.model_copy(update={"tree_width": tree_width}), "slem", None)
    chosen["slem-lookup"] = request_speculation(base.model_copy(update={"lookup": "always"}), "slem", None)
    return chosen


def load_pair(config: AppConfig, bit_exact: bool = True):
    drafter = load_model(config.drafter.model, dtype=config.drafter.dtype, device=config.drafter.device,
                         threads=config.target.threads, quantize=config.drafter.quantize,
                         linear=config.drafter.linear, forward=config.drafter.forward)
    target = load_model(config.target.model, dtype=config.target.dtype, device=config.target.device,
                        threads=config.target.threads, linear=config.target.linear, bit_exact=bit_exact)
    return target, drafter


def reference(target, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy ``generate`` of the target alone, one prompt at a time, up to and with EOS."""
    outputs = []
    for prompt in prompts:
        input_ids = torch.tensor([target.encode_prompt(prompt)], device=target.device)
        with torch.inference_mode():
            output = target.model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                           max_new_tokens=max_new_tokens, do_sample=False,
                                           eos_token_id=sorted(target.eos_token_ids),
                                           pad_token_id=min(target.eos_token_ids))
        row = output[0, input_ids.shape[1]:].tolist()
        end = next((index + 1 for index, token in enumerate(row) if token in target.eos_token_ids), len(row))
        outputs.append(row[:end])
    return outputs


def run_alone(engine: Engine, cases: list[tuple[int, str, str]], prompts: list[str],
              speculations: dict[str, SpeculationConfig], params: SamplingParams) -> dict[tuple[int, str], list[int]]:
    return {(index, name): engine.generate(prompts[index], params, speculation=speculations[name]).token_ids
            for index, name, _ in cases}


def run_batch(engine: Engine, cases: list[tuple[int, str, str]], prompts: list[str],
              speculations: dict[str, SpeculationConfig], params: SamplingParams,
              batch: int) -> dict[tuple[int, str], list[int]]:
    """Every case through one ``BatchDecoder`` (load-adaptive off), ``batch`` at a time; one joins as one leaves."""
    waiting = [engine.request(prompts[index], params, speculation=speculations[name], request_id=str(number))
               for number, (index, name, _) in enumerate(cases)]
    builders = [ResultBuilder() for _ in waiting]
    outputs: dict[tuple[int, str], list[int]] = {}
    decoder = engine.decoder(load_adaptive=False)
    queue = list(reversed(waiting))
    while queue or len(decoder):
        while queue and len(decoder) < batch:
            decoder.add(queue.pop())
        for request, event in decoder.step():
            number = int(request.request_id)
            result = builders[number].add(event)
            if result is not None:
                outputs[cases[number][:2]] = result.token_ids
    return outputs


async def serve_cases(served, cases: list[tuple[int, str, str]], prompts: list[str], max_new_tokens: int,
                      concurrency: int) -> dict[tuple[int, str], list[int]]:
    """``cases`` sent by ``concurrency`` closed-loop clients, HTTP and gRPC alternating."""
    import grpc
    import httpx

    from protos.hetspec.v1 import hetspec_pb2_grpc

    outputs: dict[tuple[int, str], list[int]] = {}
    queue = list(enumerate(cases))
    async with httpx.AsyncClient(base_url=served.http_url, timeout=3600) as client:
        listed = (await client.get("/v1/models")).json()["data"][0]
        model = listed["id"]
        if listed.get("bit_exact") is not True:  # the served target's own self-check (docs/losslessness.md)
            raise RuntimeError(f"the served target does not report bit_exact: {listed}")
        channel = grpc.aio.insecure_channel(served.grpc_target)
        stub = hetspec_pb2_grpc.HetSpecStub(channel)

        async def one_client() -> None:
            while queue:
                number, (index, name, algorithm) = queue.pop(0)
                options = RequestOptions(max_new_tokens=max_new_tokens, algorithm=algorithm)
                if number % 2:
                    timing = await grpc_request(stub, None, str(index), prompts[index], options)
                else:
                    timing = await http_request(client, model, str(index), prompts[index], options)
                if timing.error:
                    raise RuntimeError(f"{name} on prompt {index}: {timing.error}")
                outputs[(index, name)] = timing.token_ids

        try:
            await asyncio.gather(*(one_client() for _ in range(concurrency)))
        finally:
            await channel.close()
    return outputs


def run_served(document: dict, config: AppConfig, cases: list[tuple[int, str, str]], prompts: list[str],
               speculations: dict[str, SpeculationConfig],
               args: argparse.Namespace) -> dict[tuple[int, str], list[int]]:
    """One deployment per speculation setting besides the algorithm (chain, tree, lookup), target ``bit_exact``."""
    from deployments.tools.local_serve import local_serve

    outputs = {}
    groups = {"chain": ("ar", "slem", "tli", "slrs"), "tree": ("slem-tree",), "lookup": ("slem-lookup",)}
    for group, names in groups.items():
        speculation = speculations[names[-1]].model_copy(update={"algorithm": config.speculation.algorithm})
        args_override = {**document["applications"][0]["args"],
                         "target": {**config.target.model_dump(exclude_unset=True), "bit_exact": True},
                         "speculation": speculation.model_dump(exclude_defaults=True)}
        serve_config = {**document, "applications": [{**document["applications"][0], "args": args_override}]}
        chosen = [case for case in cases if case[1] in names]
        with local_serve(serve_config) as served:
            print(f"served {group}: {len(chosen)} requests", file=sys.stderr, flush=True)
            outputs.update(asyncio.run(serve_cases(served, chosen, prompts, args.max_new_tokens, args.concurrency)))
    return outputs


def compare(outputs: dict[tuple[int, str], list[int]], references: list[list[int]], target,
            prompts: list[str]) -> list[dict]:
    """One row per case: equal to the reference, or where it parts and the target's top-2 margin there."""
    rows = []
    for (index, name), token_ids in sorted(outputs.items()):
        position = analysis.first_difference(references[index], token_ids)
        row = {"prompt": index, "variant": name, "tokens": len(token_ids), "equal": position is None}
        if position is not None:
            margin, top2 = analysis.top2_margin(target, target.encode_prompt(prompts[index]),
                                                references[index][:position])
            row.update(position=position, target_top2_margin=margin, target_top2_ids=top2)
        rows.append(row)
    return rows


def summary(rows: list[dict], plain: list[list[int]] | None, outputs: dict) -> dict:
    by_variant: dict[str, list[int]] = {}
    for row in rows:
        equal, total = by_variant.setdefault(row["variant"], [0, 0])
        by_variant[row["variant"]] = [equal + row["equal"], total + 1]
    result = {"equal": sum(row["equal"] for row in rows), "total": len(rows), "by_variant": by_variant}
    if plain is not None:
        result["equal_to_plain_transformers"] = sum(token_ids == plain[index]
                                                    for (index, _), token_ids in outputs.items())
    return result


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    provenance = report.provenance(argv, "cpu", "benchmarks.exactness")  # the commit at the start
    document, config = app_config(args.config)
    target, drafter = load_pair(config)
    engine = Engine(target, drafter, batching=BatchingConfig(max_batch_size=args.batch))
    speculations = variants(config, args.draft_tokens, args.tree_width)
    prompts = [case.text for case in load_prompts(args.task, args.num_prompts)]
    cases = [(index, name, speculations[name].algorithm) for index in range(len(prompts)) for name in speculations]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    seconds: dict[str, float] = {}

    tick = time.perf_counter()
    references = reference(target, prompts, args.max_new_tokens)
    seconds["reference"] = time.perf_counter() - tick
    plain = None
    if not args.no_plain_reference:
        plain_target = load_model(config.target.model, dtype=config.target.dtype, device=config.target.device,
                                  threads=config.target.threads, linear=config.target.linear)
        plain = reference(plain_target, prompts, args.max_new_tokens)
        del plain_target
    result = {"provenance": provenance,
              "settings": {key: str(value) for key, value in vars(args).items()},
              "target_bit_exact_self_check": target.bit_exact,
              "speculation": {name: spec.model_dump() for name, spec in speculations.items()},
              "references": references, "plain_transformers": plain,
              "reference_equals_plain_transformers": None if plain is None else sum(
                  ref == own for ref, own in zip(references, plain)),
              "modes": {}}
    for mode in args.modes:
        tick = time.perf_counter()
        if mode == "alone":
            outputs = run_alone(engine, cases, prompts, speculations, params)
        elif mode == "batch":
            outputs = run_batch(engine, cases, prompts, speculations, params, args.batch)
        else:
            outputs = run_served(document, config, cases, prompts, speculations, args)
        seconds[mode] = time.perf_counter() - tick
        rows = compare(outputs, references, target, prompts)
        result["modes"][mode] = {**summary(rows, plain, outputs), "rows": rows,
                                 "outputs": {f"{index}/{name}": ids for (index, name), ids in outputs.items()}}
        print(json.dumps({"mode": mode, "equal": result["modes"][mode]["equal"],
                          "total": result["modes"][mode]["total"], "seconds": round(seconds[mode])}), flush=True)
    result["seconds"] = seconds
    return result


def markdown(result: dict) -> str:
    settings, provenance = result["settings"], result["provenance"]
    names = list(result["speculation"])
    lines = ["# Exactness: every algorithm against transformers' greedy generate of the target alone", "",
             f"Command: `{provenance['command']}`  ",
             f"Commit: {provenance['git_commit']} (dirty: {provenance['git_dirty']}), {provenance['date']}  ",
             f"Machine: {report.describe_machine(provenance['machine'])}  ",
             f"Config: {settings['config']}, target loaded with bit_exact (self-check: "
             f"{result['target_bit_exact_self_check']}); {settings['num_prompts']} {settings['task']} prompts, "
             f"{settings['max_new_tokens']} new tokens, greedy; draft length {settings['draft_tokens']} "
             f"(load-adaptive off), tree width {settings['tree_width']}; batch {settings['batch']}, "
             f"{settings['concurrency']} served clients (HTTP and gRPC alternating)", "",
             "Outputs equal to the reference (transformers' `generate` of the bit_exact target, one prompt at a "
             "time), token for token:", "",
             "| mode | " + " | ".join(names) + " | all | equal to plain transformers | seconds |",
             "|---|" + "---|" * (len(names) + 3)]
    for mode, entry in result["modes"].items():
        cells = [f"{entry['by_variant'][name][0]}/{entry['by_variant'][name][1]}" for name in names]
        plain = entry.get("equal_to_plain_transformers")
        plain_cell = "-" if plain is None else f"{plain}/{entry['total']}"
        lines.append(f"| {mode} | " + " | ".join(cells) + f" | **{entry['equal']}/{entry['total']}** | "
                     f"{plain_cell} | {result['seconds'][mode]:.0f} |")
    if result["reference_equals_plain_transformers"] is not None:
        lines += ["", f"The reference against plain transformers (default attention, the prompt in one pass): "
                      f"{result['reference_equals_plain_transformers']}/{len(result['references'])} equal."]
    differing = [(mode, row) for mode, entry in result["modes"].items() for row in entry["rows"] if not row["equal"]]
    lines += ["", "Differences from the reference: " + ("none." if not differing else "")]
    lines += [f"- {mode}, prompt {row['prompt']}, {row['variant']}: token {row['position']}, target top-2 margin "
              f"{row['target_top2_margin']:.4g} ({row['target_top2_ids']})" for mode, row in differing]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    result = run(args, argv)
    report.write_result(args.out, result, markdown(result))
    return 0 if all(entry["equal"] == entry["total"] for entry in result["modes"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
