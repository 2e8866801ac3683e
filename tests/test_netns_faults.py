"""Faults across the wire between the test hosts (slow: ``-m slow``; minutes each): the drafter's host cut off
for 30 s mid-stream, then back; 5% packet loss and jittered RTT on every link under a minute of load; the
head's proxy polled all along. Each test prints its timeline (``-s``), which docs/deploy.md reports.

Same hosts and app as tests/test_netns.py (small pair, float32, greedy): every finished output must equal the
target's alone in this process, token for token.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from cluster.netns.delay import DelaySettings
from cluster.netns.hosts import end_processes_in, namespaces_can_be_made
from cluster_checks import PROMPTS, SMALL_ARGS, target_alone
from test_netns import ONE_WAY_MS, served_hosts

pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.timeout(1800)]

WHY_NOT = namespaces_can_be_made()
if WHY_NOT:
    pytest.skip(f"network namespaces cannot be made here: {WHY_NOT}", allow_module_level=True)

LONG_TOKENS = 200
OUTAGE_S = 30.0


class Timeline:
    def __init__(self):
        self.start = time.monotonic()
        self.events: list[tuple[float, str]] = []
        self.lock = threading.Lock()

    def mark(self, what: str) -> None:
        with self.lock:
            self.events.append((round(time.monotonic() - self.start, 1), what))

    def show(self, title: str) -> None:
        print(f"\n{title}\n" + "\n".join(f"  t={t:6.1f} s  {what}" for t, what in self.events), flush=True)


class HealthPoller(threading.Thread):
    """GET /health every 0.5 s; keeps each answer's status (or error) and latency."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.answers, self.stop = url, [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                status = httpx.get(f"{self.url}/health", timeout=10).status_code
            except httpx.HTTPError as error:
                status = type(error).__name__
            self.answers.append((status, time.monotonic() - started))
            self.stop.wait(0.5)

    def summary(self) -> dict:
        statuses: dict = {}
        for status, _ in self.answers:
            statuses[str(status)] = statuses.get(str(status), 0) + 1
        return {"polls": len(self.answers), "statuses": statuses,
                "slowest_s": round(max((latency for _, latency in self.answers), default=0.0), 2)}


def stream(hosts, prompt: str, max_tokens: int) -> tuple[list[int], dict, str | None]:
    """One streamed greedy completion: its token ids, its final stats, and the error event's message if any."""
    body = {"model": SMALL_ARGS["model_id"], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "hetspec": {"ignore_eos": True}}
    token_ids, stats, error = [], {}, None
    with httpx.stream("POST", f"{hosts.http_url}/v1/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                error = event["error"]["message"]
                continue
            token_ids += event.get("hetspec", {}).get("token_ids", [])
            stats = event.get("hetspec", {}).get("stats", stats)
    return token_ids, stats, error


@pytest.fixture(scope="module")
def hosts():
    with served_hosts("hetspec-f") as hosts:
        yield hosts


@pytest.fixture(scope="module")
def reference(gemma):
    return target_alone(gemma, LONG_TOKENS, ignore_eos=True)


def test_drafter_host_cut_off_mid_stream_then_back(hosts, reference):
    timeline, health = Timeline(), HealthPoller(hosts.http_url)
    health.start()
    drafter_host = hosts.network.hosts[1]
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(stream, hosts, PROMPTS[0], LONG_TOKENS)
        time.sleep(3.0)
        hosts.network.cut(drafter_host)
        timeline.mark("drafter host's link down")
        time.sleep(OUTAGE_S)
        hosts.network.cut(drafter_host, cut=False)
        timeline.mark("drafter host's link up")
        token_ids, stats, error = running.result()
        timeline.mark(f"stream finished: {len(token_ids)} tokens, error {error!r}, "
                      f"drafter_lost {stats.get('drafter_lost')}, target passes {stats.get('target_forwards')}")
    assert error is None and token_ids == reference[PROMPTS[0]]
    # Ray declared the cut-off node dead; its raylet ends itself once it hears so. A node starts there again.
    end_processes_in(drafter_host.netns)
    hosts.ray.start_node(drafter_host)
    timeline.mark("Ray node started again on the drafter's host")
    deadline = time.monotonic() + 240
    while True:
        token_ids, stats, error = stream(hosts, PROMPTS[1], 24)
        if stats.get("drafter_forwards") and not stats.get("drafter_lost"):
            break
        assert time.monotonic() < deadline, f"no drafting 240 s after the drafter's host came back: {stats}"
        time.sleep(3.0)
    timeline.mark(f"drafting again: drafter passes {stats['drafter_forwards']}, tokens equal "
                  f"{token_ids == reference[PROMPTS[1]][:24]}")
    health.stop.set()
    health.join()
    timeline.mark(f"/health during it all: {health.summary()}")
    timeline.show("drafter host cut off for 30 s")
    assert token_ids == reference[PROMPTS[1]][:24]
    assert all(isinstance(status, int) for status, _ in health.answers), health.summary()


def test_loss_and_jitter_on_every_link_under_load(hosts, reference):
    timeline, health = Timeline(), HealthPoller(hosts.http_url)
    health.start()
    hosts.network.set_delay(DelaySettings(one_way_ms=2.5, jitter_ms=2.0, loss=0.05))
    timeline.mark("5% loss, one-way 2.5 +- 2 ms on every link between hosts")
    outcomes = []
    deadline = time.monotonic() + 60
    with ThreadPoolExecutor(4) as pool:
        while time.monotonic() < deadline:
            batch = [pool.submit(stream, hosts, PROMPTS[i % 2], 48) for i in range(4)]
            outcomes += [(i % 2, future.result()) for i, future in enumerate(batch)]
    hosts.network.set_delay(DelaySettings(one_way_ms=ONE_WAY_MS))
    health.stop.set()
    health.join()
    wrong = [(which, error) for which, (token_ids, _, error) in outcomes
             if error or token_ids != reference[PROMPTS[which]][:48]]
    timeline.mark(f"{len(outcomes)} requests, {len(wrong)} failed or different; /health: {health.summary()}")
    forwarder_log = (hosts.network.workdir / "forwarder.log").read_text()
    timeline.show("loss and jitter for a minute" + (f" (forwarder: {forwarder_log.strip()})" if forwarder_log else ""))
    assert not wrong, wrong
    assert all(isinstance(status, int) for status, _ in health.answers), health.summary()
