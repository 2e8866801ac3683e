"""One request's part of the decode step, every algorithm: its progress between steps (``Progress``: draft
length, context lookup, commit), its target side (``TargetSide``: KV session, verification) and, in this process,
both together with its drafter side (``Request``). The step over a batch of them is hetspec/step.py; the server's
workers run ``Request``'s parts too (deployments/).

Every request's random numbers are keyed by its own seed and output position (``hetspec.sampling``), and
its verification reads only its own row's logits, so batching changes which requests share a pass, never a
request's rule or its numbers. Batched matrix products may round differently from batch 1; docs/batching.md
says how the tests tell such a numerical tie from an error.
"""

from __future__ import annotations

import time
from itertools import islice
from typing import Sequence

import torch

from hetspec.ahead import Ahead, DraftOrder, continuing
from hetspec.algorithms import Draft, DrafterSide, PairMaps, make_algorithm
from hetspec.align import ends_at_character
from hetspec.config import SamplingParams, SpeculationConfig
from hetspec.kv import Feed
from hetspec.passes import Steps
from hetspec.prefill import prefill
from hetspec.lookup import ContextLookup, prompt_text
from hetspec.models import LanguageModel
from hetspec.output import DraftLength, OutputText, Stats, StreamEvent, TokenLogprob, token_logprobs
from hetspec.tree import TokenTree, chain_then_tree
from hetspec.verify import verify_candidates, verify_tree


class TargetSide:
    """The target's KV session and the committed tokens of one request.

    Invariant between steps: the cache holds every committed id but the last one, which is fed again
    with the next candidates so that one pass yields the logits of all k+1 positions.
    """

    def __init__(self, target: LanguageModel, prompt_ids: Sequence[int]):
        self.model = target
        self.session = target.new_session()
        self.ids = list(prompt_ids)
        self.prompt_len = len(self.ids)
        self.forwards = 0
        self.step_logprobs: list[TokenLogprob] | None = None  # of the ids the last verify committed (params.logprobs)

    @property
    def generated_ids(self) -> list[int]:
        return self.ids[self.prompt_len:]

    def verify(self, algorithm, draft: Draft, params: SamplingParams) -> Steps:
        """One target pass over the draft, then the acceptance rule; returns the committed ids."""
        first_position = len(self.ids) - self.prompt_len
        self.forwards += 1
        if draft.tree is not None:
            return (yield from self._verify_tree(draft.tree, params, first_position))
        logits = yield Feed(self.session, self.ids[self.session.length:] + draft.candidates,
                            len(draft.candidates) + 1)  # [k+1, vocab]
        # rejection sampling alone reads the draft's distributions (a lookup's one-hot rows are built only then)
        draft_probs = None if algorithm.exact or params.greedy else draft.candidate_probs(self.model.vocab_size)
        accepted_len, next_token = verify_candidates(
            draft.candidates, draft_probs, logits, params.temperature, params.top_k, params.top_p,
            params.seed, first_position, exact=algorithm.exact)
        # Rollback: keep the keys and values of the committed ids and the accepted candidates only.
        self.session.rollback(len(self.ids) + accepted_len)
        new_ids = draft.candidates[:accepted_len] + [next_token]
        self._record_logprobs(params, logits[:accepted_len + 1], new_ids)
        self.ids.extend(new_ids)
        return new_ids

    def _verify_tree(self, tree: TokenTree, params: SamplingParams, first_position: int) -> Steps:
        """One pass over the tree, ``hetspec.verify.verify_tree``; the cache keeps the accepted branch."""
        cached, pending = self.session.length, self.ids[self.session.length:]
        logits = yield Feed(self.session, pending + tree.tokens, len(tree) + 1,
                            chain_then_tree(len(pending), tree))  # [1 + nodes, vocab]
        accepted, next_token = verify_tree(tree, logits, params.temperature, params.top_k, params.top_p,
                                           params.seed, first_position)
        tree_start = cached + len(pending)
        self.session.keep(list(range(tree_start)) + [tree_start + node for node in accepted])
        new_ids = [tree.tokens[node] for node in accepted] + [next_token]
        rows = [0] + [node + 1 for node in accepted]  # each committed id's logits: after its parent node
        self._record_logprobs(params, logits[rows], new_ids)
        self.ids.extend(new_ids)
        return new_ids

    def _record_logprobs(self, params: SamplingParams, target_logits: torch.Tensor, new_ids: list[int]) -> None:
        """target_logits: [len(new_ids), vocab], the rows the committed ids were chosen from."""
        if params.logprobs is not None:
            self.step_logprobs = token_logprobs(target_logits, new_ids, params.logprobs)

    def release(self) -> None:
        self.session.release()


