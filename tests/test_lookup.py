"""Context lookup drafts (hetspec/lookup.py): the index, the choice of source, and exactness for every algorithm.

Exactness is shown three ways: greedy (and seeded SLEM) output equal to the target alone on the real pair with
prompts that repeat themselves, so lookups are made and accepted; on the synthetic pair, the exact output
distribution (every random number enumerated, tests/exact_distribution.py) and a chi-square test with fixed
seeds, with lookup drafts forced on for the rejection-sampling algorithms at temperature > 0, where a lookup
draft is a point-mass proposal; and the server's loop (in process) giving the library's tokens.
"""

from __future__ import annotations

import pytest
import torch

import hetspec.verify
from exact_distribution import Enumeration, total_variation
from synthetic import (chi_square_pvalue, drafter_tokenizer, language_model, perturbed_copy, sequence_distribution,
                       single_thread, target_tokenizer, tiny_llama)
from test_batching import check_against_reference, reference_greedy
from hetspec import Engine, SamplingParams, SpeculationConfig
from hetspec.config import BatchingConfig
from hetspec.step import BatchDecoder
from hetspec.lookup import (MATCH_CANDIDATES, RETRY_AFTER, ContextIndex, SourceTally, common_suffix_length,
                            point_mass_probs, prefers_lookup, utf8_prefix)
from hetspec.sampling import accepts
from hetspec.verify import residual_probs

# --- the index -------------------------------------------------------------------------------------------


def index_of(text: bytes, min_match: int = 2, max_match: int = 64) -> ContextIndex:
    index = ContextIndex(min_match, max_match)
    index.extend(text)
    return index


def test_the_index_is_incremental():
    """Appending in pieces indexes exactly what appending at once does, one entry per byte that has a byte after it."""
    text = b"def f(x):\n    return x + x\ndef g(x):\n    return f(x)\n"
    whole = index_of(text, 3)
    pieces = ContextIndex(3, 64)
    for start in range(0, len(text), 5):
        pieces.extend(text[start:start + 5])
        assert sum(map(len, pieces.ends.values())) == max(0, len(pieces) - 3)
    assert pieces.ends == whole.ends and pieces.longest_match() == whole.longest_match()


def test_the_text_end_is_never_its_own_match():
    assert index_of(b"xab").longest_match() == (0, -1)
    assert index_of(b"abab").continuation(8) == b"ab"


def test_the_longest_suffix_wins_and_its_continuation_is_proposed():
    # "ab" occurs twice before the end; the end's longer suffix " xab" matches only the first ("... xab1")
    index = index_of(b"q xab1 yab2 xab")
    assert index.longest_match() == (4, 5)
    assert index.continuation(8) == b"1 yab2 x"
    assert index.continuation(2) == b"1 "


def test_a_tie_takes_the_most_recent_occurrence():
    assert index_of(b"xab1 yab2 zab").longest_match() == (2, 8)
    assert index_of(b"xab1 yab2 zab").continuation(1) == b"2"


def test_min_and_max_match():
    assert index_of(b"ab1 zb", min_match=2).longest_match() == (0, -1)  # only "b" in common: below min_match
    assert index_of(b"ab1 zb", min_match=1).longest_match() == (1, 2)
    assert index_of(b"abcdef1 abcdef", min_match=2, max_match=4).longest_match() == (4, 6)  # capped
    with pytest.raises(ValueError):
        ContextIndex(4, 3)


def test_bounded_work_per_lookup():
    """Only the MATCH_CANDIDATES most recent occurrences of the last min_match bytes are compared: the oldest,
    longer match is out of reach, and a comparison never reads more than max_match bytes."""
    text = b"zzab0" + b"".join(b" ab%d" % (i % 10) for i in range(MATCH_CANDIDATES + 4)) + b" zzab"
    index = index_of(text, min_match=2, max_match=64)
    length, end = index.longest_match()
    assert (length, end) == (2, index.ends[b"ab"][-1])  # "ab" after a space: the most recent
    assert index.ends[b"ab"][0] == 4  # the first, "zzab", matches 4 bytes: indexed, but too old to be compared
    assert common_suffix_length(b"x" * 100, 50, 100, 7) == 7


