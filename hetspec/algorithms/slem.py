"""SLEM: string-level exact match (Timor et al. 2025, Alg. 2).

The drafter writes k of its own tokens; their string is re-tokenized by the target tokenizer together
with a window of committed target tokens (``align.target_candidates``); the target keeps the longest
prefix equal to its own choices (argmax, or its seeded sample). Lossless for any draft: only tokens the
target itself would have chosen are ever kept.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Sequence

import torch

from hetspec.algorithms.base import Algorithm, Draft, DrafterSide
from hetspec.kv import Feed
from hetspec.passes import Steps
from hetspec.align import complete_utf8_length, target_candidates
from hetspec.config import SamplingParams
from hetspec.sampling import Stream, logits_to_probs, sample_from, uniform
from hetspec.tree import ROOT, TokenTree, trie


class StringLevelExactMatch(Algorithm):
    name = "slem"
    exact = True

    @property
    def needs_drafter(self) -> bool:
        return True

    def draft(self, drafter: DrafterSide, committed: bytes, k: int, params: SamplingParams,
              first_position: int, draft_round: int) -> Steps:
        if self.speculation.tree_width > 1:
            return (yield from self.draft_tree(drafter, committed, k, params, first_position))
        drafter.sync(committed)
        forwards_before = drafter.forwards
        table = drafter.context.table
        drafted = bytearray()
        for step in range(k):
            logits = (yield from drafter.next_logits())
            if params.greedy:
                probs = torch.softmax(logits, dim=-1) if self.speculation.confidence_threshold else None
                token = int(torch.argmax(logits))
            else:
                probs = logits_to_probs(logits, params.temperature, params.top_k, params.top_p)
                # Any draft is lossless here. Drawing with the target's own numbers for these positions makes a
                # drafter that agrees with the target draw the very token the target will draw.
                token = sample_from(probs, uniform(params.seed, Stream.TARGET, first_position + step))
            if probs is not None and self._stop_early(float(probs.max()), step):
                break
            if table[token] is None:  # EOS or another special token: the string ends here
                break
            drafter.context.push(token)
            drafted += table[token]
        usable = bytes(drafted[:complete_utf8_length(bytes(drafted))])
        return Draft(text=usable, drafter_forwards=drafter.forwards - forwards_before)

    def draft_tree(self, drafter: DrafterSide, committed: bytes, k: int, params: SamplingParams,
                   first_position: int) -> Steps:
        """A beam of ``tree_width`` branches per depth, scored by drafter path probability, that always holds
        the chain ``draft`` would write (so a tree never accepts less than that chain). Depth d is one drafter
        pass over the whole tree so far (tree attention), so a draft of depth k costs k drafter passes."""
        drafter.sync(committed)
        forwards_before = drafter.forwards
        table, width = drafter.context.table, self.speculation.tree_width
        threshold = self.speculation.confidence_threshold
        frontier_logits = (yield from drafter.next_logits())[None]  # [frontier, drafter_vocab]
        cached = drafter.session.length
        tree = TokenTree()
        log_probs: list[float] = []
        principal: int | None = ROOT  # the node on the chain ``draft`` would write
        frontier = [ROOT]
        for depth in range(k):
            scored = []  # (is principal child, path log probability, parent, token)
            for parent, logits in zip(frontier, frontier_logits):
                probs = self._drafter_probs(logits, params)
                parent_log_prob = log_probs[parent] if parent != ROOT else 0.0
                choices = dict.fromkeys(probs.topk(width).indices.tolist(), False)
                if parent == principal and not self._stop_early(float(probs.max()), depth):
                    choices[self._chain_token(probs, params, first_position + depth)] = True
                for token, is_principal in choices.items():
                    log_prob = parent_log_prob + math.log(max(float(probs[token]), 1e-30))
                    if table[token] is not None and (is_principal or math.exp(log_prob) >= threshold):
                        scored.append((is_principal, log_prob, parent, token))
            scored.sort(reverse=True)
            principal, frontier = None, []
            for is_principal, log_prob, parent, token in scored[:width]:
                frontier.append(tree.add(token, parent))
                log_probs.append(log_prob)
                if is_principal:
                    principal = frontier[-1]
            if not frontier or depth == k - 1:
                break
            drafter.forwards += 1
            frontier_logits = yield Feed(drafter.session, tree.tokens, len(frontier), tree.parents)
            drafter.session.rollback(cached)
        leaves = sorted(set(range(len(tree))) - set(tree.parents))
        texts = []
        for leaf in leaves:
            data = b"".join(table[tree.tokens[node]] for node in tree.path(leaf))
            texts.append(data[:complete_utf8_length(data)])
        return Draft(texts=[text for text in dict.fromkeys(texts) if text],
                     drafter_forwards=drafter.forwards - forwards_before)

    def _drafter_probs(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        if params.greedy:
            return torch.softmax(logits, dim=-1)
        return logits_to_probs(logits, params.temperature, params.top_k, params.top_p)

    @staticmethod
    def _chain_token(probs: torch.Tensor, params: SamplingParams, position: int) -> int:
        if params.greedy:
            return int(torch.argmax(probs))
        return sample_from(probs, uniform(params.seed, Stream.TARGET, position))

    def align(self, draft: Draft, committed_target_ids: Sequence[int]) -> Draft:
        encode = partial(target_candidates, self.maps.encode_target, self.maps.target_table, committed_target_ids,
                         window=self.speculation.alignment_window)
        if draft.text:
            draft.candidates = encode(new_text=_utf8_prefix(draft.text))
        elif draft.texts:
            tree = trie(encode(new_text=_utf8_prefix(text)) for text in draft.texts)
            if tree.parents == list(range(-1, len(tree) - 1)):  # one branch: verify it as a chain
                draft.candidates = tree.tokens
            else:
                draft.tree = tree
        return draft


def _utf8_prefix(data: bytes) -> str:
    """The text before the first bytes that are not UTF-8 (a sampled drafter byte token can leave such)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        return data[:error.start].decode("utf-8")
