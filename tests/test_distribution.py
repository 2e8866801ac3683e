"""End-to-end losslessness through ``hetspec.Engine`` on tiny synthetic models with different vocabularies.

The target's exact distribution over its first N generated tokens is enumerated with the target alone
(chain rule over every sequence; the vocabulary has 8 tokens). Each algorithm generates N tokens for
seeds 0..S-1 and the empirical distribution is compared with the exact one by a chi-square test.
Seeds are fixed, so each test always passes or always fails. A negative control (a wrong residual)
shows the test has the power to catch a lossy verification. The default run covers temperature 1 over 4
tokens and temperature 0.8 with top-k and top-p over 5 tokens with k = 3 (so a round drafts 3 and a rejection
leads to a redraft of the same positions); tests/test_exact_distribution.py computes the same distributions
exactly.
"""

from __future__ import annotations

import pytest

import hetspec.verify
from synthetic import (char_bpe_tokenizer, chi_square_pvalue, drafter_tokenizer, language_model, perturbed_copy,
                       sequence_distribution, single_thread, target_tokenizer)
from hetspec import Engine, SamplingParams, SpeculationConfig
from hetspec.models import LanguageModel
from hetspec.vocab import token_bytes

PROMPT = "ab c"
LENGTH = 4  # generated tokens whose joint distribution is tested: the first is the target's own (no step drafts
# before the first token, hetspec/decoder.py's Progress.draft_length), drafts cover the other 3
SEEDS = 1200
P_THRESHOLD = 1e-3
SAMPLING = {
    "t1": SamplingParams(max_new_tokens=LENGTH, temperature=1.0, ignore_eos=True),
    "t0.8-top5-p0.9": SamplingParams(max_new_tokens=LENGTH, temperature=0.8, top_k=5, top_p=0.9, ignore_eos=True),
    # the default run's rejection-sampling setting: processed != unprocessed, and with k = 3 the first round drafts 3
    # and later rounds draft again over positions a rejection left open
    "t0.8-top5-p0.9-5tokens": SamplingParams(max_new_tokens=5, temperature=0.8, top_k=5, top_p=0.9, ignore_eos=True),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def target() -> LanguageModel:
    return language_model("target", target_tokenizer(), seed=0)


@pytest.fixture(scope="module")
def engines(target) -> dict[str, Engine]:
    """Drafters by kind: none; the target's tokenizer with a perturbed copy of the target (a drafter whose
    distribution overlaps the target's but differs in shape, so a wrong residual shows); byte-level and
    SentencePiece-marker tokenizers with other merges (independent random models)."""
    metaspace = char_bpe_tokenizer([("b", "b"), ("c", " "), ("a", "c ")], style="metaspace")
    same_vocab = language_model("same-vocab drafter", target.tokenizer, seed=0,
                                model=perturbed_copy(target.model, noise=0.6, seed=5))
    return {
        "none": Engine(target),
        "same_vocab": Engine(target, same_vocab),
        "byte_level": Engine(target, language_model("byte-level drafter", drafter_tokenizer(), seed=1)),
        "metaspace": Engine(target, language_model("metaspace drafter", metaspace, seed=3)),
    }


DRAFTER_OF = {"ar": "none", "sd": "same_vocab", "tli": "byte_level", "slrs": "byte_level", "slem": "byte_level"}

Distribution = dict[tuple[int, ...], float]


@pytest.fixture(scope="module")
def exact(target) -> dict[str, Distribution]:
    """The target's exact distribution of its first LENGTH tokens after PROMPT, per sampling setting."""
    prompt_ids = target.encode_prompt(PROMPT)
    return {name: sequence_distribution(target, prompt_ids, params.max_new_tokens, params.temperature, params.top_k,
                                        params.top_p)
            for name, params in SAMPLING.items()}


def generated_sequences(engine: Engine, algorithm: str, sampling: str, seeds: int,
                        tree_width: int = 1, draft_tokens: int = 5) -> list[tuple[int, ...]]:
    speculation = SpeculationConfig(algorithm=algorithm, tree_width=tree_width, draft_tokens=draft_tokens)
    params = SAMPLING[sampling]
    return [tuple(engine.generate(PROMPT, params.model_copy(update={"seed": seed}), speculation=speculation).token_ids)
            for seed in range(seeds)]


@pytest.fixture(scope="module")
def target_alone_sequences(engines) -> list[tuple[int, ...]]:
    return generated_sequences(engines["none"], "ar", "t1", SEEDS)


def pvalue(engines, exact, algorithm: str, sampling: str, seeds: int = SEEDS, draft_tokens: int = 5) -> float:
    samples = generated_sequences(engines[DRAFTER_OF[algorithm]], algorithm, sampling, seeds,
                                  draft_tokens=draft_tokens)
    return chi_square_pvalue(samples, exact[sampling])


# --- the synthetic vocabularies ------------------------------------------------------------------------

def test_token_bytes_of_the_synthetic_tokenizers(engines):
    assert token_bytes(target_tokenizer()) == [b"a", b"b", b"c", b" ", b"ab", b"b ", b" c", b"abc"]
    assert token_bytes(drafter_tokenizer()) == [b"a", b"b", b"c", b" ", b"bb", b"abb", b"ca", b" a"]
    assert token_bytes(engines["metaspace"].drafter.tokenizer) == [b"a", b"b", b"c", b" ", b"bb", b"c ", b"ac "]
    maps = engines["byte_level"].maps
    assert not maps.same_vocabulary and engines["same_vocab"].maps.same_vocabulary
    assert maps.intersection.tolist() == [0, 1, 2, 3, -1, -1, -1, -1]
    # bb -> b, abb -> ab (a multi-character target token), ca -> c, " a" -> " "
    assert maps.first_target_token.tolist() == [0, 1, 2, 3, 1, 4, 2, 3]


def test_the_target_distribution_is_far_from_uniform(exact):
    """The test needs peaked distributions: a near-uniform target would hide a wrong verification."""
    probs = sorted(exact["t1"].values(), reverse=True)
    assert probs[0] > 50 / 8 ** LENGTH and abs(sum(probs) - 1) < 1e-5


# --- distributions -------------------------------------------------------------------------------------

def test_target_alone_follows_its_distribution(exact, target_alone_sequences):
    assert chi_square_pvalue(target_alone_sequences, exact["t1"]) > P_THRESHOLD


@pytest.mark.parametrize("algorithm", ["sd", "tli", "slrs"])
def test_rejection_sampling_algorithms_are_lossless(engines, exact, algorithm):
    assert pvalue(engines, exact, algorithm, "t1") > P_THRESHOLD
    assert pvalue(engines, exact, algorithm, "t0.8-top5-p0.9-5tokens", draft_tokens=3) > P_THRESHOLD


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["ar", "sd", "tli", "slrs", "slem"])
def test_lossless_with_temperature_top_k_and_top_p(engines, exact, algorithm):
    assert pvalue(engines, exact, algorithm, "t0.8-top5-p0.9", seeds=3000) > P_THRESHOLD


