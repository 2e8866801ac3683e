"""A screenshot of the Ray dashboard's Actors tab with two replicas of the small pair (docs/operations.md).

Serves deployments/config.small.yaml with two replicas on a private Ray instance (deployments/tools/local_serve.py; one
simulated node with 4 CPUs, so both pipelines fit a small machine), lists the named actors and their reprs
(Ray's state API, as ``ray list actors --detail``), then loads the dashboard's Actors tab in headless Chromium
(Debian's ``chromium``) and saves the page.

    python scripts/dashboard_screenshot.py [--out docs/images/ray-dashboard-actors.png]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from deployments.tools.local_serve import free_port, local_serve  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "images" / "ray-dashboard-actors.png")
    parser.add_argument("--window", default="2200,900", help="Chromium's window size, width,height")
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        parser.error("chromium not found (Debian: apt-get install chromium)")

    serve_config = yaml.safe_load((REPO / "deployments" / "config.small.yaml").read_text())
    app_args = serve_config["applications"][0]["args"]
    app_args["autoscaling"] = {**app_args["autoscaling"], "min_replicas": 2, "max_replicas": 2}
    dashboard_port = free_port()
    head = {"num_cpus": 4, "include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": dashboard_port}
    with local_serve(serve_config, nodes=[head]) as served:
        from ray.util.state import list_actors

        deadline = time.monotonic() + 120
        while True:
            listed = list_actors(address=f"http://127.0.0.1:{dashboard_port}", detail=True, limit=1000)
            ours = sorted((actor.name, actor.state, actor.repr_name) for actor in listed
                          if actor.class_name in ("DrafterWorker", "TargetWorker"))
            if sum(state == "ALIVE" for _, state, _ in ours) == 4 or time.monotonic() > deadline:
                break
            time.sleep(2)
        for name, state, repr_name in ours:
            print(f"{state:6} {name:48} {repr_name}")
        url = f"http://127.0.0.1:{dashboard_port}/#/actors"
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as profile:
            subprocess.run([chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                            f"--user-data-dir={profile}", f"--window-size={args.window}",
                            "--virtual-time-budget=20000", f"--screenshot={args.out}", url],
                           check=True, timeout=180, capture_output=True)
        print(f"{url} -> {args.out} ({served.http_url})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
