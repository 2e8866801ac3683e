"""Hypothesis strategies of hostile request values, shared by the fuzz tests."""

from __future__ import annotations

from hypothesis import strategies as st

from protos.hetspec.v1 import hetspec_pb2 as pb

# Text of any code point: lone surrogates (what invalid UTF-8 becomes) and control characters included.
CHARACTERS = st.characters() | st.characters(categories=["Cs"]) | st.characters(categories=["Cc"])
TEXT = st.text(CHARACTERS, max_size=24)
NUMBERS = (st.integers(-5, 70) | st.integers(-2**70, 2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, 1.0, 2**63, 2**64, 1e308]))
SCALARS = st.none() | st.booleans() | NUMBERS | TEXT
JSONISH = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                       max_leaves=8)

GRPC_REQUESTS = st.builds(
    pb.GenerateRequest,
    prompt=st.text(st.characters(codec="utf-8"), max_size=24),  # protobuf refuses invalid UTF-8 itself
    max_new_tokens=st.none() | st.integers(-2**31, 2**31 - 1),
    temperature=st.none() | st.floats(allow_nan=True, allow_infinity=True),
    top_p=st.none() | st.floats(allow_nan=True, allow_infinity=True),
    top_k=st.none() | st.integers(-2**31, 2**31 - 1),
    seed=st.none() | st.integers(0, 2**64 - 1),
    stop=st.lists(st.text(st.characters(codec="utf-8"), max_size=300), max_size=20),
    algorithm=st.sampled_from(["", "auto", "ar", "sd", "slem", "tli", "slrs"]) | st.text(max_size=8),
    draft_tokens=st.none() | st.integers(-2**31, 2**31 - 1),
    pipelined=st.none() | st.booleans())
