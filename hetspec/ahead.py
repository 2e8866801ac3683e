"""Drafting ahead (pipelining): while the target verifies step i, the drafter drafts step i+1 from the committed
text plus step i's candidates, i.e. assuming they are all accepted. Its first token is then a guess of the target's
next token (the bonus token after a fully accepted draft), so it drafts one token more than the step needs.
Hit: step i was fully accepted and the guess equals the bonus token; the draft, without its first token, is the
next step's. Miss: it is dropped and the next step drafts afresh (the drafter re-syncs to the committed text).
Any draft is verified by the target, so drafting ahead changes speed, never what is output: greedy and exact-match
(SLEM) output is token for token the output without it; with rejection sampling (SD, TLI, SLRS) at temperature > 0
the drafts differ, so the output is an equally distributed sample, not the same one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hetspec.algorithms import Draft


@dataclass
class DraftOrder:
    """One request's draft in a step's drafter call: ``k`` tokens after ``committed``."""

    request: Any  # hetspec.decoder.Request, or the server's request whose drafter is an actor
    k: int
    committed: bytes  # the committed output text (ahead: plus the candidates being verified)
    first_position: int  # output position of the first drafted token (hetspec.sampling keys)
    draft_round: int  # the request's draft round: a drafter's random numbers are never reused
    assumed: tuple[int, ...] = ()  # ahead: the candidates assumed accepted


@dataclass
class Ahead:
    """A draft made ahead, waiting for the verification it assumed to come back."""

    draft: Draft | None  # None: the drafter delivered none (it was lost)
    assumed: tuple[int, ...]


def continuing(ahead: Ahead, new_ids: list[int], table: list[bytes | None]) -> Draft | None:
    """The part of the draft made ahead that continues ``new_ids`` (the step's committed ids), or None (a miss)."""
    draft, bonus = ahead.draft, new_ids[-1]
    if draft is None or tuple(new_ids[:-1]) != ahead.assumed:
        return None
    if draft.candidates:  # a draft of target ids (TLI, SLRS, SD): its first id guessed the bonus token
        if draft.candidates[0] != bonus or len(draft.candidates) == 1:
            return None
        return Draft(candidates=draft.candidates[1:], draft_probs=draft.draft_probs, first_row=draft.first_row + 1,
                     drafter_forwards=0)
    bonus_bytes = table[bonus] or b""  # a text draft (SLEM): its text must start with the bonus token's
    if draft.texts:  # a tree: the branches that guessed the bonus token
        rest = [text[len(bonus_bytes):] for text in draft.texts
                if text.startswith(bonus_bytes) and len(text) > len(bonus_bytes)]
        return Draft(texts=rest) if rest else None
    if not draft.text.startswith(bonus_bytes) or len(draft.text) == len(bonus_bytes):
        return None
    return Draft(text=draft.text[len(bonus_bytes):])
