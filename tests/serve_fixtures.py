"""A Serve deployment of hetspec for the tests: the small pair (float32) on a simulated three-node cluster.

Imported by tests/test_serve.py and tests/test_limits_serve.py (``from serve_fixtures import ...``). One
app serves every test of a module so the two models load once: the coordinator, drafter and target bundles are STRICT_SPREAD over
three nodes (custom resources name them), which is also what the placement test checks. The private Ray
instance itself is deployments/local_serve.py's, shared with tests/test_multinode.py and benchmarks/soak.py.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from deployments.local_serve import local_serve

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
    serve_config = yaml.safe_load(SMALL_CONFIG.read_text())
    serve_config["applications"][0]["args"] = args
    with local_serve(serve_config, NODES) as served:
        yield ServedApp(served.http_url, served.grpc_target, args, args["model_id"], served.metrics_urls)


@pytest.fixture(scope="module")
def served_app():
    """The small pair with config.small.yaml's settings (no API key), short answers by default."""
    args = small_app_args(pipeline={"placement_strategy": "STRICT_SPREAD"},
                          limits={"default_max_new_tokens": NEW_TOKENS})
    with serve_app(args) as app:
        yield app