def test_a_match_ending_inside_a_character_proposes_nothing():
    assert utf8_prefix("é".encode()[1:] + b"abc") == ""
    assert utf8_prefix("aé".encode() + "é".encode()[:1]) == "aé"


# --- the choice of source ----------------------------------------------------------------------------------

def test_prefers_lookup():
    good, poor = SourceTally(drafts=10, drafted=100, accepted=60), SourceTally(drafts=10, drafted=100, accepted=2)
    drafter = SourceTally(drafts=10, drafted=50, accepted=30)
    assert not prefers_lookup("off", 8, 2, good, drafter, 0)
    assert not prefers_lookup("always", 1, 2, good, drafter, 0)  # too short
    assert prefers_lookup("always", 2, 2, poor, drafter, 0)
    assert prefers_lookup("auto", 2, 2, poor, None, 0)  # no drafter: the lookup or nothing
    assert prefers_lookup("auto", 2, 2, good, drafter, 0)
    assert not prefers_lookup("auto", 2, 2, poor, drafter, 0)
    assert prefers_lookup("auto", 2, 2, poor, drafter, RETRY_AFTER)  # tried again now and then
    assert prefers_lookup("auto", 2, 2, SourceTally(), SourceTally(), 0)  # unmeasured: tried


def test_config_ranges():
    SpeculationConfig(lookup="auto", lookup_min_match=4, lookup_max_match=4, lookup_min_draft=3, lookup_max_draft=3)
    for bad in ({"lookup": "on"}, {"lookup_min_match": 0}, {"lookup_max_draft": 65},
                {"lookup_min_match": 10, "lookup_max_match": 9}, {"lookup_min_draft": 5, "lookup_max_draft": 4}):
        with pytest.raises(ValueError):
            SpeculationConfig(**bad)


# --- a point-mass proposal in speculative sampling ---------------------------------------------------------

def test_point_mass_rows_accept_with_the_target_probability_and_remove_the_token_on_rejection():
    """Speculative sampling with q = one-hot(t): accept t with probability p(t), else sample p without t,
    renormalised; p(t) * 1[t] + (1 - p(t)) * that = p, the target's distribution."""
    target_probs = torch.tensor([0.1, 0.6, 0.3, 0.0])
    draft_probs = point_mass_probs([1, 2], 4)
    assert draft_probs.tolist() == [[0, 1, 0, 0], [0, 0, 1, 0]]
    assert accepts(0.59, float(target_probs[1]), 1.0) and not accepts(0.61, float(target_probs[1]), 1.0)
    residual = residual_probs(target_probs, draft_probs[0])
    assert torch.allclose(residual, torch.tensor([0.25, 0.0, 0.75, 0.0]))
    assert torch.allclose(target_probs[1] * draft_probs[0] + (1 - target_probs[1]) * residual, target_probs)


# --- the synthetic pair: exact and sampled distributions -----------------------------------------------------

FORCED = dict(lookup="always", lookup_min_match=1, lookup_min_draft=1, draft_tokens=3)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def synthetic_target():
    tokenizer = target_tokenizer()
    return language_model("target", tokenizer, seed=0, model=tiny_llama(len(tokenizer), 0, head_scale=10.0))


@pytest.fixture(scope="module")
def synthetic_drafters(synthetic_target):
    tokenizer = drafter_tokenizer()
    return {"same_vocab": language_model("same-vocab drafter", synthetic_target.tokenizer, seed=0,
                                         model=perturbed_copy(synthetic_target.model, noise=0.6, seed=5)),
            "byte_level": language_model("byte-level drafter", tokenizer, seed=1,
                                         model=tiny_llama(len(tokenizer), 1, head_scale=10.0))}


DRAFTER_OF = {"ar": "same_vocab", "sd": "same_vocab", "tli": "byte_level", "slrs": "byte_level",
              "slem": "byte_level"}
EXACT_PROMPT = "ab cab c"  # the text repeats itself: lookups have something to copy from the first step
EXACT_PARAMS = SamplingParams(max_new_tokens=4, temperature=0.8, top_k=2, top_p=0.95, ignore_eos=True)


