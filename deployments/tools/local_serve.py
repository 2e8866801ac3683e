"""A private Ray instance on this machine serving a Serve config of hetspec: the tests' and the soak's server.

Its nodes are simulated (``ray.cluster_utils.Cluster``), each with its own resources and Prometheus port, so
placement and node loss can be tested on one machine; or it is the machine as one node. The proxies listen
on free ports of 127.0.0.1. The app is deployed either as ``serve.run(build_app(args))`` or through the controller from the config's
``import_path`` and ``args`` (``declarative``: the path ``serve deploy`` and KubeRay take, where a change of
``user_config`` alone reconfigures the running replicas).

Ray 2.60 turns token authentication on for a new local cluster and writes a token to ~/.ray/auth_token;
this instance runs with RAY_AUTH_MODE=disabled instead (bound to 127.0.0.1, nothing written under the home
folder). See deployments/README.md, "Token authentication".

    with local_serve(serve_config, nodes=[{"num_cpus": 1, "resources": {"node_head": 1.0}}, ...]) as served:
        httpx.get(f"{served.http_url}/health")
"""

from __future__ import annotations

import copy
import importlib
import os
import random
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from deployments.config import GRPC_MAX_MESSAGE_BYTES
from deployments.tools.client import wait_until_healthy

REPO = Path(__file__).resolve().parents[2]


_HANDED_OUT: set[int] = set()


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_free(port: int) -> bool:
    """Whether nothing listens on ``port`` on any address now (a bind to it succeeds)."""
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port free on every address now, below the kernel's ephemeral range. A port the kernel picked for a
    bind to 0 lies in that range, where the dozens of Ray processes starting next bind their own: one took a
    node's metrics port before its agent did, and the node never started ("timed out during startup")."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, max(20001, _ephemeral_start()))
        if port in _HANDED_OUT or not port_free(port):
            continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as sock:  # a crowded range: the kernel's choice
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class LocalServe:
    serve_config: dict  # what was deployed: the given config with this instance's ports
    cluster: Any  # ray.cluster_utils.Cluster (add_node / remove_node: machines joining, dying); None: one node
    nodes: list  # the cluster's nodes, in the order given (the head first)
    metrics_urls: tuple[str, ...]  # each simulated node's Prometheus endpoint (Ray's metrics export port)

    @property
    def application(self) -> dict:
        return self.serve_config["applications"][0]

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.serve_config['http_options']['port']}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.serve_config['grpc_options']['port']}"


def with_private_ports(serve_config: dict) -> dict:
    """A copy of ``serve_config`` whose proxies listen on free ports of 127.0.0.1, one proxy only (every
    simulated node has the machine's IP: a proxy per node would fight for the ports)."""
    config = copy.deepcopy(serve_config)
    config["proxy_location"] = "HeadOnly"
    config["http_options"] = {**config.get("http_options", {}), "host": "127.0.0.1", "port": free_port()}
    config["grpc_options"] = {**config.get("grpc_options", {}), "port": free_port()}
    return config


