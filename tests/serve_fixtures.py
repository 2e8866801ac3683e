"""A Serve deployment of hetspec for the tests: the small pair (float32) on a simulated three-node cluster.

Imported by tests/test_serve.py, tests/test_limits_serve.py and others (``from serve_fixtures import ...``). One
app serves every test of a module so the two models load once: the coordinator, drafter and target bundles are STRICT_SPREAD over
three nodes (custom resources name them), which is also what the placement test checks.

Ray 2.60 turns token authentication on for a new local cluster and writes a token to ~/.ray/auth_token;
the tests set RAY_AUTH_MODE=disabled instead (a private cluster bound to 127.0.0.1, nothing written
under the home folder). See deployments/README.md, "Token authentication".
"""

from __future__ import annotations

import os
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from deployments.client import wait_until_healthy

REPO = Path(__file__).resolve().parent.parent
SMALL_CONFIG = REPO / "deployments" / "config.small.yaml"
NODE_RESOURCES = ({"node_head": 1.0}, {"node_a": 1.0}, {"node_b": 1.0})
NEW_TOKENS = 16


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def small_app_args(**overrides) -> dict:
    """The ``args`` of config.small.yaml with some sections updated (e.g. pipeline={...})."""
    args = yaml.safe_load(SMALL_CONFIG.read_text())["applications"][0]["args"]
    for section, values in overrides.items():
        args[section] = {**args.get(section, {}), **values} if isinstance(values, dict) else values
    return args


def grpc_servicer_functions() -> list[str]:
    return yaml.safe_load(SMALL_CONFIG.read_text())["grpc_options"]["grpc_servicer_functions"]


def serve_logs_dir() -> Path:
    """Serve's log folder of this session; the simulated nodes share the head's session folder.

    Private API: Ray 2.60 has no public accessor for the session's log folder."""
    import ray

    return Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"


def serve_log_sizes() -> dict[Path, int]:
    """Each Serve log file's size now: where serve_log_since starts reading."""
    return {path: path.stat().st_size for path in serve_logs_dir().glob("*.log")}


def serve_log_since(sizes: dict[Path, int], request_id: str, timeout_s: float = 30) -> dict[str, str]:
    """What each Serve log file (by name) gained since ``sizes``, once the proxy's and a replica's access line
    of ``request_id`` are there (both are written after the answer is sent)."""
    deadline = time.monotonic() + timeout_s
    while True:
        gained = {}
        for path in serve_logs_dir().glob("*.log"):
            with path.open("rb") as log:
                log.seek(sizes.get(path, 0))
                gained[path.name] = log.read().decode(errors="replace")
        logged_by = {name.split("_")[0] for name, text in gained.items() if request_id in text}
        if {"proxy", "replica"} <= logged_by:
            return gained
        if time.monotonic() > deadline:
            raise AssertionError(f"request {request_id} not in the proxy's and a replica's log after {timeout_s} s "
                                 f"(found in: {sorted(logged_by)})")
        time.sleep(0.2)



def assert_nothing_logged_as_an_error(sizes: dict[Path, int], request_id: str) -> None:
    """No ERROR line and no traceback in Serve's logs since ``sizes``, once ``request_id`` was logged."""
    for name, text in serve_log_since(sizes, request_id).items():
        assert "Traceback" not in text and not any(line.startswith("ERROR") for line in text.splitlines()), \
            f"{name}:\n{text}"

@dataclass
class ServedApp:
    http_url: str  # e.g. http://127.0.0.1:PORT
    grpc_target: str  # e.g. 127.0.0.1:PORT
    args: dict
    model_id: str
    metrics_urls: tuple[str, ...] = ()  # each node's Prometheus endpoint (Ray's metrics export port)


@contextmanager
def serve_app(args: dict):
    """serve.run of build_app(args) on three simulated nodes (STRICT_SPREAD fits them); shut down afterwards."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster
    from ray.serve.config import gRPCOptions

    from deployments.app import build_app

    saved = {name: os.environ.get(name) for name in ("RAY_AUTH_MODE", "PYTHONPATH", "HETSPEC_API_KEY")}
    os.environ["RAY_AUTH_MODE"] = "disabled"
    # Serve's gRPC proxy imports the stubs outside any runtime_env: the repo must be on every process's path.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), saved["PYTHONPATH"]]))
    os.environ.pop("HETSPEC_API_KEY", None)  # a key in the developer's shell must not turn on the app's auth
    metrics_ports = [free_port() for _ in NODE_RESOURCES]
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": NODE_RESOURCES[0],
                                                            "metrics_export_port": metrics_ports[0]})
    for resources, metrics_port in zip(NODE_RESOURCES[1:], metrics_ports[1:]):
        cluster.add_node(num_cpus=1, resources=resources, metrics_export_port=metrics_port)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        http_port, grpc_port = free_port(), free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": http_port},
                    grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=grpc_servicer_functions()))
        serve.run(build_app(args), name="hetspec", route_prefix="/", blocking=False)
        wait_until_healthy(f"http://127.0.0.1:{http_port}", timeout_s=300, poll_s=0.5)
        yield ServedApp(f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", args, args["model_id"],
                        tuple(f"http://127.0.0.1:{port}/metrics" for port in metrics_ports))
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


@pytest.fixture(scope="module")
def served_app():
    """The small pair with config.small.yaml's settings (no API key), short answers by default."""
    args = small_app_args(pipeline={"placement_strategy": "STRICT_SPREAD"},
                          limits={"default_max_new_tokens": NEW_TOKENS})
    with serve_app(args) as app:
        yield app
