"""Context lookup: drafts copied from earlier in the request's own text, with no drafter pass.

Prompt lookup decoding (Saxena 2023) at the string level: the longest suffix of the committed text (prompt
and output, as bytes) that also occurred earlier proposes the bytes that followed that earlier occurrence.
Working on bytes rather than on either model's tokens makes it independent of both tokenizers; the proposed
text becomes target ids by the same bounded-window re-tokenization SLEM uses (``hetspec.align``).

Exact for every algorithm: exact-match verification (SLEM, and greedy decoding of all) keeps only the
target's own choices, whatever was proposed; rejection sampling (SD, TLI, SLRS at temperature > 0) verifies a
lookup draft as a point-mass proposal, q = one-hot(t) (``point_mass_probs``): t is accepted with probability
min(1, p(t) / 1) = p(t), and a rejection samples norm(max(0, p - q)), i.e. p without t renormalised, which
together draw exactly from p. The proposal is a function of the committed text alone (no random number), so
no number is reused (docs/losslessness.md).

Cost per step is bounded, independent of the context length: the index adds one entry per committed byte, and
a lookup reads one entry and compares at most ``MATCH_CANDIDATES`` earlier occurrences over at most
``max_match`` bytes each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from hetspec.align import target_candidates

MATCH_CANDIDATES = 8  # most recent occurrences of the last min_match bytes compared per lookup: bounded work
MAX_BYTES_PER_TOKEN = 8  # text copied per proposed target token: room for long tokens, bounded re-tokenization
LOOKUP_SHARE = 0.75  # auto: a lookup step costs no drafter pass, so it wins even somewhat below the drafter's yield
RETRY_AFTER = 8  # auto: lookups passed over in a row before one is tried again (the text may have turned repetitive)
PRIOR_ACCEPTED = 2.0  # auto: an unmeasured source counts as one draft with this many accepted tokens (try both)


class ContextIndex:
    """The request's text and, for every ``min_match``-byte string in it, where its occurrences ended.

    Only occurrences followed by at least one byte are indexed: the text's own end is what a lookup matches,
    never a match itself."""

    def __init__(self, min_match: int, max_match: int):
        if not 1 <= min_match <= max_match:
            raise ValueError("need 1 <= min_match <= max_match")
        self.min_match, self.max_match = min_match, max_match
        self.text = bytearray()
        self.ends: dict[bytes, list[int]] = {}  # min_match bytes -> end offsets of their occurrences, in order

    def __len__(self) -> int:
        return len(self.text)

    def extend(self, data: bytes) -> None:
        """Append committed text; indexes the ``len(data)`` end offsets that now have a byte after them."""
        start = len(self.text)
        self.text += data
        for end in range(max(start, self.min_match), len(self.text)):
            self.ends.setdefault(bytes(self.text[end - self.min_match:end]), []).append(end)

    def longest_match(self) -> tuple[int, int]:
        """(length, end): the longest suffix of the text, at least ``min_match`` and at most ``max_match`` bytes,
        that also ends at the earlier offset ``end``; (0, -1) when there is none. Among the ``MATCH_CANDIDATES``
        most recent occurrences of the last ``min_match`` bytes; on a tie the most recent."""
        if len(self.text) < self.min_match:
            return 0, -1
        best = (0, -1)
        for end in reversed(self.ends.get(bytes(self.text[-self.min_match:]), [])[-MATCH_CANDIDATES:]):
            length = common_suffix_length(self.text, end, len(self.text), self.max_match)
            if length > best[0]:
                best = (length, end)
        return best

    def continuation(self, max_bytes: int) -> bytes:
        """What followed the longest match, at most ``max_bytes``; b"" when nothing matched."""
        length, end = self.longest_match()
        return bytes(self.text[end:end + max_bytes]) if length else b""


def common_suffix_length(text: bytes | bytearray, first_end: int, second_end: int, limit: int) -> int:
    """How many bytes (at most ``limit``) ``text[:first_end]`` and ``text[:second_end]`` end with in common."""
    length = 0
    while length < min(limit, first_end) and text[first_end - length - 1] == text[second_end - length - 1]:
        length += 1
    return length


def utf8_prefix(data: bytes) -> str:
    """The text before the first bytes that are not UTF-8 ("" when ``data`` starts inside a character: a short
    match can end in the middle of one in the earlier occurrence)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        return data[:error.start].decode("utf-8")


