"""String-level alignment between two tokenizers, on a bounded window of text.

Tokenizers are not injective and not compositional: ``encode(a + b) != encode(a) + encode(b)`` when
a token would merge across the boundary, and leading-space rules differ. So new text is never encoded
alone: it is encoded together with a window of the last few tokens already committed, and only what
comes after that window is used. The context is never re-tokenized whole (docs/design.md, SLEM).

Alignment decides only which candidates are proposed, never which are accepted, so a poor alignment
costs speed, not losslessness.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

Encode = Callable[[str], list[int]]


def complete_utf8_length(data: bytes) -> int:
    """Length of the longest prefix of ``data`` that does not end inside a UTF-8 character."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[len(data) - back]
        if byte < 0x80:
            return len(data)
        if byte >= 0xC0:  # the lead byte of the last character: are all its continuation bytes there?
            needed = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return len(data) if back >= needed else len(data) - back
    return len(data)


def ends_at_character(data: bytes) -> bool:
    """``data`` does not end inside a UTF-8 character: a draft may start from it (the drafter, a context
    lookup and a pipelined draft all continue text, never half a character)."""
    return complete_utf8_length(data) == len(data)


def text_window(ids: Sequence[int], table: Sequence[bytes | None], max_tokens: int) -> tuple[int, bytes]:
    """The last ``max_tokens`` ids that stand for text, stopping at a special token; their start and bytes.

    The window is shrunk from the left until its bytes decode as UTF-8 on their own.
    """
    start = len(ids)
    while start > 0 and len(ids) - start < max_tokens and table[ids[start - 1]] is not None:
        start -= 1
    while start < len(ids):
        data = b"".join(table[token] for token in ids[start:])
        try:
            data.decode("utf-8")
            return start, data
        except UnicodeDecodeError:
            start += 1
    return len(ids), b""


def split_after(encoded: list[int], table: Sequence[bytes | None], window_ids: Sequence[int],
                window_bytes: bytes) -> tuple[int, int] | None:
    """Where ``encoded`` (the encoding of window text + new text) leaves the window.

    Returns (agreeing, boundary): ``encoded[:agreeing] == window_ids[:agreeing]`` and ``encoded[boundary:]``
    starts exactly at the end of the window's bytes. None when a token of ``encoded`` straddles that end.
    """
    agreeing = 0
    while agreeing < min(len(encoded), len(window_ids)) and encoded[agreeing] == window_ids[agreeing]:
        agreeing += 1
    if agreeing == len(window_ids):
        return agreeing, agreeing
    offset = sum(len(table[token] or b"") for token in encoded[:agreeing])
    boundary = agreeing
    while offset < len(window_bytes) and boundary < len(encoded):
        offset += len(table[encoded[boundary]] or b"")
        boundary += 1
    return (agreeing, boundary) if offset == len(window_bytes) else None


def target_candidates(encode: Encode, table: Sequence[bytes | None], committed_ids: Sequence[int],
                      new_text: str, window: int) -> list[int]:
    """Target token ids that continue ``committed_ids`` with ``new_text`` (SLEM's re-tokenization).

    The committed ids are fixed, so a target token straddling their end cannot be proposed: then
    nothing is (the target still makes one token this step).
    """
    if not new_text:
        return []
    start, window_bytes = text_window(committed_ids, table, window)
    encoded = encode(window_bytes.decode("utf-8") + new_text)
    split = split_after(encoded, table, committed_ids[start:], window_bytes)
    return [] if split is None else encoded[split[1]:]


@dataclass
class DrafterContext:
    """The drafter's tokens for the prompt and the committed generated text.

    ``ids`` = fixed prompt ids + generated ids; ``ends[i]`` is the byte offset in the generated text
    where generated token i ends. The generated ids may run past the committed text (a draft); ``sync``
    keeps what agrees with the committed text and re-tokenizes the rest over a bounded window.
    """

    prompt_ids: list[int]
    table: Sequence[bytes | None]
    encode: Encode
    window: int = 8
    generated_ids: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.generated_ids

    @property
    def text_length(self) -> int:
        return self.ends[-1] if self.ends else 0

    def push(self, token_id: int) -> None:
        """Append one drafted token after the current text."""
        self.generated_ids.append(token_id)
        self.ends.append(self.text_length + len(self.table[token_id] or b""))

    def sync(self, committed: bytes) -> int:
        """Make the generated ids stand for ``committed`` (complete UTF-8). Returns how many ids were kept
        unchanged, counting the prompt: the caller rolls the drafter's cache back to at most that."""
        keep, start = 0, 0
        while keep < len(self.generated_ids):
            end = self.ends[keep]
            if end > len(committed) or committed[start:end] != (self.table[self.generated_ids[keep]] or b""):
                break
            keep, start = keep + 1, end
        if keep == len(self.generated_ids) and start == len(committed):
            return len(self.ids)
        anchor = max(0, keep - self.window)
        while anchor and not ends_at_character(committed[:self.ends[anchor - 1]]):
            anchor -= 1  # a byte token ends inside a character there: re-tokenize from a character boundary
        anchor_offset = self.ends[anchor - 1] if anchor else 0
        # Sampling can commit bytes that are not UTF-8 (a byte token where no character continues): the drafter
        # then reads U+FFFD there. Only its context differs from the committed bytes (ends are pinned below),
        # and a draft is only a proposal that the target verifies, so this stays lossless.
        text = committed[anchor_offset:].decode("utf-8", errors="replace")
        encoded = self.encode(text) if anchor_offset < len(committed) else []
        agreeing = 0
        while (agreeing < min(len(encoded), keep - anchor)
               and encoded[agreeing] == self.generated_ids[anchor + agreeing]):
            agreeing += 1
        kept = anchor + agreeing
        del self.generated_ids[kept:], self.ends[kept:]
        for token_id in encoded[agreeing:]:
            self.push(token_id)
        if self.ends and self.ends[-1] != len(committed):  # a normalizer changed the text: pin the end
            self.ends[-1] = len(committed)
        return len(self.prompt_ids) + kept