@pytest.mark.parametrize("mode", ["always", "auto"])
@pytest.mark.parametrize("algorithm", ["ar", "sd", "tli", "slrs", "slem"])
def test_exact_distribution_with_lookup_drafts(synthetic_target, synthetic_drafters, algorithm, mode):
    """Every random number enumerated (tests/exact_distribution.py): with lookup drafts the output distribution is
    the target's; in auto mode the source chosen depends on earlier acceptance, which must not matter either."""
    engine = Engine(synthetic_target, synthetic_drafters[DRAFTER_OF[algorithm]])
    speculation = SpeculationConfig(algorithm=algorithm, **{**FORCED, "lookup": mode})
    expected = sequence_distribution(synthetic_target, synthetic_target.encode_prompt(EXACT_PROMPT),
                                     EXACT_PARAMS.max_new_tokens, EXACT_PARAMS.temperature, EXACT_PARAMS.top_k,
                                     EXACT_PARAMS.top_p)
    lookups = []

    def sample():
        result = engine.generate(EXACT_PROMPT, EXACT_PARAMS, speculation=speculation)
        lookups.append(result.stats.lookup_drafts)
        return tuple(result.token_ids)

    assert total_variation(Enumeration().distribution(sample), expected) < 1e-6
    assert any(lookups), "lookup drafts must have been verified"


@pytest.mark.parametrize("algorithm", ["sd", "tli"])
def test_exact_mutant_a_wrong_residual_after_a_lookup_draft_is_caught(synthetic_target, synthetic_drafters,
                                                                      algorithm, monkeypatch):
    """The exact test's power: rejecting a point mass and then sampling the target (the rejected token put back)
    is lossy by more than 1e-3."""
    monkeypatch.setattr(hetspec.verify, "residual_probs", lambda target_probs, draft_probs: target_probs)
    engine = Engine(synthetic_target, synthetic_drafters[DRAFTER_OF[algorithm]])
    speculation = SpeculationConfig(algorithm=algorithm, **FORCED)
    expected = sequence_distribution(synthetic_target, synthetic_target.encode_prompt(EXACT_PROMPT),
                                     EXACT_PARAMS.max_new_tokens, EXACT_PARAMS.temperature, EXACT_PARAMS.top_k,
                                     EXACT_PARAMS.top_p)
    outputs = Enumeration().distribution(
        lambda: tuple(engine.generate(EXACT_PROMPT, EXACT_PARAMS, speculation=speculation).token_ids))
    assert total_variation(outputs, expected) > 1e-3


SEEDS = 1200
CHI_PROMPT = "ab c"
CHI_SAMPLING = {
    "t1": SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True),
    "t0.8-top5-p0.9": SamplingParams(max_new_tokens=5, temperature=0.8, top_k=5, top_p=0.9, ignore_eos=True),
}


@pytest.fixture(scope="module")
def chi_target():
    """The chi-square tests' target (tests/test_distribution.py): peaked distributions."""
    return language_model("target", target_tokenizer(), seed=0)


@pytest.fixture(scope="module")
def chi_engines(chi_target):
    same_vocab = language_model("same-vocab drafter", chi_target.tokenizer, seed=0,
                                model=perturbed_copy(chi_target.model, noise=0.6, seed=5))
    return {"sd": Engine(chi_target, same_vocab),
            "byte_level": Engine(chi_target, language_model("byte-level drafter", drafter_tokenizer(), seed=1))}


def lookup_samples(engine: Engine, algorithm: str, params: SamplingParams, seeds: int) -> tuple[list, int]:
    """(sequences for seeds 0..seeds-1, how many of them verified a lookup draft)."""
    speculation = SpeculationConfig(algorithm=algorithm, **FORCED)
    samples, with_lookup = [], 0
    for seed in range(seeds):
        result = engine.generate(CHI_PROMPT, params.model_copy(update={"seed": seed}), speculation=speculation)
        samples.append(tuple(result.token_ids))
        with_lookup += result.stats.lookup_drafts > 0
    return samples, with_lookup


