"""SLRS: string-level rejection sampling (Timor et al. 2025, Alg. 3).

Stopping rule: the drafter samples ``L = slrs_lookahead`` tokens d1..dL autoregressively from its
distribution (after temperature/top-k/top-p, masked to tokens that stand for text); the candidate is the
first target token of encode_target(s(d1) + ... + s(dL)). psi(t), the probability of proposing t, is the
total probability of the drafter sequences whose candidate is t. Sequences whose string is not valid
UTF-8 or encodes to nothing are excluded and the rest renormalised, so psi is exactly what candidates are
drawn from. Verification is speculative sampling against psi (accept min(1, target/psi), residual
max(0, target - psi)), lossless because psi is exact: never approximated.

- L = 1: psi is the scatter-add of the drafter distribution over {d : t(d) = t} (``first_target_token``).
- L > 1: psi is enumerated over all V^L drafter sequences, one batched drafter pass per level on a copy
  of the KV cache; refused (``EnumerationBudgetExceeded``) when V^L exceeds ``slrs_enumeration_budget``.
"""

from __future__ import annotations

import weakref

import torch

from hetspec.algorithms.base import Draft, DrafterSide, PairMaps
from hetspec.passes import Steps
from hetspec.algorithms.tli import TokenLevelIntersection
from hetspec.align import ends_at_character
from hetspec.config import SamplingParams
from hetspec.sampling import Stream, logits_to_probs, sample_from, uniform


class EnumerationBudgetExceeded(ValueError):
    """Exact psi would need more drafter sequences than the configured budget."""


class StringLevelRejectionSampling(TokenLevelIntersection):
    name = "slrs"

    def __init__(self, maps, speculation):
        super().__init__(maps, speculation)
        self.lookahead = speculation.slrs_lookahead
        if self.lookahead > 1 and maps is not None:
            sequences = maps.drafter.vocab_size ** self.lookahead
            if sequences > speculation.slrs_enumeration_budget:
                raise EnumerationBudgetExceeded(
                    f"SLRS with slrs_lookahead={self.lookahead} must enumerate "
                    f"{maps.drafter.vocab_size}^{self.lookahead} = {sequences:,} drafter sequences "
                    f"to compute psi exactly, above slrs_enumeration_budget={speculation.slrs_enumeration_budget:,}; "
                    "use slrs_lookahead=1 or a drafter with a smaller vocabulary")

    def drafter_to_target(self) -> torch.Tensor:
        return self.maps.first_target_token

    def feed(self, drafter: DrafterSide, committed: bytes, target_id: int) -> bool:
        drafter_id = int(self.maps.intersection_inverse[target_id])
        if drafter_id >= 0:
            drafter.context.push(drafter_id)
            return True
        if not ends_at_character(committed):
            return False  # the candidate ends inside a character: the drafter cannot continue from it
        drafter.sync(committed)  # t is a prefix of the drafted string: re-tokenize that text
        return True

    def draft(self, drafter: DrafterSide, committed: bytes, k: int, params: SamplingParams,
              first_position: int, draft_round: int) -> Steps:
        """Alg. 3's proposal, one candidate per step: t ~ psi, then the drafter continues from t's text."""
        if self.lookahead == 1:
            return (yield from super().draft(drafter, committed, k, params, first_position, draft_round))
        drafter.sync(committed)
        forwards_before = drafter.forwards
        candidates: list[int] = []
        rows: list[torch.Tensor] = []
        text = committed
        for step in range(k):
            psi = yield from lookahead_psi(drafter, self.maps, self.lookahead, params)
            if psi is None:
                break  # every drafter sequence was excluded: nothing to propose
            if params.greedy:
                target_id = int(torch.argmax(psi))
            else:
                target_id = sample_from(psi, uniform(params.seed, Stream.DRAFT, first_position + step, draft_round))
            if self._stop_early(float(psi.max()), step):
                break
            candidates.append(target_id)
            rows.append(psi)
            spelling = self.maps.target_table[target_id]
            if spelling is None:  # a special token (no bytes): the target decides; nothing follows it
                break
            text += spelling
            if step + 1 < k and not self.feed(drafter, text, target_id):
                break
        draft_probs = torch.stack(rows) if rows and not params.greedy else None
        return Draft(candidates=candidates, draft_probs=draft_probs,
                     drafter_forwards=drafter.forwards - forwards_before)


