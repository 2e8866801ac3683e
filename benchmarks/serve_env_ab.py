"""The default server with and without deployments/cpu.env (Serve's timers slowed), one client, in ABBA order.

Each server: ``serve run`` of deployments/config.yaml (``--config``) with its target in float32
(``--target-dtype``), one warm-up request, then 3 HumanEval prompts (every 16th) x 64 greedy tokens over HTTP
with speculation off (``ar``) and with the config's own (``auto``). Reports each prompt's tokens/s with the
file over without it, the target's seconds per pass from the statistics, and whether every output is the same
under both.

    python -m benchmarks.serve_env_ab --out benchmarks/results/serve-cpu-env-ab
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx
import yaml

from benchmarks.prompts import load_prompts
from benchmarks.serve_scaling import Served, served_config
from deployments.runtime.cpu_env import CPU_ENV_FILE, cpu_env

REPO = Path(__file__).resolve().parent.parent
SETTINGS = ("without", "with", "with", "without")  # ABBA: drift of the machine falls on both alike


def ask(model: str, prompt: str, algorithm: str) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 64, "temperature": 0,
            "hetspec": {"algorithm": algorithm, "ignore_eos": True}}
    start = time.monotonic()
    reply = httpx.post("http://127.0.0.1:8000/v1/completions", json=body, timeout=600).json()
    wall = time.monotonic() - start
    stats = reply["hetspec"]["stats"]
    return {"wall_s": wall, "tokens": reply["usage"]["completion_tokens"], "text": reply["choices"][0]["text"],
            "target_pass_s": stats["target_seconds"] / max(1, stats["target_forwards"]), "stats": stats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--config", type=Path, default=REPO / "deployments" / "config.yaml")
    parser.add_argument("--target-dtype", default="float32", help="override the config's target dtype")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    config_path = served_config(args, args.out)
    model = yaml.safe_load(config_path.read_text())["applications"][0]["args"]["model_id"]
    prompts = [case.text for case in load_prompts("humaneval", 3, stride=16)]
    file_env, rows = cpu_env(), []
    for round_, setting in enumerate(SETTINGS):
        with Served(REPO, config_path, args.out / f"serve-{round_}-{setting}.log", use_cpu_env=setting == "with"):
            ask(model, prompts[0][:200], "ar")
            for algorithm in ("ar", "auto"):
                for index, prompt in enumerate(prompts):
                    row = ask(model, prompt, algorithm) | {"setting": setting, "round": round_,
                                                          "algorithm": algorithm, "prompt": index}
                    rows.append(row)
                    print(setting, round_, algorithm, index, f"{row['tokens'] / row['wall_s']:.2f} tok/s, "
                          f"{row['target_pass_s'] * 1000:.0f} ms a pass", flush=True)
    summary = {"env_file": str(CPU_ENV_FILE.relative_to(REPO)), "env": file_env}
    for algorithm in ("ar", "auto"):
        ratios = []
        for index in range(len(prompts)):
            speed = {setting: statistics.mean(row["tokens"] / row["wall_s"] for row in rows
                                              if (row["setting"], row["algorithm"], row["prompt"])
                                              == (setting, algorithm, index))
                     for setting in ("with", "without")}
            ratios.append(speed["with"] / speed["without"])
        summary[algorithm] = {"with_over_without": [round(ratio, 3) for ratio in ratios],
                              "geomean": round(statistics.geometric_mean(ratios), 3)}
    outputs = {}
    for row in rows:
        outputs.setdefault((row["algorithm"], row["prompt"]), set()).add(row["text"])
    summary["outputs_identical"] = all(len(texts) == 1 for texts in outputs.values())
    (args.out / "result.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
