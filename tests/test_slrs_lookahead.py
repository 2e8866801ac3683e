"""SLRS with multi-token lookahead (Timor et al. 2025, Alg. 3): exact psi, losslessness, greedy, the budget.

The drafter is byte-level with one token per character and the two bytes of 'é' as separate tokens, so
only lookahead can propose the target's multi-character tokens ('ab', 'é'), and sequences that split
'é' wrongly ('a' + 0xC3) are not valid UTF-8 and must be excluded. psi is checked against a slow
reference that enumerates the sequences with one uncached forward pass per prefix.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import hetspec.algorithms.slrs
from synthetic import chi_square_pvalue, language_model, sequence_distribution, single_thread, tiny_llama
from hetspec import Engine, SamplingParams, SpeculationConfig
from hetspec.algorithms import DrafterSide, EnumerationBudgetExceeded
from hetspec.passes import run_alone
from hetspec.algorithms.slrs import StringLevelRejectionSampling
from hetspec.models import LanguageModel
from hetspec.sampling import logits_to_probs
from hetspec.vocab import token_bytes

PROMPT = "ab c"
E_ACUTE = "\u00e9"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with single_thread():
        yield


def drafter_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level, no merges: a b c ' ' 0xC3 0xA9 (the bytes of 'é') and a special token without text."""
    pieces = ["a", "b", "c", "\u0120", "\u00c3", "\u00a9", "<|end|>"]
    backend = Tokenizer(models.BPE({piece: index for index, piece in enumerate(pieces)}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|end|>")


def target_tokenizer() -> PreTrainedTokenizerFast:
    """Literal characters with multi-character merges: a b c ' ' é ab 'b ' ' c' abc éa."""
    merges = [("a", "b"), ("b", " "), (" ", "c"), ("ab", "c"), (E_ACUTE, "a")]
    token_ids = {piece: index for index, piece in enumerate(["a", "b", "c", " ", E_ACUTE])}
    for left, right in merges:
        token_ids[left + right] = len(token_ids)
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(token_ids, merges)))


@pytest.fixture(scope="module")
def target() -> LanguageModel:
    return language_model("target", target_tokenizer(), seed=0, model=tiny_llama(10, seed=0, head_scale=15))


@pytest.fixture(scope="module")
def drafter() -> LanguageModel:
    """Flatter than the target, so psi has mass on every reachable target token."""
    return language_model("byte drafter", drafter_tokenizer(), seed=2, model=tiny_llama(7, seed=2, head_scale=4))


@pytest.fixture(scope="module")
def engine(target, drafter) -> Engine:
    return Engine(target, drafter)


def test_the_toy_vocabularies(target, drafter):
    assert token_bytes(drafter.tokenizer) == [b"a", b"b", b"c", b" ", b"\xc3", b"\xa9", None]
    assert token_bytes(target.tokenizer) == [b"a", b"b", b"c", b" ", b"\xc3\xa9", b"ab", b"b ", b" c", b"abc",
                                             b"\xc3\xa9a"]
    assert drafter.encode(E_ACUTE) == [4, 5]


def slrs_psi(engine: Engine, committed: bytes, lookahead: int, params: SamplingParams) -> torch.Tensor:
    """psi of SLRS's first proposal after PROMPT + committed text (the row verification uses).  -> [target_vocab]"""
    algorithm = StringLevelRejectionSampling(engine.maps, SpeculationConfig(algorithm="slrs",
                                                                            slrs_lookahead=lookahead))
    side = DrafterSide(engine.drafter, engine.drafter.encode_prompt(PROMPT), window=8)
    try:
        draft = run_alone(engine.drafter, algorithm.draft(side, committed, 1, params.seeded(), first_position=0,
                                                          draft_round=0))
    finally:
        side.release()
    return draft.draft_probs[0]


@torch.inference_mode()
def reference_psi(drafter: LanguageModel, target: LanguageModel, context_ids: list[int], lookahead: int,
                  params: SamplingParams) -> torch.Tensor:
    """psi by brute force: every drafter sequence, one forward pass over the whole text per prefix (no KV cache,
    no batch), float64 sums."""
    table = token_bytes(drafter.tokenizer)
    has_text = torch.tensor([bool(piece) for piece in table])

    @functools.cache
    def next_probs(prefix: tuple[int, ...]) -> torch.Tensor:
        logits = drafter.model(input_ids=torch.tensor([context_ids + list(prefix)])).logits[0, -1]
        logits = logits.masked_fill(~has_text, float("-inf"))
        return logits_to_probs(logits, params.temperature, params.top_k, params.top_p).double()

    psi = torch.zeros(target.vocab_size, dtype=torch.float64)
    for sequence in itertools.product(range(drafter.vocab_size), repeat=lookahead):
        prob = 1.0
        for length in range(lookahead):
            prob *= float(next_probs(sequence[:length])[sequence[length]])
        try:
            text = b"".join(table[token] or b"" for token in sequence).decode("utf-8")
        except UnicodeDecodeError:
            continue
        encoded = target.encode(text)
        if encoded and prob > 0:
            psi[encoded[0]] += prob
    return psi / psi.sum()