def lookahead_psi(drafter: DrafterSide, maps: PairMaps, lookahead: int, params: SamplingParams) -> Steps:
    """Exact psi after the drafter's context: [target_vocab], sums to 1; None when no sequence is valid.
    A generator of drafter passes (the first level is a pass of the batch; the others branch this row alone).

    Greedy has no sampling distribution; its psi uses the drafter's plain softmax and only its argmax is used.
    """
    candidates = sequence_candidates(maps, lookahead)  # [V^L]
    valid = candidates >= 0
    probs = (yield from sequence_probs(drafter, lookahead, params))[valid]
    total = probs.sum()
    if total <= 0:
        return None
    return torch.zeros(maps.target.vocab_size).index_add_(0, candidates[valid], probs) / total


@torch.inference_mode()
def sequence_probs(drafter: DrafterSide, lookahead: int, params: SamplingParams) -> Steps:
    """Probability of every drafter sequence d1..dL after the context.  -> [V^L], index d1*V^(L-1) + ... + dL

    Level by level: every prefix with nonzero probability is extended by one batched pass over a copy of
    the cached context (prefixes of probability 0 contribute nothing, so skipping them is exact).
    """
    model = drafter.model
    has_text = _has_text(drafter)
    vocab_size = model.vocab_size
    probs = _step_probs((yield from drafter.next_logits()), has_text, params)  # [V]
    prefixes = torch.arange(vocab_size).unsqueeze(1)  # [V, 1]
    for _ in range(lookahead - 1):
        live = probs > 0
        cache = drafter.session.copy_to_dynamic_cache()
        cache.batch_repeat_interleave(int(live.sum()))
        output = model.model(input_ids=prefixes[live].to(model.device), cache=cache, use_cache=True,
                             logits_to_keep=1)
        drafter.forwards += 1
        next_probs = torch.zeros(len(probs), vocab_size)  # [prefixes, V]
        next_probs[live] = _step_probs(output.logits[:, -1].float().cpu(), has_text, params)
        probs = (probs.unsqueeze(1) * next_probs).flatten()
        prefixes = torch.cat([prefixes.repeat_interleave(vocab_size, 0),
                              torch.arange(vocab_size).repeat(len(prefixes)).unsqueeze(1)], dim=1)
    return probs


def _step_probs(logits: torch.Tensor, has_text: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One drafter step's distribution.  logits: [..., V] -> [..., V]"""
    logits = logits.masked_fill(~has_text, float("-inf"))
    if params.greedy:
        return torch.softmax(logits, dim=-1)
    return logits_to_probs(logits, params.temperature, params.top_k, params.top_p)


def _has_text(drafter: DrafterSide) -> torch.Tensor:  # [V] bool: the token stands for some bytes
    table = drafter.context.table
    return torch.tensor([index < len(table) and bool(table[index]) for index in range(drafter.model.vocab_size)])


_CANDIDATES: weakref.WeakKeyDictionary[PairMaps, dict[int, torch.Tensor]] = weakref.WeakKeyDictionary()


def sequence_candidates(maps: PairMaps, lookahead: int) -> torch.Tensor:
    """Candidate of every drafter sequence, or -1 where it is excluded.  -> [V^L], indexed as ``sequence_probs``

    The candidate does not depend on the context, so it is computed once per pair and lookahead.
    """
    per_pair = _CANDIDATES.setdefault(maps, {})
    if lookahead not in per_pair:
        vocab_size = maps.drafter.vocab_size
        # a token without text has probability 0 at every step, so the candidate of its sequences never counts
        pieces = [piece or b"" for piece in maps.drafter_table] + [b""] * (vocab_size - len(maps.drafter_table))
        strings: list[bytes] = [b""]
        for _ in range(lookahead):
            strings = [prefix + piece for prefix in strings for piece in pieces]
        candidates = torch.full((len(strings),), -1, dtype=torch.long)
        indices, texts = [], []
        for index, data in enumerate(strings):
            try:
                texts.append(data.decode("utf-8"))
                indices.append(index)
            except UnicodeDecodeError:
                continue
        encoded = maps.target.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        for index, target_ids in zip(indices, encoded):
            if target_ids:
                candidates[index] = target_ids[0]
        per_pair[lookahead] = candidates
    return per_pair[lookahead]
