"""A small client of the hetspec Serve app: gRPC and OpenAI HTTP requests, and a health wait.

    python deployments/tools/client.py wait --url http://127.0.0.1:8000 --timeout 600
    python deployments/tools/client.py grpc --target 127.0.0.1:9000 --prompt "def add(a, b):" [--stream]
    python deployments/tools/client.py http --url http://127.0.0.1:8000 --prompt "def add(a, b):" [--chat] [--stream]

Prints the generated text and the speculation statistics; exits non-zero with a message on failure.
A server with an API key needs ``--api-key KEY`` (default: $HETSPEC_API_KEY): sent as
``Authorization: Bearer KEY`` over HTTP (the openai client's api_key) and as gRPC metadata.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the stubs (protos/) when run as a script

STATS_SHOWN = ("algorithm", "generated_tokens", "target_forwards", "drafted_tokens", "accepted_tokens",
               "acceptance_rate", "mean_accepted_per_pass", "pipelined", "pipeline_hits", "pipeline_misses",
               "drafter_seconds", "target_seconds", "total_seconds", "tokens_per_second")


def _print_result(protocol: str, text: str, finish_reason: str, stats: dict) -> None:
    print(f"--- {protocol}: finish_reason={finish_reason}")
    print(text)
    print(f"--- {protocol} speculation statistics")
    for name in STATS_SHOWN:
        value = stats.get(name)
        print(f"  {name:24s} {value:.4g}" if isinstance(value, float) else f"  {name:24s} {value}")


def wait_until_healthy(url: str, timeout_s: float, poll_s: float = 1.0) -> None:
    """Poll ``url``/health until it answers 200; TimeoutError (with the last answer) after ``timeout_s``."""
    import httpx

    deadline = time.monotonic() + timeout_s
    last_error = "no answer yet"
    while True:
        try:
            response = httpx.get(f"{url}/health", timeout=10)
            if response.status_code == 200:
                return
            last_error = f"HTTP {response.status_code}"
        except httpx.HTTPError as error:
            last_error = type(error).__name__
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}/health not healthy within {timeout_s} s ({last_error})")
        time.sleep(poll_s)


def wait(args) -> int:
    try:
        wait_until_healthy(args.url, args.timeout, poll_s=2)
    except TimeoutError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"healthy: {args.url}")
    return 0


def grpc_call(args) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from protos.hetspec.v1 import hetspec_pb2 as pb
    from protos.hetspec.v1 import hetspec_pb2_grpc as pb_grpc

    request = pb.GenerateRequest(prompt=args.prompt, max_new_tokens=args.max_new_tokens,
                                 temperature=args.temperature, algorithm=args.algorithm or "")
    if args.draft_tokens:
        request.draft_tokens = args.draft_tokens
    if args.pipelined is not None:
        request.pipelined = args.pipelined
    metadata = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else ()
    if args.application:  # Serve routes gRPC by this metadata once it runs several applications
        metadata += (("application", args.application),)
    with grpc.insecure_channel(args.target) as channel:
        stub = pb_grpc.HetSpecStub(channel)
        try:
            if args.stream:
                pieces, last = [], None
                for message in stub.GenerateStream(request, timeout=args.timeout, metadata=metadata):
                    pieces.append(message.text)
                    last = message
                text, response = "".join(pieces), last
            else:
                response = stub.Generate(request, timeout=args.timeout, metadata=metadata)
                text = response.text
        except grpc.RpcError as error:
            print(f"error: gRPC {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    stats = MessageToDict(response.stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    stats["generated_tokens"] = response.usage.completion_tokens
    _print_result("grpc" + (" stream" if args.stream else ""), text, response.finish_reason, stats)
    return 0


def http_call(args) -> int:
    import openai

    client = openai.OpenAI(base_url=f"{args.url}/v1", api_key=args.api_key or "unused", max_retries=0, timeout=args.timeout)
    model = client.models.list().data[0].id
    extension = {key: value for key, value in (("algorithm", args.algorithm), ("draft_tokens", args.draft_tokens),
                                               ("pipelined", args.pipelined)) if value is not None}
    options = dict(model=model, max_tokens=args.max_new_tokens, temperature=args.temperature,
                   stream=args.stream, extra_body={"hetspec": extension})
    try:
        if args.chat:
            result = client.chat.completions.create(messages=[{"role": "user", "content": args.prompt}], **options)
        else:
            result = client.completions.create(prompt=args.prompt, **options)
        text, finish_reason, stats = _collect(result, args.chat, args.stream)
    except openai.APIError as error:
        print(f"error: HTTP {getattr(error, 'status_code', '?')}: {error.message}", file=sys.stderr)
        return 1
    _print_result("http " + ("chat" if args.chat else "completion") + (" stream" if args.stream else ""),
                  text, finish_reason, stats)
    return 0


def _collect(result, chat: bool, stream: bool) -> tuple[str, str, dict]:
    if not stream:
        choice = result.choices[0]
        text = choice.message.content if chat else choice.text
        return text, choice.finish_reason, result.model_extra["hetspec"]["stats"]
    pieces, finish_reason, stats = [], None, {}
    for chunk in result:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        pieces.append((choice.delta.content or "") if chat else choice.text)
        finish_reason = choice.finish_reason or finish_reason
        stats = chunk.model_extra.get("hetspec", {}).get("stats", stats)
    return "".join(pieces), finish_reason, stats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    waiter = commands.add_parser("wait", help="wait until GET /health answers 200")
    waiter.add_argument("--url", default="http://127.0.0.1:8000")
    waiter.add_argument("--timeout", type=float, default=600)
    for name in ("grpc", "http"):
        command = commands.add_parser(name, help=f"one generation over {name}")
        if name == "grpc":
            command.add_argument("--target", default="127.0.0.1:9000", help="host:port of Serve's gRPC proxy")
            command.add_argument("--application", help="the Serve application's name (e.g. hetspec), sent as gRPC "
                                 "'application' metadata: needed when Serve runs more than one application")
        else:
            command.add_argument("--url", default="http://127.0.0.1:8000")
            command.add_argument("--chat", action="store_true", help="/v1/chat/completions instead of completions")
        command.add_argument("--prompt", required=True)
        command.add_argument("--max-new-tokens", type=int, default=64)
        command.add_argument("--temperature", type=float, default=0.0)
        command.add_argument("--algorithm", default=None, help="auto, ar, sd, slem, tli, slrs")
        command.add_argument("--draft-tokens", type=int, default=None)
        command.add_argument("--pipelined", action=argparse.BooleanOptionalAction, default=None)
        command.add_argument("--stream", action="store_true")
        command.add_argument("--timeout", type=float, default=600)
        command.add_argument("--api-key", default=os.environ.get("HETSPEC_API_KEY") or None,
                             help="the server's API key (default: $HETSPEC_API_KEY; none: send no key)")
    args = parser.parse_args()
    return {"wait": wait, "grpc": grpc_call, "http": http_call}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
