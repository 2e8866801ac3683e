"""PNG figures of benchmark results; also a command that combines several result folders.

    python -m benchmarks.plots benchmarks/results/A benchmarks/results/B --out benchmarks/results/combined
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

DRAFT_ORDER = ["3", "5", "adaptive", "default", "heuristic"]


def _draft_key(draft: str) -> tuple[int, float, str]:
    if draft in DRAFT_ORDER:
        return (DRAFT_ORDER.index(draft), 0, draft)
    return (-1, float(draft) if draft.isdigit() else 0, draft)


def speedup_plot(summary: list[dict], title: str, path: Path) -> None:
    """Geometric-mean speedup over ar, grouped by algorithm, one bar per draft setting."""
    rows = [row for row in summary if row["draft"] != "-" and row["speedup_vs_ar_geomean"]]
    families = list(dict.fromkeys(row["family"] for row in rows))
    drafts = sorted({row["draft"] for row in rows}, key=_draft_key)
    figure, axes = plt.subplots(figsize=(max(6.0, 1.6 * len(families) + 2), 4.2))
    width = 0.8 / max(len(drafts), 1)
    for index, draft in enumerate(drafts):
        values = {row["family"]: row["speedup_vs_ar_geomean"] for row in rows if row["draft"] == draft}
        positions = [slot + index * width for slot, family in enumerate(families) if family in values]
        heights = [values[family] for family in families if family in values]
        label = f"k={draft}" if draft.isdigit() else draft
        bars = axes.bar(positions, heights, width, label=label)
        axes.bar_label(bars, fmt="%.2f", fontsize=7)
    for row in summary:
        if row["method"] == "hf-greedy" and row["speedup_vs_ar_geomean"]:
            axes.axhline(row["speedup_vs_ar_geomean"], color="grey", linestyle=":", label="hf-greedy")
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xticks([slot + width * (len(drafts) - 1) / 2 for slot in range(len(families))], families)
    axes.set_ylabel("speedup over ar (tokens/s, geometric mean)")
    axes.set_title(title, fontsize=9)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def acceptance_plot(summaries: dict[str, list[dict]], path: Path) -> None:
    """Acceptance rate and tokens per target pass of every drafting method, one bar group per pair."""
    figure, (rate_axes, pass_axes) = plt.subplots(1, 2, figsize=(12, 4.5))
    methods = list(dict.fromkeys(row["method"] for summary in summaries.values() for row in summary
                                 if row["draft"] != "-"))
    width = 0.8 / max(len(summaries), 1)
    for index, (pair, summary) in enumerate(summaries.items()):
        by_method = {row["method"]: row for row in summary}
        for axes, key in ((rate_axes, "acceptance_rate"), (pass_axes, "tokens_per_target_pass")):
            slots = [slot for slot, method in enumerate(methods) if by_method.get(method, {}).get(key) is not None]
            axes.bar([slot + index * width for slot in slots], [by_method[methods[slot]][key] for slot in slots],
                     width, label=pair)
    for axes, label in ((rate_axes, "acceptance rate (accepted / drafted)"),
                        (pass_axes, "output tokens per target pass")):
        axes.set_xticks([slot + width * (len(summaries) - 1) / 2 for slot in range(len(methods))], methods,
                        rotation=60, ha="right", fontsize=7)
        axes.set_ylabel(label)
        axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_plots(result: dict, folder: Path) -> list[str]:
    settings = result["settings"]
    title = (f"{settings['pair_label']}: {settings['target']} <- {settings['drafter']}, {settings['dtype']}, "
             f"{settings['task']}, {settings['max_new_tokens']} tokens")
    speedup_plot(result["summary"], title, folder / "speedup.png")
    acceptance_plot({settings["pair_label"]: result["summary"]}, folder / "acceptance.png")
    return ["speedup.png", "acceptance.png"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Combine benchmark result folders into acceptance-by-pair plots.")
    parser.add_argument("folders", nargs="+", type=Path, help="result folders holding results.json")
    parser.add_argument("--out", type=Path, required=True, help="folder for the combined PNGs")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    summaries = {}
    for folder in args.folders:
        result = json.loads((folder / "results.json").read_text())
        summaries[f"{result['settings']['pair_label']} ({folder.name})"] = result["summary"]
    acceptance_plot(summaries, args.out / "acceptance_by_pair.png")
    print(args.out / "acceptance_by_pair.png")


if __name__ == "__main__":
    main()
