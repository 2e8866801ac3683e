"""Pass time in this process beside one idle server (env from argv: NAME=VALUE ...), its processes stopped or not,
interleaved; plus the server's CPU seconds and context switches while running."""
import json, os, sys, time, statistics, signal
from pathlib import Path
import psutil, torch
sys.path.insert(0, "/work/main")
from benchmarks.serve_scaling import Served
from hetspec.models import load_model

REPO = Path("/work/main")
label = sys.argv[1]
for item in sys.argv[2:]:
    name, value = item.split("=", 1); os.environ[name] = value
target = load_model("qwen2.5-coder-1.5b", dtype="float32", threads=2)
model = target.model
ids = torch.tensor([target.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")])

def passes(n_runs=2, tokens=24):
    times = []
    for _ in range(n_runs):
        with torch.inference_mode():
            out = model(ids, use_cache=True); past = out.past_key_values; token = out.logits[:, -1:].argmax(-1)
            for _ in range(tokens):
                start = time.perf_counter()
                out = model(token, past_key_values=past, use_cache=True)
                times.append(time.perf_counter() - start)
                past = out.past_key_values; token = out.logits[:, -1:].argmax(-1)
    return times

def server_processes():
    me = os.getpid(); found = []
    for process in psutil.process_iter():
        try:
            command = " ".join(process.cmdline())
        except Exception:
            continue
        if process.pid != me and ("ray" in command or "serve run" in command or "/work/main/.venv" in command):
            found.append(process)
    return found

def counters():
    cpu = switches = 0.0
    for process in server_processes():
        try:
            times = process.cpu_times(); ctx = process.num_ctx_switches()
            cpu += times.user + times.system; switches += ctx.voluntary + ctx.involuntary
        except psutil.Error:
            pass
    return cpu, switches

def signal_all(sig):
    for process in server_processes():
        try: process.send_signal(sig)
        except psutil.Error: pass

results = {"stopped": [], "running": []}
idle = {"cpu_s": 0.0, "switches": 0.0, "wall_s": 0.0}
passes(1, 8)
with Served(REPO, REPO / "deployments/config.yaml", Path(f"/tmp/probe/serve-{label}.log")):
    time.sleep(20)
    for round_ in range(8):
        for setting in (("stopped", "running") if round_ % 2 == 0 else ("running", "stopped")):
            if setting == "stopped": signal_all(signal.SIGSTOP)
            time.sleep(1)
            c0, s0, t0 = *counters(), time.monotonic()
            times = passes()
            c1, s1, t1 = *counters(), time.monotonic()
            if setting == "stopped": signal_all(signal.SIGCONT)
            else:
                idle["cpu_s"] += c1 - c0; idle["switches"] += s1 - s0; idle["wall_s"] += t1 - t0
            results[setting].append(statistics.median(times))
ratio = statistics.geometric_mean([a / b for a, b in zip(results["running"], results["stopped"])])
summary = {"label": label, "env": sys.argv[2:], "medians_ms": {k: [round(x * 1000, 1) for x in v] for k, v in results.items()},
           "running_over_stopped": round(ratio, 3), "server_cpu_share_of_2_cores": round(idle["cpu_s"] / idle["wall_s"] / 2, 4),
           "server_switches_per_s": round(idle["switches"] / idle["wall_s"], 1)}
print(json.dumps(summary))
with open("/tmp/probe/probe5.jsonl", "a") as f: f.write(json.dumps(summary) + "\n")
