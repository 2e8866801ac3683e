"""Keep each RayService's ``serveConfigV2`` a copy of its Serve config file in ``deployments/``, and the CPU
RayService's pods' environment a copy of ``deployments/cpu.env``.

The files in ``deployments/`` are the source; this rewrites the embedded copies (``tests/test_cluster_manifests.py``
fails when they drift). One deliberate difference: in a pod the HTTP proxy must listen on every
interface, or the operator's serve Service cannot reach it, so ``http_options.host`` is ``0.0.0.0``.
The environment: in each container's ``env``, the comment line ``# deployments/cpu.env: <why>`` and the one-line
entries (``- {name: NAME, value: "VALUE"}``) right after it are generated, one per variable of the file; the
container's other variables go before the comment.

Usage: ``python cluster/kuberay/sync_serve_config.py`` (rewrites the manifests in place).
"""

from __future__ import annotations

import copy
import json
import re
import sys
import textwrap
from pathlib import Path

import yaml

KUBERAY_DIR = Path(__file__).resolve().parent
REPO_ROOT = KUBERAY_DIR.parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script from anywhere: deployments/ is the checkout's
    sys.path.insert(0, str(REPO_ROOT))

from deployments.runtime.cpu_env import cpu_env  # noqa: E402  (after the path above)
# manifest -> the Serve config file it embeds
MIRRORS = {
    "rayservice.yaml": "deployments/config.gpu.yaml",
    "rayservice.cpu.yaml": "deployments/config.yaml",
}
POD_HTTP_HOST = "0.0.0.0"
SERVE_CONFIG_BLOCK = re.compile(r"^(?P<indent> *)serveConfigV2: \|[-+]?\n(?:(?P=indent) +.*\n|[ \t]*\n)*", re.MULTILINE)
# manifest -> the environment file every container of its pods carries
ENV_MIRRORS = {"rayservice.cpu.yaml": "deployments/cpu.env"}
ENV_BLOCK = r"^(?P<indent> *)# {source}(?P<why>:.*)?\n(?:(?P=indent)- \{{name: \w+, value: .*\}}\n)*"


def expected_serve_config(manifest_name: str) -> dict:
    """The Serve config a manifest must embed: its source file, with the pod's HTTP bind address."""
    serve_config = copy.deepcopy(yaml.safe_load((REPO_ROOT / MIRRORS[manifest_name]).read_text()))
    serve_config.setdefault("http_options", {})["host"] = POD_HTTP_HOST
    return serve_config


def with_serve_config(manifest_text: str, serve_config: dict, source: str) -> str:
    """``manifest_text`` with its (single) ``serveConfigV2`` block replaced by ``serve_config``."""
    blocks = list(SERVE_CONFIG_BLOCK.finditer(manifest_text))
    if len(blocks) != 1:
        raise ValueError(f"expected one 'serveConfigV2: |' block, found {len(blocks)}")
    block = blocks[0]
    indent = block.group("indent")
    body = f"# Generated from {source} by cluster/kuberay/sync_serve_config.py: edit the source, then rerun.\n"
    body += yaml.safe_dump(serve_config, sort_keys=False, width=110)
    replacement = f"{indent}serveConfigV2: |\n{textwrap.indent(body, indent + '  ')}"
    return manifest_text[:block.start()] + replacement + manifest_text[block.end():]


def with_env(manifest_text: str, env: dict[str, str], source: str) -> str:
    """``manifest_text`` with every ``# <source>`` block of container variables holding exactly ``env``."""
    def block(match: re.Match) -> str:
        indent = match.group("indent")
        # a JSON string is a YAML double-quoted scalar: any value survives
        entries = "".join(f"{indent}- {{name: {name}, value: {json.dumps(value)}}}\n" for name, value in env.items())
        return f"{indent}# {source}{match.group('why') or ''}\n{entries}"

    new_text, count = re.subn(ENV_BLOCK.format(source=re.escape(source)), block, manifest_text, flags=re.MULTILINE)
    if count == 0:
        raise ValueError(f"expected a '# {source}' comment in a container's env")
    return new_text


def synced(manifest_name: str) -> str:
    """The manifest as it must be: its Serve config and its pods' environment from their sources."""
    text = (KUBERAY_DIR / manifest_name).read_text()
    text = with_serve_config(text, expected_serve_config(manifest_name), MIRRORS[manifest_name])
    if manifest_name in ENV_MIRRORS:
        text = with_env(text, cpu_env(REPO_ROOT / ENV_MIRRORS[manifest_name]), ENV_MIRRORS[manifest_name])
    return text


def main() -> int:
    for manifest_name, source in MIRRORS.items():
        path = KUBERAY_DIR / manifest_name
        old_text = path.read_text()
        new_text = synced(manifest_name)
        if new_text != old_text:
            path.write_text(new_text)
            print(f"updated {path.relative_to(REPO_ROOT)} from {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
