"""Logits to probabilities, and counter-based per-position randomness.

Every random number is a pure function of (seed, stream, position[, draft_round]). The target's numbers
(TARGET, ACCEPT, RESIDUAL) are keyed by output position alone, so the noise used for the token at output
position n does not depend on how many drafts came before it: that is what lets SLEM with seed s
reproduce the target alone with seed s token for token. Each of them is used at most once, since every
position is verified once.

The drafter's numbers (DRAFT) are keyed by position *and* the request's draft round (0 for its first
draft, +1 for every later one, speculative drafts included): after a rejection the next draft covers the
same positions again, and the drafter's context may by then depend on the rejected draft's tokens
(``DrafterContext.sync`` keeps drafted tokens that happen to spell the committed text). Reusing a number
whose outcome already shaped that context would draw the next candidate from something other than the
distribution used in the acceptance ratio (docs/losslessness.md, "Fresh drafter noise").
"""

from __future__ import annotations

from enum import IntEnum

import torch

_MASK64 = (1 << 64) - 1


class Stream(IntEnum):
    TARGET = 1  # the target's own choice at a position (ar, SLEM verification, bonus tokens)
    DRAFT = 2  # the drafter's sample
    ACCEPT = 3  # the accept/reject coin of rejection sampling
    RESIDUAL = 4  # the sample from the residual distribution after a rejection


def _splitmix64(state: int) -> int:
    state = (state + 0x9E3779B97F4A7C15) & _MASK64
    mixed = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    mixed = ((mixed ^ (mixed >> 27)) * 0x94D049BB133111EB) & _MASK64
    return mixed ^ (mixed >> 31)


def uniform(seed: int, stream: Stream, position: int, draft_round: int = 0) -> float:
    """A uniform number in [0, 1) determined by (seed, stream, position, draft_round) alone.

    ``draft_round`` is for the DRAFT stream; the target's streams leave it 0 (and then it is not mixed in).
    """
    state = _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ int(stream)) ^ position)
    if draft_round:
        state = _splitmix64(state ^ draft_round)
    return (state >> 11) * (1.0 / (1 << 53))


def accepts(coin: float, target_prob: float, draft_prob: float) -> bool:
    """Rejection sampling's test, coin < target_prob / draft_prob, written without the division so that
    0/0 rejects instead of giving NaN."""
    return coin * draft_prob < target_prob


def logits_to_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Sampling distribution after temperature, top-k and top-p.  logits: [..., vocab] -> probs [..., vocab]"""
    if temperature <= 0:
        raise ValueError("greedy decoding takes the argmax; it has no sampling distribution")
    scaled = logits.float() / temperature
    if top_k and top_k < scaled.shape[-1]:
        kth_largest = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth_largest, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        probs = _nucleus(probs, top_p, top_k)
    # SamplingParams' TEMPERATURE_FLOOR keeps logits / T finite; a NaN or inf here would sample a wrong token
    assert bool(torch.isfinite(probs).all()), "the sampling distribution is not finite"
    return probs


def _nucleus(probs: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p; the token crossing top_p stays.

    Sorting a 262k vocabulary costs more than the model's forward pass on CPU, so only the top_k (else 1024)
    most likely tokens are sorted; when they hold less than top_p of the mass the whole row is.
    """
    vocab_size = probs.shape[-1]
    count = min(vocab_size, top_k if top_k > 0 else 1024)
    sorted_probs, _ = torch.topk(probs, count, dim=-1)
    if count < vocab_size and bool((sorted_probs.sum(dim=-1) < top_p).any()):
        sorted_probs, _ = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    # Every token tied with the last one kept stays too (as in top-k), so the support never depends on
    # how sort or topk happened to order ties.
    threshold = sorted_probs.masked_fill(mass_before >= top_p, float("inf")).amin(dim=-1, keepdim=True)
    nucleus = probs.masked_fill(probs < threshold, 0.0)
    return nucleus / nucleus.sum(dim=-1, keepdim=True)


def sample_from(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF sample of one token.  probs: [vocab], need not be normalised."""
    cumulative = torch.cumsum(probs.double(), dim=0)
    index = int(torch.searchsorted(cumulative, u * float(cumulative[-1]), right=True))
    index = min(index, probs.shape[0] - 1)
    while probs[index] <= 0 and index > 0:  # u landed on the right edge of the mass: step back onto it
        index -= 1
    return index


def target_choice(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, seed: int, position: int) -> int:
    """The target's own token at output position ``position``.  logits: [vocab]

    Greedy is an exact argmax; sampling uses the TARGET stream at that position, the same number the
    target-only decoder would use there.
    """
    if temperature == 0.0:
        return int(torch.argmax(logits))
    probs = logits_to_probs(logits, temperature, top_k, top_p)
    return sample_from(probs, uniform(seed, Stream.TARGET, position))
