"""What the Ray dashboard shows of a model actor: its name (outside a Serve replica: none) and its repr, with the
model, dtype, device, live KV sessions and reserved KV bytes. In process, on the small pair's real models."""

from __future__ import annotations

import re

from hetspec import SamplingParams, SpeculationConfig
from deployments.workers.api import OpenSession
from serve_fixtures import in_process_coordinator


def test_a_model_actor_is_unnamed_outside_a_serve_replica():
    from deployments.workers.actors import actor_name

    assert actor_name("drafter") is None and actor_name("target", 2) is None


def test_worker_repr_names_its_model_and_counts_its_live_sessions(gemma, smollm):
    with in_process_coordinator(gemma, smollm) as (_, target, drafter):
        pattern = (r"TargetWorker\(model=gemma3-270m, dtype=float32, device=cpu, kv_sessions={sessions}/16, "
                   r"kv_reserved_bytes=(\d+), actor=[0-9a-f]{{8}}\)")
        idle = re.fullmatch(pattern.format(sessions=0), repr(target))
        assert idle, repr(target)
        target.open(OpenSession("r1", gemma.encode_prompt("def fibonacci(n):\n"), "ar", SpeculationConfig(),
                                SamplingParams()))
        busy = re.fullmatch(pattern.format(sessions=1), repr(target))
        assert busy, repr(target)
        assert int(busy[1]) == target.model.kv_pool.reserved_bytes > 0  # the session's row, at least
        target.close("r1")
        assert re.fullmatch(pattern.format(sessions=0), repr(target))
        assert repr(drafter).startswith("DrafterWorker(model=smollm2-135m, dtype=float32, device=cpu, "
                                        "kv_sessions=0/16, ")


def test_a_worker_whose_load_failed_has_a_repr():
    """Ray takes the repr of an actor whose __init__ raised: it must not hide the load's error behind its own."""
    from deployments.workers.model_workers import TargetWorker

    assert repr(TargetWorker.__new__(TargetWorker)) == "TargetWorker(not loaded)"