@pytest.mark.parametrize("tree_width", [1, 3])
def test_slem_reproduces_the_target_alone_seed_for_seed(engines, exact, target_alone_sequences, tree_width):
    """SLEM keeps only the target's own seeded choices, so it equals ``ar`` per seed, not just in distribution;
    with a draft tree too (the target walks the tree taking its own choices)."""
    slem = generated_sequences(engines["byte_level"], "slem", "t1", 300, tree_width)
    assert slem == target_alone_sequences[:300]
    assert chi_square_pvalue(slem, exact["t1"]) > P_THRESHOLD


@pytest.mark.parametrize("algorithm, seeds", [("sd", 900), ("tli", 900)])
def test_negative_control_a_wrong_residual_is_caught(engines, exact, algorithm, seeds, monkeypatch):
    """Drawing the recovered token from the target instead of the residual is lossy; the test must see it
    with fewer seeds than the real tests use."""
    monkeypatch.setattr(hetspec.verify, "residual_probs", lambda target_probs, draft_probs: target_probs)
    assert pvalue(engines, exact, algorithm, "t1", seeds=seeds) < 1e-6


# --- drafter identical to the target -------------------------------------------------------------------

@pytest.fixture(scope="module")
def char_target() -> LanguageModel:
    """A target whose tokenizer has no merges. SLEM re-tokenizes the drafted text, so an identical drafter
    only has all its drafts kept when each sampled token sequence is the canonical tokenization of its
    text; random models often sample non-canonical ones ('b', ' ' for 'b ') from a BPE vocabulary."""
    return language_model("char target", char_bpe_tokenizer([]), seed=4)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("algorithm, target_kind, tree_width", [
    ("sd", "bpe", 1), ("tli", "bpe", 1), ("sd", "char", 1), ("tli", "char", 1), ("slem", "char", 1), ("slem", "char", 3)])
def test_identical_drafter_accepts_every_draft(target, char_target, algorithm, target_kind, tree_width, temperature):
    """With a tree, the drafter's own chain is one of the branches and the target walks all of it."""
    model = target if target_kind == "bpe" else char_target
    engine = Engine(model, model)
    speculation = SpeculationConfig(algorithm=algorithm, draft_tokens=4, tree_width=tree_width)
    for seed in range(5):
        params = SamplingParams(max_new_tokens=12, temperature=temperature, seed=seed, ignore_eos=True)
        stats = engine.generate(PROMPT, params, speculation=speculation).stats
        assert stats.drafted_tokens > 0 and stats.accepted_tokens == stats.drafted_tokens


# --- greedy ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("drafter, algorithm, tree_width", [
    ("same_vocab", "sd", 1),
    ("byte_level", "tli", 1), ("byte_level", "slrs", 1), ("byte_level", "slem", 1), ("byte_level", "slem", 3),
    ("metaspace", "tli", 1), ("metaspace", "slrs", 1), ("metaspace", "slem", 1), ("metaspace", "slem", 2),
])
def test_greedy_equals_the_target_alone(engines, drafter, algorithm, tree_width):
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    speculation = SpeculationConfig(algorithm=algorithm, tree_width=tree_width)
    for prompt in ("ab c", "c", "cab ba", "a a bcc"):
        expected = engines["none"].generate(prompt, params, speculation=SpeculationConfig(algorithm="ar")).token_ids
        result = engines[drafter].generate(prompt, params, speculation=speculation)
        assert result.token_ids == expected
        assert result.stats.drafted_tokens > 0