@contextmanager
def _private_environment(keep_api_key: bool) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in ("RAY_AUTH_MODE", "PYTHONPATH", "HETSPEC_API_KEY",
                                                     "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE",
                                                     "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH")}
    os.environ["RAY_AUTH_MODE"] = "disabled"
    # the gRPC proxy's message bound (Ray's default is 2 GiB): a larger request is refused before a replica sees it
    os.environ["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"] = str(GRPC_MAX_MESSAGE_BYTES)
    # the API key checked in the proxy, before routing (deployments/proxy.py), when $HETSPEC_API_KEY is kept
    os.environ["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] = "deployments.proxy:proxy_middlewares"
    # Serve's gRPC proxy and the controller's app builder import the repo outside any runtime_env (as the
    # image does): it must be on every process's path.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), saved["PYTHONPATH"]]))
    if not keep_api_key:  # a key in the developer's shell must not turn on the app's auth
        os.environ.pop("HETSPEC_API_KEY", None)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _private_cluster(nodes: Sequence[dict], metrics_ports: Sequence[int]) -> tuple[Any, list]:
    """A Cluster of ``nodes`` whose address is not left in /tmp/ray/ray_current_cluster; its nodes, in order.

    Cluster publishes its address there, and any ``ray.init()`` (or ``serve.start``) on this machine
    without an address then joins it: a test running at the same time would deploy into this cluster.
    """
    from ray._private.utils import get_ray_address_file
    from ray.cluster_utils import Cluster

    address_file = Path(get_ray_address_file(None))
    previous = address_file.read_text() if address_file.exists() else None
    # the dashboard (and the state API behind ``ray list actors``) on a free port: Ray's default 8265 held by
    # another instance on this machine leaves this one without a dashboard (Ray only logs the failed bind)
    cluster = Cluster(initialize_head=True, head_node_args={**nodes[0], "metrics_export_port": metrics_ports[0],
                                                            "dashboard_host": "127.0.0.1",
                                                            "dashboard_port": free_port()})
    if previous is None:
        address_file.unlink(missing_ok=True)
    else:
        address_file.write_text(previous)
    added = [cluster.add_node(**node, metrics_export_port=metrics_port)
             for node, metrics_port in zip(nodes[1:], metrics_ports[1:])]
    cluster.wait_for_nodes()
    return cluster, [cluster.head_node, *added]


def _run(serve_config: dict) -> None:
    """``serve.run`` in this process (a deploy from Python) of what the config's ``import_path`` builds from its
    ``args`` (``deployments.app:build_app``), as ``serve run`` does."""
    from ray import serve
    from ray.serve.config import gRPCOptions

    http, grpc = serve_config["http_options"], serve_config["grpc_options"]
    serve.start(proxy_location="HeadOnly", http_options={"host": http["host"], "port": http["port"]},
                grpc_options=gRPCOptions(port=grpc["port"], grpc_servicer_functions=grpc["grpc_servicer_functions"]))
    application = serve_config["applications"][0]
    module, _, builder = application["import_path"].partition(":")
    build_app = getattr(importlib.import_module(module), builder)
    serve.run(build_app(application["args"]), name=application["name"],
              route_prefix=application.get("route_prefix", "/"), blocking=False)


def deploy(serve_config: dict) -> None:
    """The whole Serve config through the controller, as ``serve deploy`` sends it (builds happen there)."""
    from ray.serve._private.api import serve_start
    from ray.serve.config import gRPCOptions
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(serve_config)
    client = serve_start(http_options=config.http_options.model_dump(), proxy_location=config.proxy_location,
                         grpc_options=gRPCOptions(**config.grpc_options.model_dump()))
    client.deploy_apps(config)


def wait_until_running(app_name: str, timeout_s: float) -> None:
    """Until Serve reports the application RUNNING; a failed deploy raises with Serve's message."""
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while True:
        application = serve.status().applications.get(app_name)
        if application is not None and application.status == "RUNNING":
            return
        if application is not None and application.status == "DEPLOY_FAILED":
            raise AssertionError(f"deploy failed: {application.message}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{app_name} not RUNNING after {timeout_s} s: {application}")
        time.sleep(1.0)


@contextmanager
def local_serve(serve_config: dict, nodes: Sequence[dict] | None = None, declarative: bool = False,
                ready_timeout_s: float = 300.0, keep_api_key: bool = False) -> Iterator[LocalServe]:
    """``serve_config``'s application on a private cluster of simulated ``nodes`` (``Cluster.add_node``
    arguments, the head first), ready to answer; everything shut down afterwards, the environment restored.

    ``nodes`` None: a new Ray instance of this machine alone, with every CPU, GPU and the memory Ray detects
    (a simulated node has 1 CPU, no GPU and a 150 MiB object store unless told otherwise).
    ``keep_api_key``: the replicas see $HETSPEC_API_KEY (off: a key in the caller's shell is ignored)."""
    import ray
    from ray import serve

    serve_config = with_private_ports(serve_config)
    metrics_ports = [free_port() for _ in nodes or ()]
    with _private_environment(keep_api_key):
        cluster, cluster_nodes = _private_cluster(nodes, metrics_ports) if nodes else (None, [])
        try:
            # address="local": a new instance, never one already running on this machine
            ray.init(address=cluster.address if cluster else "local", log_to_driver=False)
            served = LocalServe(serve_config, cluster, cluster_nodes,
                                tuple(f"http://127.0.0.1:{port}/metrics" for port in metrics_ports))
            if declarative:
                deploy(serve_config)
                wait_until_running(served.application["name"], ready_timeout_s)
            else:
                _run(serve_config)
                wait_until_healthy(served.http_url, timeout_s=ready_timeout_s, poll_s=0.5)
            yield served
        finally:
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
                if cluster is not None:
                    cluster.shutdown()
