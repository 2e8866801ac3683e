"""What an operator sees of the served app: a real Prometheus (Debian's, started here on a free loopback port)
scrapes Ray's metrics export ports while the small pair serves traffic, with cluster/prometheus/'s rules loaded;
hetspec's series carry sane values, every PromQL expression of cluster/grafana/hetspec.json returns data, the
actor-replaced alert fires for the drafter killed here, and the Ray dashboard's state API names each actor.

One app and one Prometheus for the module (``observed``); the traffic runs once:
  1. two short requests, so that every counter exists before Prometheus scrapes (a rate needs two samples);
  2. concurrent streams over HTTP and gRPC, one request whose KV cache alone exceeds the budget (Overloaded,
     HTTP 429), and a KV session opened straight on the target and never closed (freed by the session sweeper, as
     one a crashed coordinator left would be);
  3. the drafter killed under a stream (the target finishes it alone; the replica starts a new drafter);
  4. until Prometheus counts the requests the replica counts; then a trickle of short requests while the tests run.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
import yaml

from deployments.tools.local_serve import free_port
from protos.hetspec.v1 import hetspec_pb2 as pb
from protos.hetspec.v1 import hetspec_pb2_grpc as pb_grpc
from serve_fixtures import serve_app, serve_logs_dir, small_app_args

pytestmark = [pytest.mark.real, pytest.mark.serve, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "cluster" / "prometheus" / "hetspec.rules.yaml"
DASHBOARD = REPO / "cluster" / "grafana" / "hetspec.json"
APP = "hetspec"
PROMPT = "def fibonacci(n):\n"
KV_BUDGET = 12 * 2**20  # small enough that one request of max_new_tokens (256) alone exceeds it
SESSION_IDLE_TIMEOUT_S = 8.0  # the orphan session is freed this long after it was opened
STREAM_TOKENS = 32
RATE_WINDOW = "5m"  # what $__rate_interval stands for here: the whole test runs within it


@dataclass
class Observed:
    app: object  # serve_fixtures.ServedApp
    prometheus_url: str
    replica: str  # Serve's replica id, from /v1/stats
    drafters_before: list[str]  # the drafter's actor id before the kill (per /v1/stats)


def query(prometheus_url: str, expression: str) -> list[tuple[dict, float]]:
    """(labels, value) of each sample of an instant query now."""
    answer = httpx.get(f"{prometheus_url}/api/v1/query", params={"query": expression}, timeout=30).json()
    assert answer["status"] == "success", (expression, answer)
    return [(sample["metric"], float(sample["value"][1])) for sample in answer["data"]["result"]]


def wait_for(prometheus_url: str, expression: str, timeout_s: float = 120.0) -> list[tuple[dict, float]]:
    """The samples of ``expression`` once there are any (Ray's agents export every second here, Prometheus
    scrapes every second)."""
    deadline = time.monotonic() + timeout_s
    while not (samples := query(prometheus_url, expression)):
        assert time.monotonic() < deadline, f"no data for {expression} after {timeout_s} s"
        time.sleep(1.0)
    return samples


@contextmanager
def running_prometheus(metrics_urls: tuple[str, ...], folder: Path):
    """Debian's prometheus on a free port of 127.0.0.1, scraping ``metrics_urls`` every second with the
    rules of cluster/prometheus/ evaluated every second; its URL. Stopped (by its pid) afterwards."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus not found: run scripts/setup.sh (it installs Debian's prometheus package)")
    targets = [re.sub(r"^http://([^/]+)/metrics$", r"\1", url) for url in metrics_urls]
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "rule_files": [str(RULES)],
              "scrape_configs": [{"job_name": "ray", "static_configs": [{"targets": targets}]}]}
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    with (folder / "prometheus.log").open("w") as log:
        process = subprocess.Popen([binary, f"--config.file={folder / 'prometheus.yml'}",
                                    f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                                    "--log.level=warn"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/-/ready", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None, (folder / "prometheus.log").read_text()
            assert time.monotonic() < deadline, "prometheus not ready after 60 s"
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _complete(app, max_tokens: int, stream: bool = False,
              first_event: threading.Event | None = None) -> httpx.Response | list[dict]:
    """A greedy completion of PROMPT (EOS ignored); streamed: its events, ``first_event`` set at the first."""
    body = {"model": app.model_id, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "hetspec": {"ignore_eos": True}}
    if not stream:
        return httpx.post(f"{app.http_url}/v1/completions", json=body, timeout=300)
    with httpx.stream("POST", f"{app.http_url}/v1/completions", json={**body, "stream": True}, timeout=300) as answer:
        assert answer.status_code == 200, answer.read()
        events = []
        for line in answer.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
                if first_event is not None:
                    first_event.set()
        return events


def _stats(app) -> dict:
    return httpx.get(f"{app.http_url}/v1/stats", timeout=60).json()


def _traffic(app, prometheus_url: str) -> None:
    import ray
    from ray import serve

    from deployments.workers.api import OpenSession
    from hetspec import SamplingParams, SpeculationConfig

    # 1. every counter and histogram exists (and is scraped) before the traffic whose rates are charted
    for _ in range(2):
        assert _complete(app, 4).status_code == 200
    wait_for(prometheus_url, "ray_hetspec_requests_total")
    wait_for(prometheus_url, "ray_hetspec_time_per_output_token_seconds_count")

    # 2. concurrent streams over HTTP and gRPC (drafting all along); one request over the KV budget; an orphan session
    handles = serve.get_app_handle(APP).actor_handles.remote().result(timeout_s=60)
    with grpc.insecure_channel(app.grpc_target) as channel, ThreadPoolExecutor(6) as pool:
        stub = pb_grpc.HetSpecStub(channel)
        streams = [pool.submit(_complete, app, STREAM_TOKENS, True) for _ in range(3)]
        grpc_answer = pool.submit(stub.Generate, pb.GenerateRequest(prompt=PROMPT, max_new_tokens=12,
                                                                    temperature=0.0), timeout=300)
        over_budget = _complete(app, 256)
        assert over_budget.status_code == 429 and "server_busy" in over_budget.text, over_budget.text
        ray.get(handles["target"].open.remote(OpenSession(f"orphan-{uuid.uuid4().hex[:8]}", [2, 3, 4, 5], "ar",
                                                          SpeculationConfig(), SamplingParams(), prefill_now=False)))
        for stream in streams:
            assert stream.result(timeout=300)[-1]["choices"][0]["finish_reason"] == "length"
        answered = grpc_answer.result(timeout=300)
        assert answered.finish_reason in ("stop", "length") and answered.usage.completion_tokens >= 1

        # 3. the drafter killed under a stream, once its first tokens are out: the target finishes it alone
        first_event = threading.Event()
        killed = pool.submit(_complete, app, STREAM_TOKENS, True, first_event)
        assert first_event.wait(timeout=300)
        ray.kill(handles["drafter"])
        assert killed.result(timeout=300)[-1]["choices"][0]["finish_reason"] == "length"
    deadline = time.monotonic() + 180  # the replica replaces the drafter
    while "error" in (stats := _stats(app))["drafter"] and time.monotonic() < deadline:
        time.sleep(1.0)
    assert "error" not in stats["drafter"], stats
    assert _complete(app, 8).status_code == 200  # through the new drafter

    # 4. Prometheus has it all: the finished requests it counts are the replica's own count
    finished = _stats(app)["finished_requests"]
    wait_for(prometheus_url, f"sum(ray_hetspec_requests_total) == {finished}")
    wait_for(prometheus_url, "hetspec:actor_replacements:increase15m")
    wait_for(prometheus_url, "ray_hetspec_expired_sessions_total", timeout_s=SESSION_IDLE_TIMEOUT_S + 60)
    time.sleep(3.0)  # a few more rule evaluations (every second) over the final counts


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    args = small_app_args(pipeline={"placement_strategy": "STRICT_SPREAD",
                                    "session_idle_timeout_s": SESSION_IDLE_TIMEOUT_S},
                          limits={"default_max_new_tokens": 16, "kv_cache_bytes": KV_BUDGET})
    folder = tmp_path_factory.mktemp("prometheus")
    with pytest.MonkeyPatch.context() as patch:
        # Ray's agents export every second (10 s by default): the test waits less for its series
        patch.setenv("RAY_metrics_report_interval_ms", "1000")
        with serve_app(args) as app, running_prometheus(app.metrics_urls, folder) as prometheus_url:
            before = _stats(app)
            _traffic(app, prometheus_url)
            with _trickle(app):
                yield Observed(app, prometheus_url, before["replica"], [before["drafter"]["actor"]])


@contextmanager
def _trickle(app):
    """A short request every half second while the tests query Prometheus: the app keeps taking traffic, as an
    operator's would. Ray 2.60 drops a gauge from its metrics export about two export intervals after the gauge
    was last set (docs/operations.md), so an idle replica's running/waiting/KV series vanish."""
    stop = threading.Event()

    def requests() -> None:
        while not stop.wait(0.5):
            _complete(app, 2)

    thread = threading.Thread(target=requests, name="trickle", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=300)


def test_prometheus_scrapes_every_node(observed):
    targets = httpx.get(f"{observed.prometheus_url}/api/v1/targets", timeout=30).json()["data"]["activeTargets"]
    assert len(targets) == len(observed.app.metrics_urls) == 3
    assert all(target["health"] == "up" for target in targets), targets


def test_hetspec_series_have_sane_values(observed):
    url = observed.prometheus_url

    def one(expression: str) -> float:
        samples = wait_for(url, expression)
        assert len(samples) == 1, (expression, samples)
        return samples[0][1]

    replica = f'replica="{observed.replica}"'
    finished = one(f'sum(increase(ray_hetspec_requests_total{{{replica}}}[{RATE_WINDOW}]))')
    assert finished >= 3  # increase extrapolates: at least the streams of step 2
    for per_second in ("hetspec:requests:rate1m", "hetspec:generated_tokens:rate1m"):  # the last minute's: maybe 0
        assert one(f"{per_second}{{{replica}}}") >= 0
    ttft_p50, ttft_p99 = (one(f"hetspec:time_to_first_token_seconds:{q}_rate5m{{{replica}}}") for q in ("p50", "p99"))
    assert 0 < ttft_p50 <= ttft_p99 < 300
    tpot_p50, tpot_p99 = (one(f"hetspec:time_per_output_token_seconds:{q}_rate5m{{{replica}}}") for q in ("p50", "p99"))
    assert 0 < tpot_p50 <= tpot_p99 < 10
    tokens_per_pass = one(f'sum(increase(ray_hetspec_generated_tokens_total[{RATE_WINDOW}])) / '
                          f'sum(increase(ray_hetspec_forward_passes_total{{role="target"}}[{RATE_WINDOW}]))')
    assert 0 < tokens_per_pass < 64
    acceptance = [value for _, value in wait_for(url, f"hetspec:acceptance:ratio_rate5m{{{replica}}}")]
    assert acceptance and all(0 <= value <= 1 for value in acceptance) and max(acceptance) > 0
    accepted_mean = one(f"sum(increase(ray_hetspec_accepted_length_sum[{RATE_WINDOW}])) / "
                        f"sum(increase(ray_hetspec_accepted_length_count[{RATE_WINDOW}]))")
    assert 0 <= accepted_mean <= 4  # speculation.draft_tokens of config.small.yaml
    # KV: the budget as configured; what running requests held, within it
    assert one(f"ray_hetspec_kv_budget_bytes{{{replica}}}") == KV_BUDGET
    admitted_peak = one(f"max_over_time(sum(ray_hetspec_admitted_kv_bytes{{{replica}}})[{RATE_WINDOW}:1s])")
    assert 0 < admitted_peak <= KV_BUDGET
    assert 0 <= one(f"hetspec:kv_budget:used_ratio{{{replica}}}") <= 1
    assert one(f"max_over_time(hetspec:running_requests:sum{{{replica}}}[{RATE_WINDOW}])") >= 1
    assert one(f"hetspec:waiting_requests:sum{{{replica}}}") >= 0
    # what the target's KV pool held while requests ran (it frees its buffers when its last session closes, so
    # between the trickle's requests the gauge is 0)
    assert one(f'max_over_time(sum(ray_hetspec_kv_reserved_bytes{{role="target"}})[{RATE_WINDOW}:1s])') > 0
    # errors by code: the request over the budget
    errors = {labels["kind"]: value for labels, value in
              wait_for(url, f"sum by (kind) (ray_hetspec_request_errors_total{{{replica}}})")}
    assert errors.get("Overloaded") == 1, errors
    # the drafter killed under the streams: requests the target finished alone, the replacement counted
    assert one(f"sum(ray_hetspec_drafter_lost_total{{{replica}}})") >= 1
    assert one(f'hetspec:actor_replacements:increase15m{{{replica}, role="drafter"}}') == 1
    # the orphan session, freed by the target's sweeper
    assert one('sum(ray_hetspec_expired_sessions_total{role="target"})') == 1


def dashboard_expressions() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(f"{panel['title']} / {target['refId']}", target["expr"])
            for panel in dashboard["panels"] for target in panel["targets"]]


def test_every_grafana_expression_returns_data(observed):
    """No dead panel: each expression, its $__rate_interval the test's window, has a sample that is a number."""
    dead = []
    for name, expression in dashboard_expressions():
        samples = query(observed.prometheus_url, expression.replace("$__rate_interval", RATE_WINDOW))
        if not any(math.isfinite(value) for _, value in samples):
            dead.append(f"{name}: {expression} -> {samples}")
    assert not dead, "\n".join(dead)


def test_rules_evaluate_and_the_replaced_drafter_alerts(observed):
    url = observed.prometheus_url
    groups = httpx.get(f"{url}/api/v1/rules", timeout=30).json()["data"]["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    shipped = [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]
    assert len(rules) == len(shipped)
    assert all(rule["health"] == "ok" for rule in rules), [rule for rule in rules if rule["health"] != "ok"]
    deadline = time.monotonic() + 60
    while True:
        alerts = httpx.get(f"{url}/api/v1/alerts", timeout=30).json()["data"]["alerts"]
        replaced = [alert for alert in alerts if alert["labels"]["alertname"] == "HetSpecActorReplaced"]
        if replaced or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert [(alert["state"], alert["labels"]["role"], alert["labels"]["replica"]) for alert in replaced] == [
        ("firing", "drafter", observed.replica)]
    # nothing else fires on this healthy, unhurried replica (pending alerts wait for their ``for``)
    assert {alert["labels"]["alertname"] for alert in alerts if alert["state"] == "firing"} == {"HetSpecActorReplaced"}


def test_actors_are_named_with_a_repr_and_the_replica_logs_their_ids(observed):
    """What the Ray dashboard's Actors tab and ``ray list actors --detail`` show (the state API behind both)."""
    import ray
    from ray.util.state import list_actors

    prefix = f"{APP}#HetSpecServer#{observed.replica}#"
    # this test's cluster, by its GCS address: another Ray instance on the machine must not be asked
    listed = list_actors(address=ray.get_runtime_context().gcs_address, detail=True, limit=1000,
                         raise_on_missing_output=False)
    actors = {actor.name: actor for actor in listed if actor.name.startswith(prefix)}
    assert {name: actor.state for name, actor in actors.items()} == {
        f"{prefix}target": "ALIVE", f"{prefix}drafter": "DEAD", f"{prefix}drafter#2": "ALIVE"}
    assert actors[f"{prefix}target"].class_name == "TargetWorker"
    assert actors[f"{prefix}drafter#2"].class_name == "DrafterWorker"
    target_repr = actors[f"{prefix}target"].repr_name
    assert re.fullmatch(r"TargetWorker\(model=gemma3-270m, dtype=float32, device=cpu, kv_sessions=0/16, "
                        r"kv_reserved_bytes=\d+, actor=[0-9a-f]{8}\)", target_repr), target_repr
    drafter_repr = actors[f"{prefix}drafter#2"].repr_name
    assert drafter_repr.startswith("DrafterWorker(model=smollm2-135m, dtype=float32, device=cpu, "), drafter_repr
    assert observed.drafters_before[0] not in drafter_repr  # a new actor (its own id)

    logged = "".join(path.read_text(errors="replace") for path in serve_logs_dir().glob("replica_*.log"))
    started = (f"pipeline started: target actor {actors[f'{prefix}target'].actor_id} ({prefix}target); "
               f"drafter actor {actors[f'{prefix}drafter'].actor_id} ({prefix}drafter)")
    assert started in logged
    back = f"drafter actor {actors[f'{prefix}drafter#2'].actor_id} ({prefix}drafter#2)"
    assert back in logged
