"""Exact losslessness: every algorithm's output distribution, computed exactly, equals the target's.

``tests/exact_distribution.py`` enumerates every outcome of the decoder's random numbers (each a symbolic
uniform whose interval narrows at each use), so the distribution of the first LENGTH tokens is exact up to
float rounding; the target's is its chain rule (``synthetic.sequence_distribution``). Total variation must be
below TOLERANCE (float32 logits of a cached pass against an uncached one differ by ~1e-8). Mutants of the
verification rules and of the drafter's noise must be caught, each with a total variation far above it.
"""

from __future__ import annotations

import pytest
import torch

import hetspec.algorithms.tli
import hetspec.sampling
import hetspec.verify
from exact_distribution import Enumeration, total_variation
from synthetic import (bigram_llama, drafter_tokenizer, language_model, perturbed_copy, sequence_distribution,
                       single_thread, target_tokenizer, tiny_llama)
from hetspec import Engine, SamplingParams, SpeculationConfig
from hetspec.algorithms import DrafterSide
from hetspec.algorithms.tli import TokenLevelIntersection
from hetspec.models import LanguageModel
from hetspec.sampling import Stream

TOLERANCE = 1e-6
CAUGHT = 1e-3
LENGTH = 4
PROMPT = "ab c"
PARAMS = SamplingParams(max_new_tokens=LENGTH, temperature=0.8, top_k=2, top_p=0.95, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with single_thread():
        yield


def exact_output(engine: Engine, prompt: str, params: SamplingParams, speculation: SpeculationConfig) -> dict:
    return Enumeration().distribution(
        lambda: tuple(engine.generate(prompt, params, speculation=speculation).token_ids))


# --- the synthetic pair, every algorithm -----------------------------------------------------------------

@pytest.fixture(scope="module")
def target() -> LanguageModel:
    """Flatter than the chi-square tests' target (head scale 10), so top-k/top-p leave several tokens."""
    tokenizer = target_tokenizer()
    return language_model("target", tokenizer, seed=0, model=tiny_llama(len(tokenizer), 0, head_scale=10.0))


@pytest.fixture(scope="module")
def drafters(target) -> dict[str, LanguageModel]:
    tokenizer = drafter_tokenizer()
    return {"same_vocab": language_model("same-vocab drafter", target.tokenizer, seed=0,
                                         model=perturbed_copy(target.model, noise=0.6, seed=5)),
            "byte_level": language_model("byte-level drafter", tokenizer, seed=1,
                                         model=tiny_llama(len(tokenizer), 1, head_scale=10.0))}


@pytest.fixture(scope="module")
def target_distribution(target) -> dict:
    distribution = sequence_distribution(target, target.encode_prompt(PROMPT), LENGTH, PARAMS.temperature,
                                         PARAMS.top_k, PARAMS.top_p)
    assert len(distribution) >= 8 and max(distribution.values()) < 0.5  # far from a point mass
    return distribution


CASES = {
    "ar": ("same_vocab", dict(algorithm="ar")),
    "sd": ("same_vocab", dict(algorithm="sd")),
    "sd-adaptive": ("same_vocab", dict(algorithm="sd", adaptive=True, draft_tokens=1, max_draft_tokens=3)),
    "tli": ("byte_level", dict(algorithm="tli")),
    "tli-confidence": ("byte_level", dict(algorithm="tli", confidence_threshold=0.8)),
    "slrs": ("byte_level", dict(algorithm="slrs")),
    "slrs-lookahead2": ("byte_level", dict(algorithm="slrs", slrs_lookahead=2)),
    "slem": ("byte_level", dict(algorithm="slem")),
    "slem-tree": ("byte_level", dict(algorithm="slem", tree_width=2)),
}


def run_case(target, drafters, case: str) -> dict:
    drafter, speculation = CASES[case]
    engine = Engine(target, drafters[drafter])
    return exact_output(engine, PROMPT, PARAMS, SpeculationConfig(**{"draft_tokens": 3, **speculation}))


@pytest.mark.parametrize("case", CASES)
def test_exact_distribution_equals_the_target(target, drafters, target_distribution, case):
    assert total_variation(run_case(target, drafters, case), target_distribution) < TOLERANCE


def test_mutant_tli_ratio_with_the_unprocessed_drafter_softmax(target, drafters, target_distribution, monkeypatch):
    """Candidates drawn from the processed distribution (temperature, top-k, top-p) but accepted by the ratio
    of the unprocessed softmax."""
    seen: list[torch.Tensor] = []
    next_logits, draft = DrafterSide.next_logits, TokenLevelIntersection.draft

    def recording_next_logits(side):
        seen.append((yield from next_logits(side)))
        return seen[-1]

    def mutant_draft(algorithm, side, *args):
        seen.clear()
        result = yield from draft(algorithm, side, *args)
        if result.draft_probs is not None:
            mapping = algorithm.drafter_to_target()
            mapped = mapping >= 0
            rows = [torch.zeros(target.vocab_size).index_add_(
                0, mapping[mapped], torch.softmax(logits.masked_fill(~mapped, float("-inf")), -1)[mapped])
                for logits in seen[:len(result.candidates)]]
            result.draft_probs = torch.stack(rows)
        return result

    monkeypatch.setattr(DrafterSide, "next_logits", recording_next_logits)
    monkeypatch.setattr(TokenLevelIntersection, "draft", mutant_draft)
    assert total_variation(run_case(target, drafters, "tli"), target_distribution) > CAUGHT




def test_mutant_drafter_samples_with_the_accept_coin(target, drafters, target_distribution, monkeypatch):
    def accept_stream(seed, stream, position, draft_round=0):  # hetspec.sampling.uniform is the enumeration's
        return hetspec.sampling.uniform(seed, Stream.ACCEPT if stream == Stream.DRAFT else stream, position)

    monkeypatch.setattr(hetspec.algorithms.tli, "uniform", accept_stream)  # SD drafts with TLI's code
    assert total_variation(run_case(target, drafters, "sd"), target_distribution) > CAUGHT


# --- finding 1 of the audit: drafter noise reused after a rejection ---------------------------------------

A, B, C, AB = 0, 1, 2, 4  # target_tokenizer ids: a b c ' ' ab 'b ' ' c' abc
LOW = -200.0  # exp underflows to 0 in float32: a token outside a row has probability 0, no branch


def bigram(rows: dict[int, dict[int, float]]) -> torch.Tensor:  # -> [8, 8] next-token logits by last token
    table = torch.full((8, 8), LOW)
    for last, nexts in rows.items():
        for token, logit in nexts.items():
            table[last, token] = logit
    for last in range(8):
        if last not in rows:
            table[last, A] = 0.0
    return table


@pytest.fixture(scope="module")
def bigram_pair() -> Engine:
    """SD with k=3 on a same-vocabulary bigram pair built so that a rejected "a" (drafted before "b") is
    recovered as "ab": the drafter's context then keeps its own tokens "a", "b" (they spell the committed
    text) and the next draft, for the same position, comes from the drafter's row of "b", not of "ab"."""
    tokenizer = target_tokenizer()
    target = bigram({C: {A: 0.0, AB: 0.0, C: -0.5}, A: {B: 0.0, C: 0.0}, B: {A: 0.0, C: 0.0}, AB: {C: 0.0, A: 0.0}})
    drafter = bigram({C: {A: 2.0, AB: 0.0, C: 0.0}, A: {B: 2.0, C: 0.0}, B: {C: 2.0, A: 0.0}, AB: {A: 2.0, C: 0.0}})
    return Engine(language_model("bigram target", tokenizer, 0, model=bigram_llama(target)),
                  language_model("bigram drafter", tokenizer, 0, model=bigram_llama(drafter)))


def bigram_case(engine: Engine, temperature: float = 1.0, length: int = LENGTH) -> tuple[dict, dict]:
    params = SamplingParams(max_new_tokens=length, temperature=temperature, ignore_eos=True)
    expected = sequence_distribution(engine.target, engine.target.encode_prompt("c"), length, temperature)
    return exact_output(engine, "c", params, SpeculationConfig(algorithm="sd", draft_tokens=3)), expected


# The first token is the target's own (no draft before it), so the rejected "a" and its redraft come from the
# second step on: at LENGTH tokens the budget leaves that redraft no room (the mutant below went unseen).
REDRAFT_LENGTH = LENGTH + 1


def test_drafter_noise_is_fresh_after_a_rejection(bigram_pair):
    output, expected = bigram_case(bigram_pair, length=REDRAFT_LENGTH)
    assert total_variation(output, expected) < TOLERANCE


def test_mutant_drafter_noise_keyed_by_position_alone_is_caught(bigram_pair, monkeypatch):
    """The code before the fix: the redraft reuses the rejected draft's numbers."""
    def position_only(seed, stream, position, draft_round=0):
        return hetspec.sampling.uniform(seed, stream, position)

    monkeypatch.setattr(hetspec.algorithms.tli, "uniform", position_only)
    output, expected = bigram_case(bigram_pair, length=REDRAFT_LENGTH)
    assert total_variation(output, expected) > CAUGHT


def test_mutant_target_verifies_against_its_unprocessed_softmax(bigram_pair, monkeypatch):
    """On the bigram pair: its rows hold 2-3 tokens, so the mutant's residual (no top-k) stays enumerable."""
    output, expected = bigram_case(bigram_pair, temperature=0.8)
    assert total_variation(output, expected) < TOLERANCE
    monkeypatch.setattr(hetspec.verify, "logits_to_probs", lambda logits, *processing: torch.softmax(logits, -1))
    output, expected = bigram_case(bigram_pair, temperature=0.8)
    assert total_variation(output, expected) > CAUGHT
