"""Model registry, loading errors and the command line."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hetspec import registry
from hetspec.models import resolve_source

REPO = Path(__file__).resolve().parent.parent


def _imported_top_level_names(path: Path) -> set[str]:
    """The top-level module of every absolute import in the file, at any depth (lazy imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_library_imports_nothing_of_ours_above_it():
    """hetspec/ is the bottom layer: deployments/ and protos/ sit on it (Ray, gRPC), and benchmarks/, tests/ and
    scripts/ are not even installed (pyproject packages hetspec, deployments and protos), so an import of them
    breaks a regular install (as ``hetspec bench`` importing benchmarks did)."""
    ours_above = {path.name for path in REPO.iterdir()
                  if path.is_dir() and path.name != "hetspec" and not path.name.startswith(".") and any(path.glob("*.py"))}
    assert {"benchmarks", "deployments", "protos", "tests"} <= ours_above  # the scan looks for the right names
    imports_from_above = {str(path.relative_to(REPO)): sorted(_imported_top_level_names(path) & ours_above)
                          for path in sorted((REPO / "hetspec").rglob("*.py"))}
    assert len(imports_from_above) > 10  # every module of the library was read
    assert {path: names for path, names in imports_from_above.items() if names} == {}


def test_registry_refuses_a_wrong_sha256(tmp_path, monkeypatch):
    package_dir = tmp_path / "packages"
    (package_dir / "pkg_part1" / "data").mkdir(parents=True)
    (package_dir / "pkg_part1" / "data" / "a.bin").write_bytes(b"not the model")
    model = registry.OfflineModel("fake", "test", ("fake==1",), ("pkg_part1/data/*.bin",), "fake.gguf", "0" * 64)
    with pytest.raises(registry.ModelIntegrityError, match="sha256"):
        registry._join_chunks(model, package_dir, tmp_path / "fake.gguf")
    assert not (tmp_path / "fake.gguf").exists()
    assert not (tmp_path / "fake.gguf.partial").exists()


def test_registry_joins_chunks_in_order(tmp_path):
    package_dir = tmp_path / "packages"
    for index, payload in [(1, b"hello "), (2, b"world")]:
        (package_dir / f"pkg_part{index}" / "data").mkdir(parents=True)
        (package_dir / f"pkg_part{index}" / "data" / "x.bin").write_bytes(payload)
    import hashlib
    digest = hashlib.sha256(b"hello world").hexdigest()
    model = registry.OfflineModel("fake", "test", (), ("pkg_part1/data/*.bin", "pkg_part2/data/*.bin"), "f.gguf", digest)
    registry._join_chunks(model, package_dir, tmp_path / "f.gguf")
    assert (tmp_path / "f.gguf").read_bytes() == b"hello world"


def test_unknown_model_names_are_explained(tmp_path):
    with pytest.raises(KeyError, match="known: gemma3-270m"):
        registry.resolve("gemma-9000")
    with pytest.raises(ValueError, match="not a short name"):
        resolve_source("no-such-model")
    with pytest.raises(FileNotFoundError):
        resolve_source(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="model folder .* does not exist"):
        resolve_source(str(tmp_path / "missing-model"))
    assert resolve_source("Qwen/Qwen2.5-Coder-7B-Instruct") == ("Qwen/Qwen2.5-Coder-7B-Instruct", None)
    assert resolve_source(str(tmp_path)) == (str(tmp_path), None)


def _cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "hetspec.cli", *args], capture_output=True, text=True, input=stdin,
                          timeout=600)


@pytest.mark.real
def test_cli_generate_json_matches_target_alone():
    common = ["generate", "--target", "gemma3-270m", "--drafter", "smollm2-135m", "--dtype", "float32",
              "--max-new-tokens", "16", "--json"]
    speculative = _cli(*common, "--algorithm", "slem", "The capital of France is")
    assert speculative.returncode == 0, speculative.stderr
    alone = _cli(*common, "--algorithm", "ar", stdin="The capital of France is")
    assert alone.returncode == 0, alone.stderr
    ours, reference = json.loads(speculative.stdout), json.loads(alone.stdout)
    assert ours["token_ids"] == reference["token_ids"] and ours["text"] == reference["text"]
    assert ours["stats"]["algorithm"] == "slem" and ours["stats"]["target_forwards"] < 16
    assert "loading gemma3-270m" in speculative.stderr  # the progress indication


def test_cli_rejects_bad_arguments_with_the_field_name():
    result = _cli("generate", "--temperature", "-1", "hi")
    assert result.returncode == 2 and "--temperature" in result.stderr
    result = _cli("generate", "--top-p", "0", "hi")
    assert result.returncode == 2 and "--top-p" in result.stderr
    result = _cli("generate", "--algorithm", "magic", "hi")
    assert result.returncode == 2 and "--algorithm" in result.stderr
    result = _cli("generate", "--algorithm", "tli", "--tree-width", "2", "hi")
    assert result.returncode == 2 and "--tree-width" in result.stderr and "exact match" in result.stderr
    result = _cli("generate", "--linear", "onednn", "--dtype", "bfloat16", "hi")
    assert result.returncode == 2 and "--linear" in result.stderr and "float32" in result.stderr


@pytest.mark.real
def test_cli_prompts_file_prints_one_result_per_line_in_order(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"The capital of France is"\n\n'
                       '{"prompt": "def add(a, b):", "max_new_tokens": 5}\n'
                       '{"prompt": "Once upon a time", "temperature": 0.8, "seed": 3}\n')
    common = ["generate", "--target", "gemma3-270m", "--drafter", "smollm2-135m", "--dtype", "float32",
              "--max-new-tokens", "8", "--prompts-file", str(prompts)]
    batched = _cli(*common, "--algorithm", "slem", "--batch-size", "2")
    assert batched.returncode == 0, batched.stderr
    alone = _cli(*common, "--algorithm", "ar", "--batch-size", "1")
    assert alone.returncode == 0, alone.stderr
    ours = [json.loads(line) for line in batched.stdout.splitlines()]
    reference = [json.loads(line) for line in alone.stdout.splitlines()]
    assert [result["index"] for result in ours] == [0, 1, 2]
    assert [result["token_ids"] for result in ours] == [result["token_ids"] for result in reference]
    assert len(ours[1]["token_ids"]) <= 5 and ours[0]["stats"]["mean_batch_size"] > 1


def test_cli_prompts_file_errors_name_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('"fine"\n{"prompt": "x", "temperature": -1}\n')
    result = _cli("generate", "--prompts-file", str(bad))
    assert result.returncode == 2 and "line 2" in result.stderr and "temperature" in result.stderr
    result = _cli("generate", "--prompts-file", str(bad), "also a prompt")
    assert result.returncode == 2 and "not both" in result.stderr
