"""``hetspec generate``.

The benchmarks are not a sub-command: they sit above the library, in the repository's ``benchmarks/``
(``python -m benchmarks.bench``), which a package install does not carry.
"""

from __future__ import annotations

import argparse
import json
import sys

from pydantic import ValidationError


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _generate_parser(sub) -> None:
    parser = sub.add_parser("generate", help="generate text with speculative decoding")
    parser.add_argument("prompt", nargs="?", help="the prompt; read from stdin when omitted")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="target model: short name, .gguf, folder or hub id")
    parser.add_argument("--drafter", default="smollm2-135m", help="drafter model (ignored by --algorithm ar)")
    parser.add_argument("--algorithm", default="auto", help="auto, ar, sd, slem, tli or slrs")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, help="seed of the sample (default: a fresh random one, printed in the "
                        "statistics)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--draft-tokens", type=int, default=5)
    parser.add_argument("--adaptive", action="store_true", help="adapt the draft length to acceptance")
    parser.add_argument("--drafter-quantize", choices=["none", "int8", "int8-weight-only"], default="none",
                        help="int8 drafter on the CPU (faster drafts, same output): int8 dynamic (weights and "
                        "inputs), int8-weight-only (int8 weights, float inputs: far closer to the float drafter)")
    parser.add_argument("--tree-width", type=int, default=1, help="SLEM draft tree: branches per depth (1: a chain)")
    parser.add_argument("--confidence-threshold", type=float, default=0.0,
                        help="stop drafting once the drafter's top probability is below this (0: never)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--linear", default="auto", choices=["auto", "onednn", "torch"],
                        help="float32 Linear kernels on the CPU: oneDNN with weights converted once (auto: for float32 "
                        "on the CPU) or torch's default")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--chat", action="store_true", help="wrap the prompt as one user message in the chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object (text, ids, statistics)")
    parser.add_argument("--prompts-file", metavar="FILE", help=(
        "decode many prompts in batches: one JSON value per line, a string (the prompt) or an object with "
        "'prompt' or 'messages' and any sampling field overriding the flags ('temperature', 'seed', 'stop', ...); "
        "prints one JSON result per line, in order"))
    parser.add_argument("--batch-size", type=int, default=8, help="most prompts decoded together (--prompts-file)")
    parser.add_argument("--load-adaptive", action="store_true",
                        help="each step, draft or not (plain batched decoding), whichever has committed more "
                             "tokens a second at the batch size")
    parser.add_argument("--lookup", choices=["off", "auto", "always"], default="off", help=(
        "context lookup drafts: text that followed an earlier occurrence of the text's end, no drafter pass "
        "(auto: when its measured acceptance holds up against the drafter's; always: whenever it proposes enough)"))
    parser.add_argument("--lookup-min-match", type=int, default=12, help="context lookup: shortest match, in bytes")
    parser.add_argument("--lookup-max-draft", type=int, default=16,
                        help="context lookup: most target tokens one lookup draft proposes")


