"""The in-process decode loop: draft, align, verify, commit; stop conditions, streaming, statistics."""

from __future__ import annotations

import bisect
import codecs
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator, Sequence

import torch

from hetspec.algorithms import Algorithm, Draft, DrafterSide, PairMaps, make_algorithm
from hetspec.align import complete_utf8_length
from hetspec.config import SamplingParams, SpeculationConfig
from hetspec.models import LanguageModel
from hetspec.sampling import target_choice
from hetspec.tree import TokenTree, chain_then_tree, walk
from hetspec.verify import verify_candidates
from hetspec.vocab import token_bytes


@dataclass
class Stats:
    algorithm: str = "ar"
    prompt_tokens: int = 0
    generated_tokens: int = 0
    target_forwards: int = 0
    drafter_forwards: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    drafter_seconds: float = 0.0
    target_seconds: float = 0.0
    alignment_seconds: float = 0.0
    total_seconds: float = 0.0

    @property
    def mean_accepted_per_pass(self) -> float:
        """Tokens committed per target forward pass (1.0 for the target alone)."""
        return self.generated_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "mean_accepted_per_pass": self.mean_accepted_per_pass,
                "acceptance_rate": self.acceptance_rate,
                "tokens_per_second": self.generated_tokens / self.total_seconds if self.total_seconds else 0.0}


@dataclass
class StreamEvent:
    token_ids: list[int]  # released by this step (OutputText holds back those that may lie in a stop string)
    text: str  # the text they add; never splits a UTF-8 character nor ends with a possible stop string's start
    finish_reason: str | None = None  # "stop" (EOS or a stop string) or "length" on the last event
    stats: Stats | None = None  # on the last event


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: Stats
    prompt_ids: list[int] = field(default_factory=list)


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

    @property
    def generated_ids(self) -> list[int]:
        return self.ids[self.prompt_len:]

    def logits_for(self, candidates: list[int]) -> torch.Tensor:
        """Target logits at the k+1 positions after the committed ids and each candidate.  -> [k+1, vocab]"""
        self.forwards += 1
        feed = self.ids[self.session.length:] + candidates
        return self.session.extend(feed, logits_to_keep=len(candidates) + 1)

    def commit(self, candidates: list[int], accepted_len: int, next_token: int) -> list[int]:
        # Rollback: keep the keys and values of the committed ids and the accepted candidates only.
        self.session.rollback(len(self.ids) + accepted_len)
        new_ids = candidates[:accepted_len] + [next_token]
        self.ids.extend(new_ids)
        return new_ids

    def verify(self, algorithm: Algorithm, draft: Draft, params: SamplingParams) -> list[int]:
        first_position = len(self.ids) - self.prompt_len
        if draft.tree is not None:
            return self.verify_tree(draft.tree, params, first_position)
        logits = self.logits_for(draft.candidates)
        accepted_len, next_token = verify_candidates(
            draft.candidates, draft.draft_probs, logits, params.temperature, params.top_k, params.top_p,
            params.seed, first_position, exact=algorithm.exact)
        return self.commit(draft.candidates, accepted_len, next_token)

    def verify_tree(self, tree: TokenTree, params: SamplingParams, first_position: int) -> list[int]:
        """Exact match down a token tree (``hetspec.tree.walk``) in one pass; the cache keeps the accepted branch."""
        self.forwards += 1
        cached, pending = self.session.length, self.ids[self.session.length:]
        logits = self.session.extend_tree(pending + tree.tokens, chain_then_tree(len(pending), tree),
                                          logits_to_keep=len(tree) + 1)  # [1 + nodes, vocab]
        greedy_choices = logits.argmax(dim=-1).tolist() if params.greedy else None

        def choice_at(node: int, depth: int) -> int:
            row = node + 1  # row 0: after the last committed id
            if greedy_choices is not None:
                return greedy_choices[row]
            return target_choice(logits[row], params.temperature, params.top_k, params.top_p, params.seed,
                                 first_position + depth)

        accepted, next_token = walk(tree.children(), choice_at)
        tree_start = cached + len(pending)
        self.session.keep(list(range(tree_start)) + [tree_start + node for node in accepted])
        new_ids = [tree.tokens[node] for node in accepted] + [next_token]
        self.ids.extend(new_ids)
        return new_ids

    def release(self) -> None:
        self.session.release()


