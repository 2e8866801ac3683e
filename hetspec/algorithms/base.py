"""What every algorithm shares: the drafter side, the vocabulary maps of a pair, and the Draft it hands over.

An algorithm is split into steps on plain data so the in-process engine and the Ray workers run the
same code (docs/design.md, "One algorithm, two runtimes"):
- ``draft``  (drafter side): sync the drafter to the committed text, then propose (fresh drafter noise per draft);
  a generator of drafter passes, so a batch of requests drafts with one pass per position;
- ``align``  (string level): turn the proposal into target token ids (SLEM only re-tokenizes);
- ``verify`` (target side): ``hetspec.verify.verify_candidates``;
- commit: the target rolls back to the accepted prefix (``TargetSide.commit``), the drafter at its next sync.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Generator, Sequence

import torch

from hetspec import vocab
from hetspec.align import DrafterContext
from hetspec.config import SamplingParams, SpeculationConfig
from hetspec.kv import Feed, KVSession
from hetspec.passes import Steps
from hetspec.lookup import point_mass_probs
from hetspec.models import LanguageModel
from hetspec.tree import TokenTree


@dataclass
class Draft:
    """One proposal: a chain of target ids (``candidates``) or a tree of them (``tree``); the one draft type,
    in process and between the server's processes.

    ``draft_probs`` is [rows, target_vocab] or None; candidate i's row is ``first_row + i`` (a speculative draft
    used without its first token skips a row). Between processes it is a stored reference
    (deployments/workers/model_workers.py). SLEM drafts strings and ``align`` turns them into target ids: ``text`` for a
    chain, ``texts`` (one per root-to-leaf branch) for a tree.
    """

    candidates: list[int] = field(default_factory=list)
    draft_probs: Any = None
    text: bytes = b""
    texts: list[bytes] = field(default_factory=list)
    tree: TokenTree | None = None
    drafter_forwards: int = 0
    first_row: int = 0
    source: str = "drafter"  # "drafter" (the drafter model) or "lookup" (the context lookup, hetspec/lookup.py)

    @property
    def point_mass(self) -> bool:
        """Each candidate was proposed with probability 1 (a lookup draft): no draft_probs travel, they are
        built where they are used (``candidate_probs``)."""
        return self.source == "lookup"

    def candidate_probs(self, vocab_size: int | None = None) -> torch.Tensor | None:
        """[len(candidates), target_vocab]: the rows the candidates were drawn from. ``vocab_size``: the target's
        logits width, for a point-mass draft's one-hot rows."""
        if self.point_mass:
            return point_mass_probs(self.candidates, vocab_size)
        if self.draft_probs is None:
            return None
        return self.draft_probs[self.first_row:self.first_row + len(self.candidates)]

    @property
    def proposed_len(self) -> int:
        """Target tokens the draft could add: the chain's length or the tree's depth."""
        return self.tree.max_depth if self.tree is not None else len(self.candidates)


class PairMaps:
    """Vocabulary relations of one (drafter, target) pair, computed once and shared by requests."""

    def __init__(self, drafter: LanguageModel, target: LanguageModel):
        self.drafter, self.target = drafter, target
        self.drafter_table = vocab.token_bytes(drafter.tokenizer)
        self.target_table = vocab.token_bytes(target.tokenizer)
        self.same_vocabulary = vocab.same_vocabulary(drafter.tokenizer, target.tokenizer)

    @cached_property
    def intersection(self) -> torch.Tensor:  # [drafter_vocab] target id or -1
        return vocab.intersection_map(self.drafter_table, self.target_table, self.drafter.vocab_size)

    @cached_property
    def intersection_inverse(self) -> torch.Tensor:  # [target_vocab] drafter id or -1
        return vocab.inverse_map(self.intersection, self.target.vocab_size)

    @cached_property
    def first_target_token(self) -> torch.Tensor:  # [drafter_vocab] target id or -1
        return vocab.first_target_token_map(self.drafter_table, self.target.tokenizer, self.drafter.vocab_size)

    def encode_target(self, text: str) -> list[int]:
        return self.target.encode(text)


class DrafterSide:
    """The drafter's KV session and token context for one request."""

    def __init__(self, drafter: LanguageModel, prompt_ids: list[int], window: int):
        self.model = drafter
        self.session: KVSession = drafter.new_session()
        self.context = DrafterContext(prompt_ids=list(prompt_ids), table=vocab.token_bytes(drafter.tokenizer),
                                      encode=drafter.encode, window=window)
        self.forwards = 0

    def sync(self, committed: bytes) -> None:
        kept = self.context.sync(committed)
        self.session.rollback(min(self.session.length, kept))

    def next_logits(self) -> Generator[Feed, torch.Tensor, torch.Tensor]:
        """Drafter logits after its whole context, from one pass (``yield from`` it).  -> [drafter_vocab]"""
        ids = self.context.ids
        if self.session.length >= len(ids):  # everything cached: re-feed the last token for its logits
            self.session.rollback(len(ids) - 1)
        self.forwards += 1
        logits = yield Feed(self.session, ids[self.session.length:], 1)
        return logits[0]

    def release(self) -> None:
        self.session.release()


class Algorithm:
    """Base class: no drafting (the target alone)."""

    name = "ar"
    exact = True  # verified by exact match (greedy or the target's seeded sample) rather than rejection sampling

    def __init__(self, maps: PairMaps | None, speculation: SpeculationConfig):
        self.maps = maps
        self.speculation = speculation

    @property
    def needs_drafter(self) -> bool:
        return False

    def draft(self, drafter: DrafterSide, committed: bytes, k: int, params: SamplingParams,
              first_position: int, draft_round: int) -> Steps:
        """Propose up to k target tokens for output positions first_position.. after ``committed``.

        A generator (``hetspec.passes.Steps``): it yields each drafter pass it needs and returns the Draft, so
        many requests draft in lockstep, one batched pass per draft position (``hetspec.passes.run_lockstep``).
        ``draft_round`` numbers this request's drafts (0, 1, ... speculative ones included): the drafter's
        random numbers are keyed by it and the position, so none is ever reused (``hetspec.sampling``)."""
        return Draft()
        yield  # a generator that needs no pass

    def align(self, draft: Draft, committed_target_ids: Sequence[int]) -> Draft:
        return draft

    def _stop_early(self, drafter_probs_max: float, drafted: int) -> bool:
        threshold = self.speculation.confidence_threshold
        return drafted > 0 and threshold > 0 and drafter_probs_max < threshold