def _run_generate(args: argparse.Namespace) -> int:
    from hetspec import Engine, SamplingParams, SpeculationConfig, load_model
    from hetspec.config import BatchingConfig, require_unicode
    from hetspec.linear import uses_onednn
    from hetspec.models import DTYPES

    if args.prompts_file and args.prompt is not None:
        print("hetspec: give a prompt or --prompts-file, not both", file=sys.stderr)
        return 2
    prompt = None
    if not args.prompts_file:
        try:
            # stdin as bytes: invalid UTF-8 is the user's input error, not a UnicodeDecodeError traceback
            prompt = args.prompt if args.prompt is not None else sys.stdin.buffer.read().decode("utf-8")
            require_unicode(prompt)  # an invalid UTF-8 argument arrives as lone surrogates (surrogateescape)
        except ValueError as error:
            print(f"hetspec: prompt: not valid UTF-8 text ({error})", file=sys.stderr)
            return 2
    try:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, stop=args.stop)
        speculation = SpeculationConfig(algorithm=args.algorithm, draft_tokens=args.draft_tokens,
                                        adaptive=args.adaptive, tree_width=args.tree_width,
                                        confidence_threshold=args.confidence_threshold,
                                        load_adaptive=args.load_adaptive, lookup=args.lookup,
                                        lookup_min_match=args.lookup_min_match,
                                        lookup_max_draft=args.lookup_max_draft)
        batching = BatchingConfig(max_batch_size=args.batch_size)
    except ValidationError as error:
        for problem in error.errors():
            field = ".".join(str(part) for part in problem["loc"]).replace("_", "-")
            print(f"hetspec: --{field}: {problem['msg']}", file=sys.stderr)
        return 2
    try:  # the library's own rule, before any model loads
        uses_onednn(args.linear, DTYPES[args.dtype], args.device)
    except ValueError as error:
        print(f"hetspec: --linear: {error}", file=sys.stderr)
        return 2
    if args.prompts_file:
        try:
            prompts, per_prompt = _read_prompts(args.prompts_file, params)
        except (OSError, ValueError) as error:
            print(f"hetspec: --prompts-file: {error}", file=sys.stderr)
            return 2
    elif not prompt:
        print("hetspec: the prompt is empty", file=sys.stderr)
        return 2
    target = load_model(args.target, args.dtype, args.device, args.threads, progress=_progress, linear=args.linear)
    drafter = None
    if speculation.algorithm != "ar":
        drafter = load_model(args.drafter, args.dtype, args.device, args.threads, progress=_progress,
                             quantize=args.drafter_quantize,
                             linear="auto" if args.drafter_quantize != "none" else args.linear)
    engine = Engine(target, drafter, speculation, batching)
    if args.prompts_file:
        try:
            results = engine.generate_batch(prompts, per_prompt, progress=True)
        except ValueError as error:
            print(f"hetspec: --prompts-file: {error}", file=sys.stderr)
            return 2
        for index, result in enumerate(results):
            print(json.dumps({"index": index, "text": result.text, "token_ids": result.token_ids,
                              "finish_reason": result.finish_reason, "stats": result.stats.to_dict()}))
        return 0
    messages = [{"role": "user", "content": prompt}] if args.chat else None
    try:
        if args.json:
            result = engine.generate(None if args.chat else prompt, params, messages=messages)
            print(json.dumps({"text": result.text, "token_ids": result.token_ids,
                              "finish_reason": result.finish_reason, "stats": result.stats.to_dict()}))
            return 0
        for event in engine.stream(None if args.chat else prompt, params, messages=messages):
            sys.stdout.write(event.text)
            sys.stdout.flush()
            if event.finish_reason:
                stats = event.stats
                print(f"\n[{stats.algorithm}] {stats.generated_tokens} tokens in {stats.total_seconds:.2f} s, "
                      f"{stats.mean_accepted_per_pass:.2f} tokens per target pass, acceptance "
                      f"{stats.acceptance_rate:.2f}, finish: {event.finish_reason}", file=sys.stderr)
    except ValueError as error:
        print(f"hetspec: {error}", file=sys.stderr)
        return 2
    return 0


def _read_prompts(path: str, defaults) -> tuple[list, list]:
    """Prompts (strings or message lists) and their sampling parameters from a JSON-lines file."""
    from hetspec import SamplingParams

    prompts, per_prompt = [], []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
                if isinstance(value, str):
                    value = {"prompt": value}
                if not isinstance(value, dict) or ("prompt" in value) == ("messages" in value):
                    raise ValueError("each line is a JSON string or an object with exactly one of prompt, messages")
                prompts.append(value.pop("prompt") if "prompt" in value else value.pop("messages"))
                per_prompt.append(SamplingParams.model_validate({**defaults.model_dump(), **value}))
            except (ValueError, ValidationError) as error:
                raise ValueError(f"line {number}: {error}") from None
    if not prompts:
        raise ValueError(f"{path} holds no prompt")
    return prompts, per_prompt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hetspec", description="speculative decoding between any two models")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    return _run_generate(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
