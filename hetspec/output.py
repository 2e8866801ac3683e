"""What a request returns: its text and ids as they are released, and its statistics.

``OutputText`` applies EOS, stop strings and the token budget; ``DraftLength`` is a request's own draft
length policy. Both are driven by the one decode step (``hetspec.decoder.Request``).
"""

from __future__ import annotations

import bisect
import codecs
from dataclasses import asdict, dataclass, field

import torch

from hetspec.config import SamplingParams, SpeculationConfig
from hetspec.lookup import SourceTally
from hetspec.models import LanguageModel
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
    batch_rows: int = 0  # summed over its target passes: how many requests each pass verified
    chosen_draft_tokens: int = 0  # summed over its steps: the draft length each step gave it
    seed: int | None = None  # the request's seed (drawn at random when it gave none): it reproduces the sample
    pipelined: bool = False  # its drafter drafted each next step ahead, beside the verification (hetspec/ahead.py)
    pipeline_hits: int = 0  # drafts made ahead that were used
    pipeline_misses: int = 0  # drafts made ahead that were dropped
    drafter_lost: bool = False  # served: the drafter died (or was being replaced), the target decoded alone from then
    # per draft source (drafted_tokens and accepted_tokens are their sums): the drafter model, the context lookup
    drafter_drafts: int = 0
    drafter_drafted_tokens: int = 0
    drafter_accepted_tokens: int = 0
    lookup_drafts: int = 0
    lookup_drafted_tokens: int = 0
    lookup_accepted_tokens: int = 0

    def tally(self, source: str) -> SourceTally:
        """One draft source's record ("drafter" or "lookup")."""
        return SourceTally(getattr(self, f"{source}_drafts"), getattr(self, f"{source}_drafted_tokens"),
                           getattr(self, f"{source}_accepted_tokens"))

    def add_draft(self, source: str, drafted: int, accepted: int) -> None:
        """A verified draft of ``drafted`` tokens from ``source``, ``accepted`` of them kept."""
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        if drafted:
            setattr(self, f"{source}_drafts", getattr(self, f"{source}_drafts") + 1)
            setattr(self, f"{source}_drafted_tokens", getattr(self, f"{source}_drafted_tokens") + drafted)
            setattr(self, f"{source}_accepted_tokens", getattr(self, f"{source}_accepted_tokens") + accepted)

    @property
    def mean_batch_size(self) -> float:
        return self.batch_rows / self.target_forwards if self.target_forwards else 0.0

    @property
    def mean_draft_length(self) -> float:
        """Mean k the draft policies chose (0 in a step decoded without a draft)."""
        return self.chosen_draft_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def mean_accepted_per_pass(self) -> float:
        """Tokens committed per target forward pass (1.0 for the target alone)."""
        return self.generated_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "mean_accepted_per_pass": self.mean_accepted_per_pass,
                "acceptance_rate": self.acceptance_rate, "mean_batch_size": self.mean_batch_size,
                "mean_draft_length": self.mean_draft_length,
                "tokens_per_second": self.generated_tokens / self.total_seconds if self.total_seconds else 0.0}


@dataclass
class TokenLogprob:
    """The target's log-probability of one generated token and of its most likely alternatives: the raw
    log-softmax of the target's logits at that position (before temperature, top-k and top-p)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), most likely first; SamplingParams.logprobs long


def token_logprobs(target_logits: torch.Tensor, token_ids: list[int], top: int) -> list[TokenLogprob]:
    """Each id's log-probability in its row and the ``top`` largest of the row.  target_logits: [len(ids), vocab]"""
    log_probs = torch.log_softmax(target_logits.float(), dim=-1)
    chosen = log_probs[torch.arange(len(token_ids)), torch.tensor(token_ids, dtype=torch.long)].tolist()
    best_values, best_ids = log_probs.topk(top, dim=-1) if top else (log_probs[:, :0], log_probs[:, :0])
    return [TokenLogprob(token_id, logprob, list(zip(ids, values)))
            for token_id, logprob, ids, values in zip(token_ids, chosen, best_ids.long().tolist(),
                                                      best_values.tolist())]


@dataclass
class StreamEvent:
    token_ids: list[int]  # released by this step (OutputText holds back those that may lie in a stop string)
    text: str  # the text they add; never splits a UTF-8 character nor ends with a possible stop string's start
    finish_reason: str | None = None  # "stop" (EOS or a stop string) or "length" on the last event
    stats: Stats | None = None  # on the last event
    logprobs: list[TokenLogprob] | None = None  # one per id of token_ids when SamplingParams.logprobs is set


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: Stats
    prompt_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # one per id of token_ids when SamplingParams.logprobs is set


class ResultBuilder:
    """A request's stream events joined into its ``GenerationResult``."""

    def __init__(self, prompt_ids: list[int] | None = None):
        self.prompt_ids = list(prompt_ids or [])
        self.token_ids: list[int] = []
        self.pieces: list[str] = []
        self.logprobs: list[TokenLogprob] | None = None

    def add(self, event: StreamEvent) -> GenerationResult | None:
        """The result once ``event`` is the last one, else None."""
        self.token_ids.extend(event.token_ids)
        self.pieces.append(event.text)
        if event.logprobs is not None:
            self.logprobs = (self.logprobs or []) + event.logprobs
        if not event.finish_reason:
            return None
        return GenerationResult("".join(self.pieces), self.token_ids, event.finish_reason, event.stats,
                                self.prompt_ids, self.logprobs)


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
        self.eos_ids = (set() if params.ignore_eos else set(target.eos_token_ids)) | set(params.stop_token_ids)
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
