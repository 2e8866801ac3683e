"""A close that arrives while its session's prompt is being prefilled (the client gone) stops that prefill at the
next chunk (deployments/workers/model_workers.py ``_prefill``, hetspec/prefill.py ``stop``): the actor stops
running passes for it and frees its KV row, instead of feeding the rest of the prompt first. A tiny synthetic
model in process; the served test (8 disconnecting streams): tests/test_kv_cancel_serve.py."""

from __future__ import annotations

import threading
import time

import pytest

from synthetic import language_model, target_tokenizer
from deployments.config import PipelineConfig
from deployments.errors import UnknownSession
from deployments.workers.api import OpenSession
from deployments.workers.model_workers import TargetWorker
from hetspec.config import SamplingParams, SpeculationConfig
from hetspec.prefill import PrefillStopped, prefill

PROMPT_TOKENS = 4000  # a chunk of one token a pass: thousands of passes if nothing stops them


def test_prefill_stops_before_the_next_chunk_when_asked():
    model = language_model("target", target_tokenizer(), seed=0)
    session = model.new_session()
    passes = 0
    steps = prefill(session, [1] * 40, chunk_tokens=4, stop=lambda: passes == 3)
    feed = next(steps)
    with pytest.raises(PrefillStopped, match="12 of 39"):
        while True:
            passes += 1
            feed = steps.send(feed.session.extend(feed.token_ids, 1))
    assert session.length == 12  # three chunks of 4, then no more
    session.release()


def test_a_close_during_the_prefill_at_open_stops_it_and_frees_the_session(exit_stack):
    model = language_model("target", target_tokenizer(), seed=0)
    worker = exit_stack.enter_context(TargetWorker(model, PipelineConfig(prefill_chunk_tokens=1)))
    outcome: list[BaseException | None] = []

    def open_long_prompt() -> None:
        try:
            worker.open(OpenSession("gone", [1] * PROMPT_TOKENS, "ar", SpeculationConfig(), SamplingParams()))
            outcome.append(None)
        except BaseException as error:  # noqa: BLE001 - asserted below
            outcome.append(error)

    opener = threading.Thread(target=open_long_prompt)
    opener.start()
    deadline = time.monotonic() + 60
    while worker.stats()["forward_passes"] < 20:  # well into the prompt
        assert time.monotonic() < deadline and opener.is_alive()
        time.sleep(0.01)
    assert worker.close("gone") is True  # it waited for the chunk running, not for the prompt
    passes = worker.stats()["forward_passes"]
    opener.join(timeout=30)
    assert isinstance(outcome[0], UnknownSession)
    stats = worker.stats()
    assert stats["forward_passes"] == passes < PROMPT_TOKENS // 2
    assert stats["active_sessions"] == 0 and stats["kv_reserved_bytes"] == 0