class Progress:
    """A request's bookkeeping between steps, wherever its passes run: this process (``Request``) or the
    server's actors (deployments/serving/replica_loop.py). Draft length, draft rounds, statistics, output text."""

    def __init__(self, target: LanguageModel, params: SamplingParams, speculation: SpeculationConfig,
                 stats: Stats, prompt_ids: Sequence[int] = ()):
        """``prompt_ids``: the target's prompt ids (the context lookup reads the prompt's text)."""
        if params.seed is None:
            raise ValueError("a request's params need a seed: SamplingParams.seeded() draws one")
        self.params = params
        self.speculation = speculation
        self.output = OutputText(target, params)
        self.stats = stats
        stats.seed = params.seed
        self.policy = DraftLength(speculation)
        self.lookup = None if speculation.lookup == "off" else ContextLookup(
            speculation.lookup, speculation.lookup_min_match, speculation.lookup_max_match,
            speculation.lookup_min_draft, speculation.lookup_max_draft, prompt_text(prompt_ids, self.output.table),
            target.encode, self.output.table, speculation.alignment_window)
        self.logprobs: list[TokenLogprob] = []  # of the committed ids, when params.logprobs is set
        self.drafts = 0  # the next draft's round (hetspec.sampling: the drafter's numbers are never reused)
        self.pipelined = False  # the drafter drafts the next step ahead while the target verifies (hetspec/ahead.py)
        self.ahead: Ahead | None = None  # the draft made ahead during the last step
        self.last_new_ids: list[int] = []  # the last step's committed ids
        self.started = time.perf_counter()
        self.finished = False

    @property
    def committed(self) -> bytes:
        return bytes(self.output.generated_bytes)

    @property
    def position(self) -> int:
        """Output position of the next token."""
        return len(self.output.token_ids)

    def draft_length(self, can_draft: bool, cap: int | None = None) -> int:
        """This step's k: the policy's, within the token budget and ``cap``; 0 when the request does not draft
        now (no drafter, the committed text ends inside a UTF-8 character, or no token is out yet).

        The drafter drafts nothing before the first token, as a serving system's first token comes from the prefill
        (a context-lookup draft, no drafter pass, may go): in the server a drafter's session opens without its
        prompt and its first draft feeds it, and drafted on the first step that catch-up held the first token
        (0.1-0.3 s later than with speculation off at 1 client, ~0.8 s at 4, and the other requests' prompt chunks
        with it: docs/decisions/load-adaptive-draft-length.md). Both runtimes take the same k, so a seeded
        sample is the same in process and served."""
        remaining = self.params.max_new_tokens - self.position
        k = min(self.policy.k, remaining - 1, self.policy.k if cap is None else cap)
        committed = self.committed
        if not can_draft or k <= 0 or self.position == 0 or not ends_at_character(committed):
            return 0
        return k

    def lookup_draft(self, committed_target_ids: Sequence[int], has_drafter: bool) -> Draft | None:
        """This step's context-lookup draft (hetspec/lookup.py), already target ids, or None when the drafter
        (or the target alone) has the step. The one place both runtimes get a lookup draft from."""
        committed = self.committed
        if self.lookup is None or not ends_at_character(committed):
            return None
        tick = time.perf_counter()
        candidates = self.lookup.propose(committed, committed_target_ids,
                                         self.params.max_new_tokens - self.position - 1, self.stats.tally("lookup"),
                                         self.stats.tally("drafter") if has_drafter else None)
        self.stats.alignment_seconds += time.perf_counter() - tick
        return Draft(candidates=candidates, source="lookup") if candidates else None

    def take_ahead(self) -> Draft | None:
        """The draft made ahead during the last step, if it continues what the step committed (a hit)."""
        return None if self.ahead is None else continuing(self.ahead, self.last_new_ids, self.output.table)

    def next_round(self) -> int:
        self.drafts += 1
        return self.drafts - 1

    def commit(self, drafted: int, new_ids: list[int], logprobs: list[TokenLogprob] | None = None,
               source: str = "drafter") -> StreamEvent:
        """Account a verified step and release its text; the last event carries the finish reason and statistics.
        ``logprobs``: one per new id (``TargetSide.step_logprobs``), when the request asked for them; ``source``:
        the draft's (``Draft.source``)."""
        self.stats.target_forwards += 1
        self.last_new_ids = new_ids
        self.stats.add_draft(source, drafted, len(new_ids) - 1)
        if source == "drafter":  # the draft length policy sizes the drafter's drafts
            self.policy.update(drafted, len(new_ids) - 1)
        released = self.output.released_tokens
        self.logprobs.extend(logprobs or [])  # index i: output token i (OutputText only cuts ids at the end)
        kept_ids, delta, finish = self.output.add(new_ids)
        self.stats.generated_tokens = len(self.output.token_ids)
        kept_logprobs = self.logprobs[released:released + len(kept_ids)] if self.params.logprobs is not None else None
        if finish:
            self.finished = True
            self.stats.total_seconds = time.perf_counter() - self.started
            return StreamEvent(kept_ids, delta, finish, self.stats, kept_logprobs)
        return StreamEvent(kept_ids, delta, logprobs=kept_logprobs)


