"""Drafting ahead (hetspec/ahead.py): a draft made while its step's candidates were verified assumed them all
accepted and guessed the bonus token with its first token; the next step uses what continues the committed ids."""

from __future__ import annotations

import pytest

from hetspec.ahead import Ahead, continuing
from hetspec.algorithms import Draft


def _continuing(draft: Draft, assumed: list[int], new_ids: list[int], table=None) -> Draft | None:
    return continuing(Ahead(draft, tuple(assumed)), new_ids, table or {})


def test_token_draft_hit_drops_the_guess_and_its_probability_row():
    usable = _continuing(Draft(candidates=[9, 4, 5], draft_probs="ref"), assumed=[1, 2], new_ids=[1, 2, 9])
    assert (usable.candidates, usable.draft_probs, usable.first_row) == ([4, 5], "ref", 1)


@pytest.mark.parametrize("new_ids", [[1, 2, 8], [1, 7]], ids=["wrong bonus guess", "chunk rejected"])
def test_token_draft_miss(new_ids):
    assert _continuing(Draft(candidates=[9, 4, 5]), assumed=[1, 2], new_ids=new_ids) is None


def test_text_draft_hit_keeps_the_text_after_the_bonus_token():
    usable = _continuing(Draft(text=b" world, again"), assumed=[1], new_ids=[1, 9], table={9: b" world"})
    assert usable.text == b", again" and usable.candidates == []


@pytest.mark.parametrize("text", [b" word", b" world"], ids=["disagrees", "nothing after the bonus"])
def test_text_draft_miss(text):
    assert _continuing(Draft(text=text), assumed=[1], new_ids=[1, 9], table={9: b" world"}) is None


def test_tree_draft_keeps_the_branches_that_guessed_the_bonus_token():
    usable = _continuing(Draft(texts=[b" world, a", b" word", b" world"]), assumed=[], new_ids=[9],
                         table={9: b" world"})
    assert usable.texts == [b", a"]


def test_a_lost_drafters_draft_is_a_miss():
    assert _continuing(None, assumed=[], new_ids=[9]) is None