@pytest.mark.parametrize("lookahead, committed, params", [
    (2, b"", SamplingParams(temperature=1.0)),
    (2, "ab\u00e9".encode(), SamplingParams(temperature=0.7, top_k=4)),
    (3, b" c", SamplingParams(temperature=1.3, top_p=0.8)),
])
def test_psi_equals_the_brute_force_reference(engine, drafter, target, lookahead, committed, params):
    context_ids = drafter.encode_prompt(PROMPT) + drafter.encode(committed.decode())
    expected = reference_psi(drafter, target, context_ids, lookahead, params)
    psi = slrs_psi(engine, committed, lookahead, params)
    assert torch.allclose(psi.double(), expected, atol=1e-6, rtol=0)


def test_psi_sums_to_one_and_reaches_tokens_a_single_drafter_token_cannot(engine, target):
    params = SamplingParams(temperature=1.0)
    psi = slrs_psi(engine, b"", 2, params)
    single_token_psi = slrs_psi(engine, b"", 1, params)
    assert abs(float(psi.sum()) - 1.0) < 1e-6 and bool((psi >= 0).all())
    multi_character = [target.encode("ab")[0], target.encode(E_ACUTE)[0]]
    assert bool((psi[multi_character] > 1e-4).all())
    assert float(single_token_psi[multi_character].sum()) == 0.0


# Tokens generated per seed: the drafter drafts nothing before the first token, so the second step drafts the
# one candidate the budget leaves (k = remaining - 1) and the third token follows an accept or a residual
LENGTH = 3


def generated_sequences(engine: Engine, seeds: int) -> tuple[list[tuple[int, ...]], int, int]:
    """LENGTH tokens per seed with SLRS lookahead 2; also the drafted and accepted totals."""
    params = SamplingParams(max_new_tokens=LENGTH, temperature=1.0, ignore_eos=True)
    speculation = SpeculationConfig(algorithm="slrs", slrs_lookahead=2)
    drafted = accepted = 0
    samples = []
    for seed in range(seeds):
        result = engine.generate(PROMPT, params.model_copy(update={"seed": seed}), speculation=speculation)
        samples.append(tuple(result.token_ids))
        drafted += result.stats.drafted_tokens
        accepted += result.stats.accepted_tokens
    return samples, drafted, accepted


@pytest.fixture(scope="module")
def exact_sequences(target) -> dict[tuple[int, ...], float]:
    return sequence_distribution(target, target.encode_prompt(PROMPT), LENGTH, temperature=1.0)


def test_lookahead_two_is_lossless(engine, exact_sequences):
    """LENGTH generated tokens, 1500 fixed seeds: the empirical distribution against the target's exact one."""
    samples, drafted, accepted = generated_sequences(engine, 1500)
    assert drafted == 1500 and 0 < accepted < drafted  # both the accept and the residual path were taken
    assert chi_square_pvalue(samples, exact_sequences) > 1e-3


def test_negative_control_candidates_not_drawn_from_psi_are_caught(engine, exact_sequences, monkeypatch):
    """Drawing candidates from another distribution than the psi they are verified against (what an inexact
    psi amounts to; here proportional to 1/psi on psi's support) is lossy, and the test sees it with fewer seeds
    than the real test uses (p ~ 3e-14 at 600 seeds)."""
    sample_from = hetspec.algorithms.slrs.sample_from

    def sample_from_inverse_psi(psi: torch.Tensor, u: float) -> int:
        return sample_from(torch.where(psi > 0, 1 / psi.clamp(min=1e-30), 0.0), u)

    monkeypatch.setattr(hetspec.algorithms.slrs, "sample_from", sample_from_inverse_psi)
    samples, _, _ = generated_sequences(engine, 600)
    assert chi_square_pvalue(samples, exact_sequences) < 1e-6


@pytest.mark.parametrize("lookahead", [2, 3])
def test_greedy_equals_the_target_alone(engine, lookahead):
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    for prompt in ("ab c", "cab ba", E_ACUTE + "a bc"):
        expected = engine.generate(prompt, params, speculation=SpeculationConfig(algorithm="ar")).token_ids
        result = engine.generate(prompt, params, speculation=SpeculationConfig(algorithm="slrs",
                                                                               slrs_lookahead=lookahead))
        assert result.token_ids == expected
        assert result.stats.drafted_tokens > 0


def test_an_enumeration_above_the_budget_is_refused(engine):
    speculation = SpeculationConfig(algorithm="slrs", slrs_lookahead=3, slrs_enumeration_budget=300)
    with pytest.raises(EnumerationBudgetExceeded, match=r"7\^3 = 343 drafter sequences.*budget=300"):
        engine.generate(PROMPT, SamplingParams(max_new_tokens=2, temperature=1.0), speculation=speculation)
    # at the budget it runs
    speculation = speculation.model_copy(update={"slrs_enumeration_budget": 343})
    assert len(engine.generate(PROMPT, SamplingParams(max_new_tokens=2, temperature=1.0, ignore_eos=True),
                               speculation=speculation).token_ids) == 2
