import subprocess, sys, glob, time
from pathlib import Path
sys.path.insert(0, "/tmp/probe")
from benchmarks.serve_scaling import Served
checkout = Path("/tmp/probe")
cfg = Path("/work/main/benchmarks/results/serve-scaling-spent-f32/config.yaml")
with Served(checkout, cfg, Path("/tmp/probe_serve.log")):
    for proto, algo in (("grpc", "ar"), ("http", "ar"), ("grpc", "slem")):
        subprocess.run([sys.executable, "-m", "benchmarks.serve_bench", "--protocol", proto, "--concurrency", "1",
                        "--requests", "3", "--max-new-tokens", "64", "--task", "humaneval", "--num-prompts", "3",
                        "--warmup", "1", "--label", f"probe-{proto}-{algo}", "--out", f"/tmp/probe_out/{proto}-{algo}",
                        "--algorithm", algo], cwd=checkout, check=True, env={**__import__("os").environ, "PYTHONPATH": str(checkout)})
    time.sleep(2)
    for f in glob.glob("/tmp/ray/session_latest/logs/serve/*.log"):
        for line in open(f, errors="replace"):
            if "PROBE" in line:
                print(line[:400].strip())