def lookup_candidates(index: ContextIndex, committed_target_ids: Sequence[int], encode: Callable[[str], list[int]],
                      table: Sequence[bytes | None], window: int, max_tokens: int) -> list[int]:
    """At most ``max_tokens`` target ids continuing ``committed_target_ids`` with the lookup's text (the index
    must hold exactly the committed text)."""
    text = utf8_prefix(index.continuation(max_tokens * MAX_BYTES_PER_TOKEN))
    return target_candidates(encode, table, committed_target_ids, text, window)[:max_tokens]


def point_mass_probs(candidates: list[int], vocab_size: int) -> torch.Tensor:
    """[len(candidates), vocab_size]: row i is one-hot at candidate i, the distribution a lookup draws it from."""
    probs = torch.zeros(len(candidates), vocab_size)
    probs[torch.arange(len(candidates)), torch.tensor(candidates, dtype=torch.long)] = 1.0
    return probs


@dataclass
class SourceTally:
    """One draft source's record in a request: drafts verified, tokens proposed, tokens accepted."""

    drafts: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def accepted_per_draft(self) -> float:
        """Mean accepted tokens per draft, pulled towards PRIOR_ACCEPTED while there are few drafts."""
        return (self.accepted + PRIOR_ACCEPTED) / (self.drafts + 1)


def prefers_lookup(mode: str, proposed: int, min_draft: int, lookup: SourceTally, drafter: SourceTally | None,
                   passed_over: int) -> bool:
    """Whether this step verifies the lookup's ``proposed`` tokens instead of asking the drafter.

    ``drafter`` is None when the request has no drafter (``ar``, or its drafter was lost). A choice changes
    speed only: every draft is verified by the algorithm's exact rule."""
    if mode == "off" or proposed < min_draft:
        return False
    if mode == "always" or drafter is None or passed_over >= RETRY_AFTER:
        return True
    return lookup.accepted_per_draft >= LOOKUP_SHARE * drafter.accepted_per_draft


class ContextLookup:
    """A request's lookup source: the index over its committed text, and the record that chooses between the
    lookup and the drafter each step (``prefers_lookup``)."""

    def __init__(self, mode: str, min_match: int, max_match: int, min_draft: int, max_draft: int,
                 prompt_text: bytes, encode: Callable[[str], list[int]], table: Sequence[bytes | None], window: int):
        self.mode, self.min_draft, self.max_draft = mode, min_draft, max_draft
        self.index = ContextIndex(min_match, max_match)
        self.index.extend(prompt_text)
        self.prompt_length = len(prompt_text)
        self.encode, self.table, self.window = encode, table, window
        self.passed_over = 0  # lookups long enough but passed over for the drafter since the last one used

    def propose(self, committed: bytes, committed_target_ids: Sequence[int], max_tokens: int, lookup: SourceTally,
                drafter: SourceTally | None) -> list[int]:
        """This step's lookup candidates after the generated text ``committed``, or [] when the drafter (or the
        target alone) should have the step. ``lookup``, ``drafter``: the sources' records in this request so
        far (``drafter`` None: the request has no drafter)."""
        self.index.extend(committed[len(self.index) - self.prompt_length:])
        max_tokens = min(max_tokens, self.max_draft)
        if self.mode == "off" or max_tokens < self.min_draft:
            return []
        candidates = lookup_candidates(self.index, committed_target_ids, self.encode, self.table, self.window,
                                       max_tokens)
        if not prefers_lookup(self.mode, len(candidates), self.min_draft, lookup, drafter, self.passed_over):
            self.passed_over += len(candidates) >= self.min_draft
            return []
        self.passed_over = 0
        return candidates


def prompt_text(prompt_ids: Sequence[int], table: Sequence[bytes | None]) -> bytes:
    """The prompt's text as bytes (special tokens spell nothing)."""
    return b"".join(table[token] or b"" for token in prompt_ids if token < len(table))
