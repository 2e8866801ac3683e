"""The acceptance rules (hetspec.verify) and the sampling primitives under them (hetspec.sampling).

Four kinds of test: hand-built exact cases, seeded determinism, distributions
(chi-square with fixed seeds, so never flaky), and a slow reference implementation of speculative
sampling in plain Python floats checked against the fast path on random inputs.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from synthetic import chi_square_pvalue
from hetspec.sampling import Stream, logits_to_probs, sample_from, target_choice, uniform
from hetspec.verify import (exact_match, residual_probs, speculative_sampling, target_choices,
                            verify_candidates)

P_THRESHOLD = 1e-3  # seeds are fixed: a test either always passes or always fails


def probs_tensor(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


# --- exact_match -------------------------------------------------------------------------------------

@pytest.mark.parametrize("candidates, choices, expected", [
    ([5, 6, 7], [5, 6, 7, 8], (3, 8)),  # all accepted: the target's choice after them is the bonus
    ([5, 6, 7], [4, 6, 7, 8], (0, 4)),  # first rejected: the target's own token replaces it
    ([5, 6, 7], [5, 6, 1, 2], (2, 1)),  # middle rejection
    ([5, 6, 7], [5, 0, 7, 2], (1, 0)),  # a later match after a mismatch does not count
    ([], [3], (0, 3)),  # no candidates: one token, the target's
])
def test_exact_match(candidates, choices, expected):
    assert exact_match(candidates, choices) == expected


def test_target_choices_greedy_is_argmax_and_sampling_uses_the_target_stream():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])
    assert target_choices(logits, 0.0, 0, 1.0, seed=9, first_position=4) == [1, 0]
    sampled = target_choices(logits, 1.0, 0, 1.0, seed=9, first_position=4)
    assert sampled == [sample_from(torch.softmax(row, -1), uniform(9, Stream.TARGET, 4 + offset))
                       for offset, row in enumerate(logits)]


# --- residual_probs ----------------------------------------------------------------------------------

def test_residual_is_the_normalised_positive_part():
    target_probs, draft_probs = probs_tensor([0.5, 0.3, 0.2, 0.0], [0.2, 0.5, 0.1, 0.2])
    assert torch.allclose(residual_probs(target_probs, draft_probs), torch.tensor([0.75, 0.0, 0.25, 0.0]))


def test_residual_covers_target_mass_the_drafter_cannot_propose():
    target_probs, draft_probs = probs_tensor([0.25, 0.25, 0.5], [1.0, 0.0, 0.0])
    assert torch.allclose(residual_probs(target_probs, draft_probs), torch.tensor([0.0, 1 / 3, 2 / 3]))


def test_residual_of_equal_distributions_falls_back_to_the_target():
    target_probs = torch.tensor([0.5, 0.5, 0.0])
    assert torch.equal(residual_probs(target_probs, target_probs.clone()), target_probs)


# --- speculative_sampling: exact cases -----------------------------------------------------------------

def test_draft_equal_to_target_accepts_everything_for_every_seed():
    target_probs = probs_tensor([0.1, 0.6, 0.3], [0.5, 0.25, 0.25], [0.0, 0.2, 0.8], [0.3, 0.3, 0.4])
    candidates = [1, 2, 2]
    for seed in range(300):
        bonus = sample_from(target_probs[3], uniform(seed, Stream.TARGET, 7 + 3))
        assert speculative_sampling(candidates, target_probs[:3].clone(), target_probs, seed, 7) == (3, bonus)


def test_candidate_the_target_excludes_is_always_rejected_and_never_recovered():
    draft_probs = probs_tensor([0.5, 0.5, 0.0], [0.2, 0.3, 0.5])
    target_probs = probs_tensor([0.5, 0.5, 0.0], [0.6, 0.4, 0.0], [1 / 3, 1 / 3, 1 / 3])
    for seed in range(300):
        # candidate 0 has ratio 1 (always accepted); candidate 1 is token 2, which the target never makes
        accepted_len, recovered = speculative_sampling([0, 2], draft_probs, target_probs, seed, 0)
        assert accepted_len == 1 and recovered != 2


def test_rejection_recovers_from_the_residual_with_the_residual_stream():
    draft_probs = probs_tensor([1.0, 0.0, 0.0])
    target_probs = probs_tensor([0.25, 0.25, 0.5], [0.1, 0.2, 0.7])
    outcomes = set()
    for seed in range(300):
        # accepted with probability 0.25; else from norm(max(0, target - draft)) = [0, 1/3, 2/3]
        if uniform(seed, Stream.ACCEPT, 5) < 0.25:
            expected = (1, sample_from(target_probs[1], uniform(seed, Stream.TARGET, 6)))
        else:
            expected = (0, 1 if uniform(seed, Stream.RESIDUAL, 5) < 1 / 3 else 2)
        assert speculative_sampling([0], draft_probs, target_probs, seed, 5) == expected
        outcomes.add(expected[0])
    assert outcomes == {0, 1}


def test_no_candidates_gives_the_targets_own_sample():
    target_probs = probs_tensor([0.2, 0.3, 0.5])
    for seed in range(20):
        expected = sample_from(target_probs[0], uniform(seed, Stream.TARGET, 3))
        assert speculative_sampling([], torch.zeros(0, 3), target_probs, seed, 3) == (0, expected)


# --- verify_candidates ---------------------------------------------------------------------------------

def test_verify_candidates_dispatches_exact_greedy_and_sampling():
    target_logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    draft_probs = probs_tensor([0.2, 0.5, 0.3], [0.6, 0.2, 0.2])
    assert verify_candidates([1, 0], None, target_logits, 0.0, 0, 1.0, 0, 0, exact=False) == (2, 2)
    assert verify_candidates([1, 2], None, target_logits, 0.0, 0, 1.0, 0, 0, exact=True) == (1, 0)
    for seed in range(20):
        choices = target_choices(target_logits, 0.7, 2, 0.9, seed, 4)
        assert verify_candidates([1, 0], None, target_logits, 0.7, 2, 0.9, seed, 4, exact=True) == \
            exact_match([1, 0], choices)
        target_probs = logits_to_probs(target_logits, 0.7, 2, 0.9)
        assert verify_candidates([1, 0], draft_probs, target_logits, 0.7, 2, 0.9, seed, 4, exact=False) == \
            speculative_sampling([1, 0], draft_probs, target_probs, seed, 4)


def test_verify_candidates_with_no_candidates_when_sampling():
    """The engine sends an empty draft when one token is left or the committed text ends inside a UTF-8
    character; rejection-sampling algorithms then have no draft_probs (None), and the target decides alone."""
    target_logits = torch.tensor([[0.0, 2.0, 1.0]])
    for seed in range(5):
        expected = target_choice(target_logits[0], 1.0, 0, 1.0, seed, 2)
        assert verify_candidates([], None, target_logits, 1.0, 0, 1.0, seed, 2, exact=False) == (0, expected)


# --- logits_to_probs -----------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature, expected", [
    (1.0, [0.25, 0.75]),
    (0.5, [0.1, 0.9]),  # logits doubled: 1 : 9
    (2.0, [1 / (1 + math.sqrt(3)), math.sqrt(3) / (1 + math.sqrt(3))]),
])
def test_temperature(temperature, expected):
    logits = torch.tensor([0.0, math.log(3.0)])
    assert torch.allclose(logits_to_probs(logits, temperature), torch.tensor(expected), atol=1e-6)


def test_greedy_has_no_sampling_distribution():
    with pytest.raises(ValueError, match="argmax"):
        logits_to_probs(torch.zeros(3), 0.0)


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([3.0, 1.0, 2.0, 0.0])
    kept = torch.softmax(torch.tensor([3.0, 2.0]), -1)
    assert torch.allclose(logits_to_probs(logits, 1.0, top_k=2), torch.tensor([kept[0], 0.0, kept[1], 0.0]))
    assert torch.allclose(logits_to_probs(logits, 1.0, top_k=4), torch.softmax(logits, -1))
    assert torch.allclose(logits_to_probs(logits, 1.0, top_k=0), torch.softmax(logits, -1))


def test_top_k_keeps_every_token_tied_with_the_kth():
    probs = logits_to_probs(torch.tensor([2.0, 1.0, 1.0, 0.0]), 1.0, top_k=2)
    assert torch.nonzero(probs).flatten().tolist() == [0, 1, 2]


@pytest.mark.parametrize("top_p, expected", [
    (0.4, [1.0, 0.0, 0.0, 0.0]),  # the token that crosses top_p stays, nothing after it
    (0.7, [0.625, 0.375, 0.0, 0.0]),
    (0.9, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
    (1.0, [0.5, 0.3, 0.15, 0.05]),
])
def test_top_p(top_p, expected):
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert torch.allclose(logits_to_probs(logits, 1.0, top_p=top_p), torch.tensor(expected), atol=1e-6)


def test_top_p_applies_after_top_k_and_temperature():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log() * 0.5  # temperature 0.5 restores these probs
    # top_k=3 renormalises to [0.5, 0.3, 0.15] / 0.95; top_p=0.8 then needs the first two (0.526 + 0.316)
    assert torch.allclose(logits_to_probs(logits, 0.5, top_k=3, top_p=0.8), torch.tensor([0.625, 0.375, 0.0, 0.0]),
                          atol=1e-6)


@pytest.mark.parametrize("vocab_size", [17, 5000])
def test_top_p_keeps_every_token_tied_with_the_one_crossing_it(vocab_size):
    """Token 0 has 0.4, the others tie; top_p needs 2.5 of the tied tokens, so all of them stay (as with top_k).

    Keeping only some would make the support depend on the order torch.sort / torch.topk give equal
    values, which differs between a row alone (ar, SLEM), the same row in a [k+1, vocab] batch (SD/TLI
    verification), top_k=0 versus top_k=vocab, and CPU versus GPU workers.
    """
    tied_prob = 0.6 / (vocab_size - 1)
    logits = torch.tensor([0.4] + [tied_prob] * (vocab_size - 1)).log()
    top_p = 0.4 + 2.5 * tied_prob
    alone = logits_to_probs(logits, 1.0, top_p=top_p)
    assert torch.allclose(alone, torch.softmax(logits, -1))
    assert torch.equal(logits_to_probs(torch.stack([logits.roll(1), logits]), 1.0, top_p=top_p)[1], alone)
    assert torch.equal(logits_to_probs(logits, 1.0, top_k=vocab_size, top_p=top_p), alone)


def test_rows_are_independent_distributions():
    logits = torch.randn(4, 7, generator=torch.Generator().manual_seed(0))
    probs = logits_to_probs(logits, 0.8, top_k=5, top_p=0.9)
    assert torch.allclose(probs.sum(-1), torch.ones(4))
    for row, row_probs in zip(logits, probs):
        assert torch.allclose(logits_to_probs(row, 0.8, top_k=5, top_p=0.9), row_probs)


# --- sample_from ---------------------------------------------------------------------------------------

ALMOST_ONE = 1.0 - 2.0 ** -53  # the largest value uniform() returns


@pytest.mark.parametrize("probs, u, expected", [
    ([0.0, 0.5, 0.5], 0.0, 1),  # u = 0 lands on the first token with mass, not on a leading zero
    ([0.5, 0.5, 0.0], ALMOST_ONE, 1),  # the top of the range lands on the last token with mass
    ([0.5, 0.0, 0.0], ALMOST_ONE, 0),
    ([0.25, 0.75], 0.2499, 0),
    ([0.25, 0.75], 0.25, 1),  # each token owns [cdf before, cdf after)
    ([1.0, 3.0], 0.24, 0),  # probabilities need not be normalised
    ([1.0, 3.0], 0.26, 1),
    ([0.25, 0.0, 0.75], 0.25, 2),  # the zero in the middle owns an empty interval
])
def test_sample_from_inverse_cdf(probs, u, expected):
    assert sample_from(torch.tensor(probs), u) == expected


def test_sample_from_never_returns_a_zero_probability_token():
    probs = torch.tensor([0.0, 0.2, 0.0, 0.0, 0.5, 0.3, 0.0])
    counts = [0] * 7
    for step in range(10000):
        counts[sample_from(probs, step / 10000)] += 1
    assert counts == [0, 2000, 0, 0, 5000, 3000, 0]


# --- uniform -------------------------------------------------------------------------------------------

def test_uniform_range_and_determinism():
    values = [uniform(seed, stream, position) for seed in (0, 1, 2**63 - 1) for stream in Stream
              for position in range(200)]
    assert all(0.0 <= value < 1.0 for value in values)
    assert values == [uniform(seed, stream, position) for seed in (0, 1, 2**63 - 1) for stream in Stream
                      for position in range(200)]
    assert len(set(values)) == len(values)  # different seeds, streams and positions never repeat here


def test_uniform_is_uniform_and_streams_are_uncorrelated():
    accept = [uniform(3, Stream.ACCEPT, position) for position in range(20000)]
    residual = [uniform(3, Stream.RESIDUAL, position) for position in range(20000)]
    by_seed = [uniform(seed, Stream.TARGET, 0) for seed in range(20000)]
    assert stats.kstest(accept, "uniform").pvalue > P_THRESHOLD
    assert stats.kstest(by_seed, "uniform").pvalue > P_THRESHOLD
    assert abs(stats.pearsonr(accept, residual).statistic) < 0.03


# --- seeded determinism --------------------------------------------------------------------------------

DRAFT_PROBS = probs_tensor([0.5, 0.3, 0.2], [0.2, 0.2, 0.6])
TARGET_PROBS = probs_tensor([0.2, 0.5, 0.3], [0.3, 0.4, 0.3], [0.6, 0.3, 0.1])


def test_same_seed_and_positions_give_the_same_result():
    for seed in range(50):
        first = speculative_sampling([0, 2], DRAFT_PROBS, TARGET_PROBS, seed, 11)
        assert speculative_sampling([0, 2], DRAFT_PROBS.clone(), TARGET_PROBS.clone(), seed, 11) == first


def test_different_seeds_or_positions_give_different_results():
    by_seed = {speculative_sampling([0, 2], DRAFT_PROBS, TARGET_PROBS, seed, 11) for seed in range(50)}
    by_position = {speculative_sampling([0, 2], DRAFT_PROBS, TARGET_PROBS, 1, position) for position in range(50)}
    assert len(by_seed) >= 4 and len(by_position) >= 4


# --- a slow reference implementation -------------------------------------------------------------------

def reference_inverse_cdf(weights: list[float], u: float) -> int:
    total = sum(weights)
    cumulative = 0.0
    for token, weight in enumerate(weights):
        cumulative += weight
        if u * total < cumulative:
            return token
    return max(token for token, weight in enumerate(weights) if weight > 0)


def reference_speculative_sampling(candidates: list[int], draft_rows: list[list[float]],
                                   target_rows: list[list[float]], seed: int, first_position: int) -> tuple[int, int]:
    """Leviathan et al. 2023, Alg. 1, one candidate at a time in plain floats."""
    for i, candidate in enumerate(candidates):
        target_prob, draft_prob = target_rows[i][candidate], draft_rows[i][candidate]
        if uniform(seed, Stream.ACCEPT, first_position + i) < min(1.0, target_prob / draft_prob):
            continue
        residual = [max(0.0, target - draft) for target, draft in zip(target_rows[i], draft_rows[i])]
        if sum(residual) <= 0:
            residual = target_rows[i]
        return i, reference_inverse_cdf(residual, uniform(seed, Stream.RESIDUAL, first_position + i))
    last = len(candidates)
    return last, reference_inverse_cdf(target_rows[last], uniform(seed, Stream.TARGET, first_position + last))


def distribution_rows(vocab_size: int, rows: int) -> st.SearchStrategy[torch.Tensor]:
    """Random float32 distributions with zeros, each row with some mass."""
    weight = st.one_of(st.just(0.0), st.floats(0.01, 1.0))
    row = st.lists(weight, min_size=vocab_size, max_size=vocab_size).filter(lambda values: sum(values) > 0)
    return st.lists(row, min_size=rows, max_size=rows).map(normalised_rows)


def normalised_rows(values: list[list[float]]) -> torch.Tensor:
    rows = torch.tensor(values, dtype=torch.float32)
    return rows / rows.sum(-1, keepdim=True)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(data=st.data(), vocab_size=st.integers(2, 6), k=st.integers(0, 4), seed=st.integers(0, 2**63 - 1),
       first_position=st.integers(0, 10**6))
def test_fast_path_matches_the_reference(data, vocab_size, k, seed, first_position):
    draft_probs = data.draw(distribution_rows(vocab_size, k))
    target_probs = data.draw(distribution_rows(vocab_size, k + 1))
    # candidates are drawn from the draft distribution, so each has draft probability > 0
    candidates = [data.draw(st.sampled_from(torch.nonzero(row).flatten().tolist())) for row in draft_probs]
    expected = reference_speculative_sampling(candidates, draft_probs.tolist(), target_probs.tolist(), seed,
                                              first_position)
    assert speculative_sampling(candidates, draft_probs.reshape(k, vocab_size), target_probs, seed,
                                first_position) == expected


# --- distributions -------------------------------------------------------------------------------------

def fixed_rows(rows: int, vocab_size: int, seed: int) -> torch.Tensor:
    """Random peaked distributions, some entries exactly 0 (so supports differ).  -> [rows, vocab_size]"""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab_size, generator=generator) * 1.5
    logits[torch.rand(rows, vocab_size, generator=generator) < 0.2] = float("-inf")
    logits[:, 0] = logits[:, 0].clamp(min=-3.0)  # every row keeps some mass
    return torch.softmax(logits, -1)


def draft_like_an_algorithm(draft_probs: torch.Tensor, seed: int, first_position: int) -> list[int]:
    """Candidate i drawn from its row with the DRAFT stream at its output position, as TLI does."""
    return [sample_from(row, uniform(seed, Stream.DRAFT, first_position + i)) for i, row in enumerate(draft_probs)]


@pytest.mark.parametrize("k", [2, 3])
def test_first_committed_token_follows_the_target(k):
    draft_probs, target_probs = fixed_rows(k, 6, seed=k), fixed_rows(k + 1, 6, seed=10 + k)
    committed_first = []
    for seed in range(8000):
        candidates = draft_like_an_algorithm(draft_probs, seed, 0)
        accepted_len, next_token = speculative_sampling(candidates, draft_probs, target_probs, seed, 0)
        committed_first.append(((candidates[:accepted_len] + [next_token])[0],))
    expected = {(token,): float(prob) for token, prob in enumerate(target_probs[0].double()) if prob > 0}
    assert chi_square_pvalue(committed_first, expected) > P_THRESHOLD


def speculative_decode_bigram(target_table: torch.Tensor, draft_table: torch.Tensor, length: int, k: int,
                              seed: int) -> tuple[int, ...]:
    """The whole decode loop on bigram 'models' (row = previous token, token 0 starts): draft k, verify,
    commit, repeat, with the streams and positions an algorithm uses.  tables: [vocab, vocab]"""
    committed = [0]
    while len(committed) - 1 < length:
        first_position = len(committed) - 1
        candidates: list[int] = []
        for step in range(k):
            row = draft_table[(committed + candidates)[-1]]
            candidates.append(sample_from(row, uniform(seed, Stream.DRAFT, first_position + step)))
        contexts = (committed + candidates)[len(committed) - 1:]  # the token before each position
        draft_probs, target_probs = draft_table[contexts[:k]], target_table[contexts]
        accepted_len, next_token = speculative_sampling(candidates, draft_probs, target_probs, seed, first_position)
        committed += candidates[:accepted_len] + [next_token]
    return tuple(committed[1:length + 1])


def test_decode_loop_follows_the_target_chain():
    """Position n's distribution depends on the token before it, so this checks the joint of 3 tokens
    over whole draft / verify / commit rounds, rejections at any position included."""
    vocab_size = 4
    target_table, draft_table = fixed_rows(vocab_size, vocab_size, seed=21), fixed_rows(vocab_size, vocab_size, seed=22)
    samples = [speculative_decode_bigram(target_table, draft_table, length=3, k=2, seed=seed) for seed in range(6000)]
    expected = {}
    for first in range(vocab_size):
        for second in range(vocab_size):
            for third in range(vocab_size):
                prob = float(target_table[0, first]) * float(target_table[first, second]) * \
                    float(target_table[second, third])
                if prob > 0:
                    expected[(first, second, third)] = prob
    assert chi_square_pvalue(samples, expected) > P_THRESHOLD
