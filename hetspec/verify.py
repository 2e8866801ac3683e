"""Acceptance rules on plain tensors.

Terms, used the same way everywhere:
- *candidates*: the k target token ids proposed for output positions n .. n+k-1.
- *accepted*: the leading candidates the rule keeps (``accepted_len`` of them).
- *recovered*: after a rejection at candidate i, the token the rule puts at position n+i instead.
- *bonus*: after all k are accepted, the target's own token at position n+k.
Every rule returns ``(accepted_len, next_token)``; ``next_token`` is the recovered or bonus token, so
each target pass commits ``accepted_len + 1`` tokens.
"""

from __future__ import annotations

import torch

from hetspec.sampling import Stream, accepts, logits_to_probs, sample_from, target_choice, uniform
from hetspec.tree import TokenTree, walk


def exact_match(candidates: list[int], target_choices: list[int]) -> tuple[int, int]:
    """SLEM verification (Timor et al. 2025, Alg. 2) and greedy verification of every algorithm.

    ``target_choices[i]`` is the target's own token at position n+i (argmax, or its seeded sample),
    so ``len(target_choices) == len(candidates) + 1``. The longest prefix on which the candidates
    equal the target's choices is accepted; the target's choice after it is the next token.
    """
    assert len(target_choices) == len(candidates) + 1
    accepted_len = 0
    while accepted_len < len(candidates) and candidates[accepted_len] == target_choices[accepted_len]:
        accepted_len += 1
    return accepted_len, target_choices[accepted_len]


def target_choices(target_logits: torch.Tensor, temperature: float, top_k: int, top_p: float, seed: int,
                   first_position: int) -> list[int]:
    """The target's own token at each row's position.  target_logits: [k+1, vocab]"""
    if temperature == 0.0:
        return target_logits.argmax(dim=-1).tolist()
    return [target_choice(row, temperature, top_k, top_p, seed, first_position + offset)
            for offset, row in enumerate(target_logits)]


def residual_probs(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(0, target_probs - draft_probs)).  both: [vocab] -> [vocab]"""
    residual = torch.clamp(target_probs - draft_probs, min=0.0)
    total = residual.sum()
    if total <= 0:  # the two distributions are equal: a rejection had probability 0, fall back to the target
        return target_probs
    return residual / total


def speculative_sampling(candidates: list[int], draft_probs: torch.Tensor, target_probs: torch.Tensor, seed: int,
                         first_position: int) -> tuple[int, int]:
    """Standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023), used by SD, TLI and SLRS.

    candidates: k target ids; draft_probs: [k, vocab] the distribution each candidate was drawn from
    (for TLI the drafter restricted to the intersection, for SLRS psi); target_probs: [k+1, vocab].
    Candidate i is accepted with probability min(1, target_prob / draft_prob); at the first rejection the
    recovered token is drawn from norm(max(0, target_probs - draft_probs)); if all pass, the bonus token
    is the target's own sample at position n+k.
    """
    k = len(candidates)
    assert draft_probs.shape[0] == k and target_probs.shape[0] == k + 1
    if k:
        index = torch.arange(k)
        candidate_ids = torch.tensor(candidates)
        candidate_target_probs = target_probs[index, candidate_ids].tolist()
        candidate_draft_probs = draft_probs[index, candidate_ids].tolist()
    for i in range(k):
        coin = uniform(seed, Stream.ACCEPT, first_position + i)
        if not accepts(coin, candidate_target_probs[i], candidate_draft_probs[i]):
            recovered = residual_probs(target_probs[i], draft_probs[i])
            return i, sample_from(recovered, uniform(seed, Stream.RESIDUAL, first_position + i))
    return k, sample_from(target_probs[k], uniform(seed, Stream.TARGET, first_position + k))


def verify_candidates(candidates: list[int], draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
                      temperature: float, top_k: int, top_p: float, seed: int, first_position: int,
                      exact: bool) -> tuple[int, int]:
    """Dispatch: exact match for greedy and for SLEM, speculative sampling otherwise.

    target_logits: [k+1, vocab]; draft_probs: [k, vocab] on the target vocabulary, or None when exact.
    """
    if exact or temperature == 0.0 or not candidates:  # no candidates: the target's own sample, as k=0 SD
        return exact_match(candidates, target_choices(target_logits, temperature, top_k, top_p, seed,
                                                      first_position))
    assert draft_probs is not None, "speculative sampling needs the draft distributions"
    target_probs = logits_to_probs(target_logits, temperature, top_k, top_p)
    return speculative_sampling(candidates, draft_probs, target_probs, seed, first_position)


def verify_tree(tree: TokenTree, target_logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                seed: int, first_position: int) -> tuple[list[int], int]:
    """Exact match down a token tree (Timor et al. 2025, Alg. 2, one branch at a time; ``hetspec.tree.walk``).

    target_logits: [1 + nodes, vocab], row 0 after the committed text, row 1 + i after node i. Returns (the
    accepted nodes, root to leaf; the target's own token after them).
    """
    greedy_choices = target_logits.argmax(dim=-1).tolist() if temperature == 0.0 else None

    def choice_at(node: int, depth: int) -> int:
        row = node + 1
        if greedy_choices is not None:
            return greedy_choices[row]
        return target_choice(target_logits[row], temperature, top_k, top_p, seed, first_position + depth)

    return walk(tree.children(), choice_at)
