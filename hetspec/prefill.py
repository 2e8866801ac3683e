"""A prompt into a KV row in chunks, a pass each, so a long prompt delays the other rows' passes by one chunk at
a time (the chunk rides in their pass, packed: hetspec/layouts.py)."""

from __future__ import annotations

from typing import Callable, Sequence

from hetspec.kv import Feed, KVSession
from hetspec.passes import Steps


class PrefillStopped(Exception):
    """A prefill's ``stop`` said so between two chunks (its request was cancelled): the row holds a part."""


def prefill(session: KVSession, ids: Sequence[int], chunk_tokens: int, leave: int = 1,
            chunks: int | None = None, stop: Callable[[], bool] | None = None) -> Steps:
    """Feed ``ids`` but the last ``leave`` (the next draft or verification feeds them) in chunks of
    ``chunk_tokens``, one pass each: a joining prompt then delays the others' passes by one chunk at a time.
    ``chunks``: at most this many (None: until only ``leave`` are left); returns the tokens still to feed.
    ``stop``: asked before each chunk; when it answers True the prefill raises ``PrefillStopped`` (a long prompt
    of a request gone costs one chunk more, not the rest of the prompt)."""
    fed = 0
    while session.length < len(ids) - leave and (chunks is None or fed < chunks):
        if stop is not None and stop():
            raise PrefillStopped(f"stopped with {session.length} of {len(ids) - leave} tokens fed")
        yield Feed(session, list(ids[session.length:len(ids) - leave][:chunk_tokens]), 1)
        fed += 1
    return max(len(ids) - leave - session.length, 0)
