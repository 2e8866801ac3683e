"""KV memory and cancelled prompts on the live Serve app (small pair, three simulated nodes, pipelined).

The budget (limits.kv_cache_bytes) bounds what the actors reserve: admission counts the running requests as wide
as the widest (deployments/serving/admission.py), each actor's pool stops doubling at its share and shrinks when
its longest session leaves (hetspec/kv.py). A client that leaves while its long prompt is prefilled stops the
prefill at the next chunk (deployments/workers/model_workers.py): the actors do not go on feeding it.

Prompts count upwards ("1, 2, 3, ..."): 135 numbers are ~567 tokens in both models, 36 chunks of 16.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from serve_fixtures import app_stats, serve_app, small_app_args, wait_for_stats

pytestmark = [pytest.mark.real, pytest.mark.timeout(600)]

CHUNK_TOKENS = 16
# 8 counting prompts (~47.7 MB each in both models, admitted as 8 x the widest) run at once; so do 4 short requests
# beside one counting prompt. Before the pools shrank and stopped doubling at the budget, those five reserved
# 8 rows (rows double) x 1024 slots (567 rounded up to a power of two) x 82,944 bytes: 679 MB
KV_CACHE_BYTES = 420_000_000
COUNTING = ", ".join(str(number) for number in range(1, 136)) + ","
SHORT_PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time", "import numpy as np\n"]


@pytest.fixture(scope="module")
def limited_app():  # the conftest's name for a served app (marks the tests `serve`)
    args = small_app_args(pipeline={"placement_strategy": "STRICT_SPREAD", "prefill_chunk_tokens": CHUNK_TOKENS},
                          limits={"kv_cache_bytes": KV_CACHE_BYTES})
    with serve_app(args) as app:
        yield app


def _stats(app) -> dict:
    return app_stats(app, timeout_s=60)


def _wait_for(app, condition, what: str, timeout_s: float = 60) -> dict:
    return wait_for_stats(app, condition, what, timeout_s, poll_s=0.05, request_timeout_s=60)


def _sessions(stats: dict) -> tuple[int, int]:
    return stats["target"]["active_sessions"], stats["drafter"]["active_sessions"]


def _reserved(stats: dict) -> int:
    return stats["target"]["kv_reserved_bytes"] + stats["drafter"]["kv_reserved_bytes"]


def _idle(stats: dict) -> bool:
    return _sessions(stats) == (0, 0) and stats["running_slots"] == stats["waiting_requests"] == 0


async def _stream(app, prompt: str, max_tokens: int) -> None:
    body = {"model": app.model_id, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "hetspec": {"ignore_eos": True}}
    async with httpx.AsyncClient(timeout=300) as client, \
            client.stream("POST", f"{app.http_url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for _ in response.aiter_lines():
            pass


def test_after_a_long_request_ends_beside_short_ones_the_actors_hold_at_most_the_budget(limited_app):
    _wait_for(limited_app, _idle, "idle")
    peak, sampling = [0], threading.Event()

    def sample() -> None:  # what the actors reserve while the long prompt runs beside the short ones
        while not sampling.wait(0.05):
            peak[0] = max(peak[0], _reserved(_stats(limited_app)))

    async def scenario() -> dict:
        shorts = [asyncio.create_task(_stream(limited_app, prompt, 256)) for prompt in SHORT_PROMPTS]
        await asyncio.to_thread(_wait_for, limited_app, lambda stats: _sessions(stats) == (4, 4), "4 sessions")
        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            async with httpx.AsyncClient(timeout=300) as client:
                long = await client.post(f"{limited_app.http_url}/v1/completions",
                                         json={"model": limited_app.model_id, "prompt": COUNTING, "max_tokens": 2})
            assert long.status_code == 200, long.text
            assert long.json()["usage"]["prompt_tokens"] > 512  # past a power of two: the old pool doubled to 1024
            # the long one's sessions closed, the short ones decode on
            after = await asyncio.to_thread(_wait_for, limited_app, lambda stats: _sessions(stats) == (4, 4),
                                            "the long request's sessions closed", 10)
        finally:
            sampling.set()
            await asyncio.to_thread(sampler.join)
            for short in shorts:
                short.cancel()
            await asyncio.gather(*shorts, return_exceptions=True)
        assert not any(short.done() and not short.cancelled() for short in shorts)  # none had finished
        return after

    after = asyncio.run(scenario())
    assert _reserved(after) <= KV_CACHE_BYTES, after
    assert 0 < peak[0] <= KV_CACHE_BYTES
    assert _reserved(after) < peak[0] / 4  # shrunk to the short rows
    assert _reserved(_wait_for(limited_app, _idle, "idle")) == 0


def test_eight_long_prompts_whose_clients_leave_stop_the_actors(limited_app):
    """8 streams with long prompts disconnect once the actors prefill them (at least 0.5 s after they started):
    both actors soon hold no session, and their pass counters stand still."""
    _wait_for(limited_app, _idle, "idle")

    async def scenario() -> None:
        started = time.monotonic()
        streams = [asyncio.create_task(_stream(limited_app, COUNTING, 4)) for _ in range(8)]
        prefilling = await asyncio.to_thread(_wait_for, limited_app, lambda stats: _sessions(stats) == (8, 8),
                                             "8 sessions prefilling")
        assert prefilling["running_slots"] == 8  # all admitted within the budget
        await asyncio.sleep(max(0.0, started + 0.5 - time.monotonic()))
        for stream in streams:
            stream.cancel()  # the clients disconnect
        results = await asyncio.gather(*streams, return_exceptions=True)
        assert all(isinstance(result, asyncio.CancelledError) for result in results), results

    asyncio.run(scenario())
    stopped = _wait_for(limited_app, lambda stats: _sessions(stats) == (0, 0), "0 sessions", timeout_s=30)
    passes = (stopped["target"]["forward_passes"], stopped["drafter"]["forward_passes"])
    time.sleep(1.0)
    later = _stats(limited_app)
    assert (later["target"]["forward_passes"], later["drafter"]["forward_passes"]) == passes
    assert _idle(_wait_for(limited_app, _idle, "idle", timeout_s=5))
