"""The KV pool's memory (hetspec/kv.py): every row is as wide as the widest, so a long session widens the short
ones' rows; when it leaves, the rows shrink back to what the sessions still held need, and with a budget the
buffers never grow past it by doubling. Tiny synthetic models: the numbers are slots and copies, not time."""

from __future__ import annotations

import torch

from synthetic import language_model, target_tokenizer
from hetspec.kv import KVSession

IDS = torch.randint(0, 8, (700,), generator=torch.Generator().manual_seed(0)).tolist()


def _model():
    return language_model("target", target_tokenizer(), seed=0)


def _decode(session: KVSession, start: int, steps: int) -> list[torch.Tensor]:
    """``steps`` one-token passes feeding IDS[start:], as decoding does; their logits."""
    return [session.extend(IDS[start + step:start + step + 1], 1) for step in range(steps)]


def test_the_rows_shrink_when_the_longest_session_leaves_and_the_short_one_decodes_on_unchanged():
    model = _model()
    pool = model.kv_pool
    long, short, alone = model.new_session(), model.new_session(), model.new_session()
    long.extend(IDS[:600], 1)
    short.extend(IDS[:20], 1)
    assert (pool.rows, pool.capacity) == (2, 600)  # both rows as wide as the long prompt
    long_reserved = pool.reserved_bytes
    long.release()
    # the short session's row alone is left (row 1: rows 0..1 stay), at its need: the 20 slots its pass wrote
    assert (pool.rows, pool.capacity) == (2, 20) and pool.reserved_bytes == 2 * 20 * pool.bytes_per_token
    assert pool.reserved_bytes * 10 < long_reserved
    # its cached keys and values were kept: it decodes on as a session that never shared the pool
    decoded = _decode(short, 20, 30)
    alone.extend(IDS[:20], 1)
    for got, expected in zip(decoded, _decode(alone, 20, 30)):
        assert torch.equal(got, expected)
    short.release()
    alone.release()
    assert pool.reserved_bytes == 0 and pool.needs == {}


def test_a_session_leaving_beside_sessions_as_long_keeps_the_buffers():
    """No copy for nothing: the rows left need more than half the buffers."""
    model = _model()
    pool = model.kv_pool
    sessions = [model.new_session() for _ in range(3)]
    for session in sessions:
        session.extend(IDS[:100], 1)
    reallocations = pool.reallocations
    sessions[0].release()  # row 0 goes; rows 1 and 2, as wide, remain
    assert pool.reallocations == reallocations and pool.rows == 4  # rows grew 1, 2, 4
    for session in sessions[1:]:
        session.release()
    assert pool.reserved_bytes == 0


def test_with_a_budget_growth_stops_doubling_at_it_and_counts_its_copies():
    """A 256-token decode after a 20-token prompt: the reallocations (each a copy of the rows held) by doubling
    alone, then with a budget that leaves room for 300 slots (growth stops at the budget) and
    with one below the need (beyond the budget the slots grow exactly: the pass never fails)."""
    counts, reserved = {}, {}
    for budget_slots in (None, 300, 200):
        model = _model()
        pool = model.kv_pool
        pool.budget_bytes = None if budget_slots is None else budget_slots * pool.bytes_per_token
        session = model.new_session()
        session.extend(IDS[:20], 1)
        _decode(session, 20, 256)
        counts[budget_slots], reserved[budget_slots] = pool.reallocations, pool.capacity
        session.release()
    # 0 slots (the row's take), 64 (the prompt), then copies at 128, 256 and 512
    assert counts[None] == 5 and reserved[None] == 512
    assert counts[300] == 5 and reserved[300] == 300  # the same copies, the last to 300 (the budget), not 512
    assert reserved[200] == 276 and counts[200] == 4 + 276 - 200  # 200 (the budget), then one slot a step


def test_over_its_budget_the_pool_shrinks_when_any_session_leaves():
    model = _model()
    pool = model.kv_pool
    pool.budget_bytes = 150 * pool.bytes_per_token
    first, second = model.new_session(), model.new_session()
    first.extend(IDS[:100], 1)
    second.extend(IDS[:60], 1)
    assert pool.reserved_bytes > pool.budget_bytes  # 2 rows x 100: the budget is admission's to keep
    first.release()
    assert (pool.rows, pool.capacity) == (2, 60) and pool.reserved_bytes <= pool.budget_bytes
    second.release()
    assert pool.reserved_bytes == 0


def test_the_replicas_budget_is_shared_by_the_models_bytes_per_token():
    from deployments.workers.actors import kv_budget_shares

    # gemma3-270m and smollm2-135m in float32: 36,864 and 46,080 bytes a token
    shares = kv_budget_shares(83_000_000, {"target": 36_864, "drafter": 46_080})
    assert shares == {"target": 36_888_888, "drafter": 46_111_111} and sum(shares.values()) <= 83_000_000
    assert kv_budget_shares(None, {"target": 36_864, "drafter": 46_080}) == {"target": None, "drafter": None}