class Request(Progress):
    """One request in this process: its progress, its KV sessions, and its part of a step (draft, verify)."""

    def __init__(self, target: LanguageModel, drafter: LanguageModel | None, maps: PairMaps | None,
                 speculation: SpeculationConfig, params: SamplingParams, target_prompt_ids: list[int],
                 drafter_prompt_ids: list[int] | None = None, request_id: str = "", pipelined: bool = False):
        self.request_id = request_id
        self.algorithm = make_algorithm(speculation.algorithm, maps, speculation, params)
        self.target = TargetSide(target, target_prompt_ids)
        self.drafter = None
        if self.algorithm.needs_drafter:
            self.drafter = DrafterSide(drafter, drafter_prompt_ids, speculation.alignment_window)
        super().__init__(target, params, speculation,
                         Stats(algorithm=self.algorithm.name, prompt_tokens=self.target.prompt_len), target_prompt_ids)
        self.pipelined = self.stats.pipelined = pipelined and self.drafter is not None

    def draft(self, order: DraftOrder) -> Steps:
        """The algorithm's draft (drafter passes) of ``order``, not yet aligned to target ids (the step aligns)."""
        draft = yield from self.algorithm.draft(self.drafter, order.committed, order.k, self.params,
                                                order.first_position, order.draft_round)
        self.stats.drafter_forwards += draft.drafter_forwards
        return draft

    def verify(self, draft: Draft) -> Steps:
        return (yield from self.target.verify(self.algorithm, draft, self.params))

    def prefill_feeds(self, budget: int) -> tuple[list[Feed], list[Feed], int]:
        """(target feeds, drafter feeds, tokens used): up to ``budget`` prompt tokens of each model, all but
        the last id (the first verify pass feeds it, as the invariant wants)."""
        feeds = []
        for side in (self.target, self.drafter):
            if side is None:
                feeds.append([])
                continue
            ids = side.ids if side is self.target else side.context.ids
            feeds.append(list(islice(prefill(side.session, ids, budget), 1)))  # its next chunk, if any
        used = max((len(feed.token_ids) for group in feeds for feed in group), default=0)
        return feeds[0], feeds[1], used

    @property
    def prefilled(self) -> bool:
        sides = [(self.target.session, self.target.ids)]
        if self.drafter is not None:
            sides.append((self.drafter.session, self.drafter.context.ids))
        return all(session.length >= len(ids) - 1 for session, ids in sides)

    def release(self) -> None:
        self.target.release()
        if self.drafter is not None:
            self.drafter.release()
