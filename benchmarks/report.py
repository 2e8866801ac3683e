"""Where a result came from (command, commit, machine, date) and its Markdown rendering."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch
import transformers

from hetspec.linear import native_bfloat16

REPO_ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_kernels() -> str:
    """The instruction set torch's CPU kernels use here, and whether the CPU multiplies bfloat16 natively: the same
    model's pass prices differ by this (``hetspec.linear.slow_dtype_warning``), so every result records it."""
    return (f"{torch.backends.cpu.get_cpu_capability()}, "
            f"bf16: {'native' if native_bfloat16() else 'emulated'}")


def describe_machine(machine: dict) -> str:
    """'<cpu model> (<kernels>), <n> cores' for a result's Markdown; results recorded before ``cpu_kernels`` lack it."""
    kernels = f" ({machine['cpu_kernels']})" if machine.get("cpu_kernels") else ""
    return f"{machine['cpu_model']}{kernels}, {machine['cpu_cores']} cores"


def machine_info(device: str) -> dict:
    info = {"cpu_model": cpu_model(), "cpu_kernels": cpu_kernels(), "cpu_cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "device": device,
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None}
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def provenance(argv: list[str], device: str, module: str = "benchmarks.bench") -> dict:
    status = _git("status", "--porcelain", "--", "hetspec", "benchmarks")
    return {"command": " ".join(shlex.quote(part) for part in [sys.executable, "-m", module, *argv]),
            "git_commit": _git("rev-parse", "HEAD"), "git_dirty": bool(status) if status is not None else None,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_info(device)}


def write_result(out: Path, result: dict, readme: str) -> None:
    """A run's folder: ``result.json`` (everything measured) and ``README.md`` (its tables), and the tables printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "README.md").write_text(readme)
    print(readme)


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


COLUMNS = [("method", "method", 0), ("tokens_per_second", "tok/s", 2), ("speedup_vs_ar_median", "speedup (median)", 2),
           ("speedup_vs_ar_geomean", "speedup (geo)", 2), ("ms_per_token", "ms/token", 1),
           ("tokens_per_target_pass", "tokens/target pass", 2), ("acceptance_rate", "acceptance", 2),
           ("drafter_share", "drafter share", 2), ("other_ms_per_token", "other ms/token", 1),
           ("ideal_speedup_geomean", "ideal speedup", 2), ("efficiency_geomean", "measured/ideal", 2),
           ("priced_share_geomean", "priced share", 2), ("output_identical_to_ar", "same as ar", 0)]


def summary_table(summary: list[dict]) -> str:
    lines = ["| " + " | ".join(title for _, title, _ in COLUMNS) + " |",
             "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for row in summary:
        lines.append("| " + " | ".join(_fmt(row[key], digits) for key, _, digits in COLUMNS) + " |")
    return "\n".join(lines)


PEER_COLUMNS = [("method", "peer", 0), ("tokens_per_second", "tok/s", 2),
                ("speedup_vs_ar_median", "speedup (median)", 2), ("speedup_vs_ar_geomean", "speedup (geo)", 2),
                ("ms_per_token", "ms/token", 1),
                ("prompts_same_as_ar", "prompts with ar's tokens", 0)]


def peer_table(rows: list[dict]) -> str:
    """The peers outside the harness (llama.cpp): wall-clock figures only, no forward counts."""
    lines = ["| " + " | ".join(title for _, title, _ in PEER_COLUMNS) + " |",
             "|" + "|".join("---" for _ in PEER_COLUMNS) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row[key], digits) for key, _, digits in PEER_COLUMNS) + " |")
    return "\n".join(lines)


def divergence_lines(summary: list[dict]) -> list[str]:
    lines = []
    for row in summary:
        for item in row["divergences"]:
            margin = item.get("target_top2_margin")
            lines.append(f"- {row['method']} on {item['prompt_id']}: first differs at output position "
                         f"{item['position']} (ar token {item['reference_token']}, this run "
                         f"{item['method_token']}); target top-2 logit margin there: {_fmt(margin, 4)}")
    return lines


def markdown(result: dict) -> str:
    meta, settings, head = result["meta"], result["settings"], result["headline"]
    machine = meta["machine"]
    out = [f"# hetspec benchmark: {settings['pair_label']}, {settings['task']}", "",
           f"- target `{settings['target']}`, drafter `{settings['drafter']}`, {settings['dtype']}, "
           f"device {settings['device']}",
           f"- {settings['num_prompts']} prompts, {settings['max_new_tokens']} new tokens, "
           f"temperature {settings['temperature']}, chat template: {settings['chat']}",
           f"- machine: {describe_machine(machine)}, torch threads "
           f"{machine['torch_threads']}{', GPU ' + machine['gpu'] if machine.get('gpu') else ''}; "
           f"load average at start {machine.get('load_average')}",
           f"- date {meta['date']}, commit {meta['git_commit']}{' (uncommitted changes)' if meta['git_dirty'] else ''}",
           f"- command: `{meta['command']}`", ""]
    if result.get("note"):
        out += [f"> {result['note']}", ""]
    out += [summary_table(result["summary"]), "",
            "speedup: per-prompt tokens/s over `ar` (hetspec, target alone). ideal speedup: what the measured "
            "acceptance and the per-pass prices allow (each size's median over the runs); measured/ideal is the "
            "implementation efficiency; priced share = forwards at those prices / wall time (ar's well below 1: "
            "the baseline ran on a slower machine and the speedups of its prompts are inflated). "
            "See benchmarks/README.md.", ""]
    peers = result.get("peers") or {}
    if peers.get("summary"):
        out += ["## Peers outside the harness", "", peer_table(peers["summary"]), "",
                *(f"- {name}: {settings}" for name, settings in peers["settings"].items()), "",
                "llama.cpp decodes the target's GGUF file as it is (quantized weights), greedy, the same prompt "
                "token ids; its tokens may part from ar's where the two runtimes' numerics differ "
                "(benchmarks/llama_peer.py).", ""]
    elif peers.get("skipped"):
        out += [f"> {peers['skipped']}", ""]
    if head["best_hetspec"]:
        out += ["## Against the issue's targets", "",
                f"- best hetspec: {head['best_hetspec']}: {_fmt(head['speedup_vs_ar'])}x over ar "
                f"(target >= {head['targets']['speedup_vs_ar']})",
                f"- best transformers peer (assisted generation or prompt lookup): {head['best_hf']}: "
                f"{_fmt(head['hf_speedup_vs_ar'])}x; hetspec / transformers = {_fmt(head['speedup_vs_best_hf'])} "
                f"(target >= {head['targets']['speedup_vs_best_hf']})",
                f"- measured / ideal speedup of the best hetspec method: {_fmt(head['efficiency'])} "
                f"(target >= {head['targets']['efficiency']})", ""]
    diverged = divergence_lines(result["summary"])
    if diverged:
        out += ["## Outputs that differ from ar", "", *diverged, ""]
    return "\n".join(out)


def line_plot(series: dict[str, list[tuple[float, float]]], xticks: list, xlabel: str, ylabel: str, title: str,
              path: Path) -> None:
    """One line per name through its (x, y) points, saved as a PNG (the throughput plots of batch_bench and
    serve_scaling)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name, points in series.items():
        axes.plot([x for x, _ in points], [y for _, y in points], marker="o", label=name)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_xticks(xticks)
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
