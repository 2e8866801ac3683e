"""Keep each RayService's ``serveConfigV2`` a copy of its Serve config file in ``deployments/``.

The Serve config files are the source; this rewrites the embedded copies (``tests/test_cluster_manifests.py``
fails when they drift). One deliberate difference: in a pod the HTTP proxy must listen on every
interface, or the operator's serve Service cannot reach it, so ``http_options.host`` is ``0.0.0.0``.

Usage: ``python cluster/kuberay/sync_serve_config.py`` (rewrites the manifests in place).
"""

from __future__ import annotations

import copy
import re
import sys
import textwrap
from pathlib import Path

import yaml

KUBERAY_DIR = Path(__file__).resolve().parent
REPO_ROOT = KUBERAY_DIR.parents[1]
# manifest -> the Serve config file it embeds
MIRRORS = {
    "rayservice.yaml": "deployments/config.gpu.yaml",
    "rayservice.cpu.yaml": "deployments/config.yaml",
}
POD_HTTP_HOST = "0.0.0.0"
SERVE_CONFIG_BLOCK = re.compile(r"^(?P<indent> *)serveConfigV2: \|[-+]?\n(?:(?P=indent) +.*\n|[ \t]*\n)*", re.MULTILINE)


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


def main() -> int:
    for manifest_name, source in MIRRORS.items():
        path = KUBERAY_DIR / manifest_name
        old_text = path.read_text()
        new_text = with_serve_config(old_text, expected_serve_config(manifest_name), source)
        if new_text != old_text:
            path.write_text(new_text)
            print(f"updated {path.relative_to(REPO_ROOT)} from {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