@pytest.mark.parametrize("sampling", CHI_SAMPLING)
@pytest.mark.parametrize("algorithm", ["sd", "tli", "slrs"])
def test_rejection_sampling_with_lookup_drafts_is_lossless(chi_target, chi_engines, algorithm, sampling):
    params = CHI_SAMPLING[sampling]
    engine = chi_engines["sd" if algorithm == "sd" else "byte_level"]
    samples, with_lookup = lookup_samples(engine, algorithm, params, SEEDS)
    expected = sequence_distribution(chi_target, chi_target.encode_prompt(CHI_PROMPT), params.max_new_tokens,
                                     params.temperature, params.top_k, params.top_p)
    assert with_lookup > SEEDS // 2
    assert chi_square_pvalue(samples, expected) > 1e-3


def test_negative_control_a_wrong_residual_with_lookup_drafts_is_caught(chi_target, chi_engines, monkeypatch):
    """Sampling the target instead of the residual after rejecting a point mass puts the rejected token back:
    lossy, and the test must see it."""
    monkeypatch.setattr(hetspec.verify, "residual_probs", lambda target_probs, draft_probs: target_probs)
    params = CHI_SAMPLING["t1"]
    samples, _ = lookup_samples(chi_engines["byte_level"], "tli", params, 600)
    expected = sequence_distribution(chi_target, chi_target.encode_prompt(CHI_PROMPT), params.max_new_tokens,
                                     params.temperature)
    assert chi_square_pvalue(samples, expected) < 1e-6


def test_seeded_slem_with_lookup_reproduces_the_target_alone_seed_for_seed(chi_engines):
    engine = chi_engines["byte_level"]
    params = CHI_SAMPLING["t1"]
    speculation = SpeculationConfig(algorithm="slem", **FORCED)
    with_lookup = 0
    for seed in range(200):
        seeded = params.model_copy(update={"seed": seed})
        result = engine.generate(CHI_PROMPT, seeded, speculation=speculation)
        alone = engine.generate(CHI_PROMPT, seeded, speculation=SpeculationConfig(algorithm="ar"))
        assert result.token_ids == alone.token_ids
        with_lookup += result.stats.lookup_drafts > 0
    assert with_lookup > 100


# --- the real pair: greedy and seeded output equal the target alone ----------------------------------------------

REPEATING_PROMPTS = [
    "def total_price(items):\n    total_price = 0\n    for item in items:\n        total_price += item.price * "
    "item.quantity\n    return total_price\n\n\ndef total_weight(items):\n",
    "Alice: How are you today, Bob?\nBob: I am fine, Alice. How are you today?\nAlice: I am fine too, Bob.\n"
    "Bob: How are you today, Carol?\nCarol:",
]
REAL_LOOKUP = dict(lookup="always", lookup_min_match=8, lookup_max_draft=12, draft_tokens=4)


@pytest.mark.parametrize("algorithm", ["ar", "slem", "tli", "slrs"])
def test_greedy_with_lookup_equals_the_target_alone(gemma, smollm, algorithm):
    engine = Engine(gemma, smollm)
    speculation = SpeculationConfig(algorithm=algorithm, **REAL_LOOKUP)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    ties, accepted = [], 0
    for prompt in REPEATING_PROMPTS:
        result = engine.generate(prompt, params, speculation=speculation)
        check_against_reference(gemma, prompt, result.token_ids, reference_greedy(gemma, prompt, 40), ties)
        stats = result.stats
        assert stats.lookup_drafted_tokens + stats.drafter_drafted_tokens == stats.drafted_tokens
        assert stats.lookup_accepted_tokens + stats.drafter_accepted_tokens == stats.accepted_tokens
        accepted += stats.lookup_accepted_tokens
    assert not ties, ties
    assert accepted > 10, "the prompts repeat themselves: lookups must be accepted"


def test_seeded_slem_with_lookup_equals_seeded_ar_on_the_real_pair(gemma, smollm):
    engine = Engine(gemma, smollm)
    for seed in range(3):
        params = SamplingParams(max_new_tokens=24, temperature=0.7, seed=seed, ignore_eos=True)
        alone = engine.generate(REPEATING_PROMPTS[0], params, speculation={"algorithm": "ar"})
        result = engine.generate(REPEATING_PROMPTS[0], params,
                                 speculation=SpeculationConfig(algorithm="slem", **{**REAL_LOOKUP, "lookup": "auto"}))
        assert result.token_ids == alone.token_ids
        assert result.stats.lookup_drafts > 0