class DraftLength:
    """Draft length policy; it changes speed only, never the output."""

    def __init__(self, speculation: SpeculationConfig):
        self.speculation = speculation
        self.k = speculation.draft_tokens

    def update(self, drafted: int, accepted: int) -> None:
        if not self.speculation.adaptive or drafted == 0:
            return
        if accepted == drafted:
            self.k = min(self.k + 2, self.speculation.max_draft_tokens)
        else:
            self.k = max(self.k - 1, self.speculation.min_draft_tokens)


class OutputText:
    """Turns committed ids into text deltas and applies EOS, stop strings and the token budget.

    Terms. The *text* is the incremental UTF-8 decode (errors="replace") of the committed tokens' bytes;
    a character is final once the decoder emits it (the decoder is flushed only at the finish). A token's
    *start* is the text length before its bytes were decoded, in characters: a replacement character
    stands for an unknown number of bytes, so bytes cannot be mapped back to characters.

    Stop rule: the output ends right before the stop string whose occurrence *completes* first in the
    text (smallest end; on a tie the longer one, which starts first). That is what decoding one token
    at a time gives, so it does not depend on how many tokens a step commits. The stop string is never
    returned; its finish reason is "stop".

    Hold-back: while decoding, the longest suffix of the text that is a proper prefix of some stop string
    is held back (fewer than the longest stop's length in characters), and so are the ids of the tokens
    that start in it, so no delta ever has to be taken back. The released length only grows: a longer
    held suffix would have been a longer prefix already, or a stop that completed. At the finish by EOS or
    the budget the held text is released; at a stop it is dropped.

    Result ids: the committed tokens that start before the stop string's first character, i.e. those that
    give bytes to the returned text (a token straddling the stop's start is kept; so is one whose decoding
    first emits the U+FFFD of an earlier token's invalid bytes). The joined deltas and event ids are exactly
    ``text`` and ``token_ids`` at the finish.

    ``token_ids`` and ``generated_bytes`` hold every committed token while decoding (the decode loops take
    positions and the token budget from them); at the finish ``token_ids`` and ``text`` are the result.
    """

    def __init__(self, target: LanguageModel, params: SamplingParams):
        self.table = token_bytes(target.tokenizer)
        self.eos_ids = set() if params.ignore_eos else set(target.eos_token_ids)
        self.params = params
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.token_ids: list[int] = []
        self.token_starts: list[int] = []  # each committed token's start in ``text``
        self.generated_bytes = bytearray()
        self.text = ""
        self.released_chars = 0  # of ``text``, in the deltas so far
        self.released_tokens = 0  # of ``token_ids``, in the events so far

    def _bytes_of(self, token_id: int) -> bytes:
        return self.table[token_id] or b"" if token_id < len(self.table) else b""

    def add(self, new_ids: list[int]) -> tuple[list[int], str, str | None]:
        """Returns (ids released, text delta, finish reason or None)."""
        finish = None
        budget = self.params.max_new_tokens - len(self.token_ids)
        if len(new_ids) >= budget:
            new_ids, finish = new_ids[:budget], "length"
        for index, token_id in enumerate(new_ids):
            if token_id in self.eos_ids:
                new_ids, finish = new_ids[:index + 1], "stop"
                break
        scanned = len(self.text)  # no stop completes inside text[:scanned]: it was checked by earlier steps
        for token_id in new_ids:
            piece = self._bytes_of(token_id)
            self.token_starts.append(len(self.text))
            self.generated_bytes += piece
            self.text += self.decoder.decode(piece)
        self.token_ids.extend(new_ids)
        if finish:
            self.text += self.decoder.decode(b"", final=True)
        stop_start = self._first_completed_stop(scanned)
        if stop_start is not None:
            finish = "stop"
            self.text = self.text[:stop_start]
            kept = bisect.bisect_left(self.token_starts, stop_start)  # tokens that start before the stop
            del self.token_ids[kept:], self.token_starts[kept:]
        released_chars = len(self.text) if finish else len(self.text) - self._held_length()
        released_tokens = (len(self.token_ids) if finish
                           else bisect.bisect_left(self.token_starts, released_chars))
        assert released_chars >= self.released_chars, "released text is never taken back"
        delta = self.text[self.released_chars:released_chars]
        ids = self.token_ids[self.released_tokens:released_tokens]
        self.released_chars, self.released_tokens = released_chars, released_tokens
        return ids, delta, finish

    def _first_completed_stop(self, scanned: int) -> int | None:
        """Start of the stop-string occurrence that ends first after ``text[:scanned]`` (ties: the longer)."""
        first = None  # (end, start)
        for stop in self.params.stop:
            start = self.text.find(stop, max(0, scanned - len(stop) + 1))  # the first of this stop ends first
            if start >= 0 and (first is None or (start + len(stop), start) < first):
                first = (start + len(stop), start)
        return None if first is None else first[1]

    def _held_length(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of some stop string."""
        held = 0
        for stop in self.params.stop:
            for length in range(min(len(stop) - 1, len(self.text)), held, -1):
                if self.text.endswith(stop[:length]):
                    held = length
                    break
        return held


class Engine:
    """Target plus optional drafter, in this process. ``stream`` and ``generate`` are the public calls."""

    def __init__(self, target: LanguageModel, drafter: LanguageModel | None = None,
                 speculation: SpeculationConfig | None = None):
        self.target = target
        self.drafter = drafter
        self.speculation = speculation or SpeculationConfig()
        self.maps = PairMaps(drafter, target) if drafter is not None else None

    def prompt_ids(self, prompt: str | None, messages: list[dict[str, str]] | None,
                   model: LanguageModel) -> list[int]:
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if messages is not None:
            return model.encode_chat(messages)
        if not prompt:
            raise ValueError("prompt must not be empty")
        return model.encode_prompt(prompt)

    def stream(self, prompt: str | None = None, params: SamplingParams | dict | None = None, *,
               messages: list[dict[str, str]] | None = None,
               speculation: SpeculationConfig | None = None) -> Iterator[StreamEvent]:
        # a plain dict is accepted too, validated here: a ValidationError names the field
        params = SamplingParams() if params is None else SamplingParams.model_validate(params)
        speculation = self.speculation if speculation is None else SpeculationConfig.model_validate(speculation)
        algorithm = make_algorithm(speculation.algorithm, self.maps, speculation, params)
        started = time.perf_counter()
        target_side = TargetSide(self.target, self.prompt_ids(prompt, messages, self.target))
        drafter_side = None
        if algorithm.needs_drafter:
            drafter_side = DrafterSide(self.drafter, self.prompt_ids(prompt, messages, self.drafter),
                                       speculation.alignment_window)
        stats = Stats(algorithm=algorithm.name, prompt_tokens=target_side.prompt_len)
        output = OutputText(self.target, params)
        policy = DraftLength(speculation)
        drafts = 0  # the next draft's round (hetspec.sampling: the drafter's numbers are never reused)
        try:
            while True:
                remaining = params.max_new_tokens - len(output.token_ids)
                committed = bytes(output.generated_bytes)
                k = min(policy.k, remaining - 1)
                draft = Draft()
                if drafter_side is not None and k > 0 and complete_utf8_length(committed) == len(committed):
                    tick = time.perf_counter()
                    draft = algorithm.draft(drafter_side, committed, k, params, len(output.token_ids), drafts)
                    drafts += 1
                    tock = time.perf_counter()
                    draft = algorithm.align(draft, target_side.ids)
                    stats.drafter_seconds += tock - tick
                    stats.alignment_seconds += time.perf_counter() - tock
                    stats.drafter_forwards += draft.drafter_forwards
                tick = time.perf_counter()
                new_ids = target_side.verify(algorithm, draft, params)
                stats.target_seconds += time.perf_counter() - tick
                stats.target_forwards += 1
                stats.drafted_tokens += draft.proposed_len
                stats.accepted_tokens += len(new_ids) - 1
                policy.update(draft.proposed_len, len(new_ids) - 1)
                kept_ids, delta, finish = output.add(new_ids)
                stats.generated_tokens = len(output.token_ids)
                if finish:
                    stats.total_seconds = time.perf_counter() - started
                    yield StreamEvent(kept_ids, delta, finish, stats)
                    return
                yield StreamEvent(kept_ids, delta)
        finally:
            target_side.release()
            if drafter_side is not None:
                drafter_side.release()

    def generate(self, prompt: str | None = None, params: SamplingParams | dict | None = None, *,
                 messages: list[dict[str, str]] | None = None,
                 speculation: SpeculationConfig | None = None) -> GenerationResult:
        token_ids: list[int] = []
        pieces: list[str] = []
        for event in self.stream(prompt, params, messages=messages, speculation=speculation):
            token_ids.extend(event.token_ids)
            pieces.append(event.text)
            if event.finish_reason:
                return GenerationResult("".join(pieces), token_ids, event.finish_reason, event.stats)
        raise AssertionError("the stream ended without a finish reason")
