"""A Serve deployment of hetspec for the tests: the small pair (float32) on a simulated three-node cluster.

Imported by tests/test_serve.py, tests/test_limits_serve.py and others (``from serve_fixtures import ...``). One
app serves every test of a module so the two models load once: the coordinator, drafter and target bundles are STRICT_SPREAD over
three nodes (custom resources name them), which is also what the placement test checks. The private Ray
instance itself is deployments/tools/local_serve.py's, shared with tests/test_multinode.py and benchmarks/soak.py.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from deployments.tools.local_serve import local_serve

REPO = Path(__file__).resolve().parent.parent
SMALL_CONFIG = REPO / "deployments" / "config.small.yaml"
NODES = tuple({"num_cpus": 1, "resources": resources}
              for resources in ({"node_head": 1.0}, {"node_a": 1.0}, {"node_b": 1.0}))
NEW_TOKENS = 16


def small_app_args(**overrides) -> dict:
    """The ``args`` of config.small.yaml with some sections updated (e.g. pipeline={...})."""
    args = yaml.safe_load(SMALL_CONFIG.read_text())["applications"][0]["args"]
    for section, values in overrides.items():
        args[section] = {**args.get(section, {}), **values} if isinstance(values, dict) else values
    return args


@contextmanager
def in_process_coordinator(target, drafter, **overrides):
    """(coordinator, target worker, drafter worker): the served decode loop on worker objects in this process, for
    the config.small.yaml args with ``overrides`` (as ``small_app_args``) and the given models; the workers shut
    down on exit (the ``exit_stack`` fixture of tests/conftest.py enters it for a test)."""
    from deployments.config import AppConfig
    from deployments.serving.coordinator import Coordinator
    from deployments.workers.clients import LocalWorker
    from deployments.workers.model_workers import DrafterWorker, TargetWorker

    config = AppConfig.model_validate(small_app_args(**overrides))
    with (TargetWorker(target, config.pipeline) as target_worker,
          DrafterWorker(drafter, config.pipeline) as drafter_worker):  # a drafter that fails to build: the target ends
        drafter_worker.attach_target(target_worker.info())
        yield (Coordinator(config, LocalWorker(target_worker), LocalWorker(drafter_worker), target_worker.info(),
                           drafter_worker.info()), target_worker, drafter_worker)


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
def serve_app(args: dict, keep_api_key: bool = False):
    """serve.run of build_app(args) on three simulated nodes (STRICT_SPREAD fits them); shut down afterwards.
    ``keep_api_key``: the Ray processes (replicas and proxy) see this process's $HETSPEC_API_KEY."""
    serve_config = yaml.safe_load(SMALL_CONFIG.read_text())
    serve_config["applications"][0]["args"] = args
    with local_serve(serve_config, NODES, keep_api_key=keep_api_key) as served:
        yield ServedApp(served.http_url, served.grpc_target, args, args["model_id"], served.metrics_urls)


@pytest.fixture(scope="module")
def served_app():
    """The small pair with config.small.yaml's settings (no API key), short answers by default."""
    args = small_app_args(pipeline={"placement_strategy": "STRICT_SPREAD",
                                    "worker_env_vars": {"HETSPEC_TEST_WORKER_ENV": "drafter and target"},
                                    "heap_trim_interval_s": 1.0},
                          limits={"default_max_new_tokens": NEW_TOKENS})
    with serve_app(args) as app:
        yield app


def app_stats(app, headers: dict | None = None, timeout_s: float = 30) -> dict:
    """The app's ``/v1/stats`` (replica and both actors)."""
    import httpx

    response = httpx.get(f"{app.http_url}/v1/stats", headers=headers, timeout=timeout_s)
    assert response.status_code == 200, response.text
    return response.json()


def wait_for_stats(app, condition, what: str, timeout_s: float = 30, headers: dict | None = None,
                   poll_s: float = 0.1, request_timeout_s: float = 30) -> dict:
    """The app's stats once ``condition(stats)`` holds; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = app_stats(app, headers, request_timeout_s)
        if condition(stats):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout_s} s: {stats}")
        time.sleep(poll_s)