def test_lookup_in_a_batch(gemma, smollm):
    """Requests with and without lookup, of every algorithm, in one continuous batch (2 slots for 4 requests):
    greedy ones give the target alone's tokens, sampled ones batch 1's."""
    engine = Engine(gemma, smollm, batching=BatchingConfig(max_batch_size=2, prefill_chunk_tokens=8))
    requests = [("slem", REPEATING_PROMPTS[0], SamplingParams(max_new_tokens=30)),
                ("tli", REPEATING_PROMPTS[1], SamplingParams(max_new_tokens=20)),
                ("ar", REPEATING_PROMPTS[1], SamplingParams(max_new_tokens=20)),
                ("slrs", REPEATING_PROMPTS[0], SamplingParams(max_new_tokens=16, temperature=0.8, seed=7))]
    speculation = [SpeculationConfig(algorithm=algorithm, **REAL_LOOKUP) for algorithm, _, _ in requests]
    decoder = BatchDecoder(gemma, smollm, engine.batching)
    queue = [engine.request(prompt, params, speculation=speculation[index], request_id=str(index))
             for index, (_, prompt, params) in enumerate(requests)]
    tokens, finished = {index: [] for index in range(len(requests))}, {}
    while queue or len(decoder):
        while queue and len(decoder) < 2:
            decoder.add(queue.pop(0))
        for request, event in decoder.step():
            tokens[int(request.request_id)].extend(event.token_ids)
            if event.finish_reason:
                finished[int(request.request_id)] = event.stats
    ties = []
    for index, (algorithm, prompt, params) in enumerate(requests):
        if params.greedy:
            check_against_reference(gemma, prompt, tokens[index], reference_greedy(gemma, prompt, params.max_new_tokens),
                                    ties)
        else:
            alone = engine.generate(prompt, params, speculation=speculation[index])
            assert tokens[index] == alone.token_ids
        assert finished[index].mean_batch_size > 1
    assert not ties, ties
    assert sum(stats.lookup_accepted_tokens for stats in finished.values()) > 0
    batched = engine.generate_batch(REPEATING_PROMPTS, [SamplingParams(max_new_tokens=12, temperature=0.9, seed=3)] * 2,
                                    speculation=speculation[1])
    assert [result.token_ids for result in batched] == [
        engine.generate(prompt, SamplingParams(max_new_tokens=12, temperature=0.9, seed=3),
                        speculation=speculation[1]).token_ids for prompt in REPEATING_PROMPTS]
    assert gemma.kv_pool.taken == set() and smollm.kv_pool.taken == set()


# --- the server's loop ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm, temperature", [("ar", 0.0), ("slem", 0.0), ("tli", 0.8)])
def test_served_decode_loop_with_lookup_equals_the_library(exit_stack, gemma, smollm, algorithm, temperature):
    """The Serve coordinator's loop on worker objects in this process: the lookup draft is made by the same
    library call (``Progress.lookup_draft``), its point-mass rows are built by the target worker, and the tokens
    are the library's (seed for seed: the same drafts, the same numbers)."""
    import asyncio

    from deployments.serving.request import GenerationRequest
    from serve_fixtures import in_process_coordinator

    coordinator = exit_stack.enter_context(
        in_process_coordinator(gemma, smollm, speculation={"algorithm": algorithm, **REAL_LOOKUP}))[0]
    prompt = REPEATING_PROMPTS[0]
    params = SamplingParams(max_new_tokens=24, temperature=temperature, seed=5, ignore_eos=True)
    library = Engine(gemma, smollm).generate(prompt, params, speculation=coordinator.config.speculation)
    request = GenerationRequest(prompt=prompt, params=params, pipelined=False)

    async def run():
        return [event async for event in coordinator.run(coordinator.prepare(request), "lookup")]

    events = asyncio.run(run())
    assert [token for event in events for token in event.token_ids] == library.token_ids
    stats = events[-1].stats
    assert stats.lookup_drafts == library.stats.lookup_drafts > 0
    assert stats.lookup_accepted_tokens == library.stats.lookup_accepted_tokens
