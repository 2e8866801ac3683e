"""What each token stands for in bytes, and maps between two vocabularies.

Byte strings, not decoded text, are the common ground of two tokenizers: they cover byte-level BPE
(``Ġ`` for a space, every byte a token), SentencePiece (``▁`` for a space, ``<0xNN>`` byte fallback)
and UTF-8 characters split across tokens, and they never strip a leading space the way ``decode``
does at the start of a sequence.
"""

from __future__ import annotations

import re
from functools import lru_cache

import torch
from transformers import PreTrainedTokenizerBase

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPACE_MARKER = "\u2581"  # SentencePiece's "▁"


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-ins for the 256 byte values, reversed: character -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes)}


def _is_byte_level(tokenizer: PreTrainedTokenizerBase) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return "ByteLevel" in str(backend.decoder) or "ByteLevel" in str(backend.pre_tokenizer)
    return "\u0120" in "".join(list(tokenizer.get_vocab())[:5000])  # "Ġ"


def special_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    ids.update(index for index, token in tokenizer.added_tokens_decoder.items() if token.special)
    return ids


def token_bytes(tokenizer: PreTrainedTokenizerBase) -> list[bytes | None]:
    """Bytes of every token id (index = id); None for special tokens, which stand for no text."""
    cached = getattr(tokenizer, "_hetspec_token_bytes", None)
    if cached is not None:
        return cached
    specials = special_ids(tokenizer)
    added_text = {index: token.content for index, token in tokenizer.added_tokens_decoder.items()
                  if not token.special}
    alphabet = _byte_level_alphabet() if _is_byte_level(tokenizer) else None
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    table: list[bytes | None] = []
    for index, piece in enumerate(pieces):
        if index in specials or piece is None:
            table.append(None)
        elif index in added_text:
            table.append(added_text[index].encode("utf-8"))
        elif alphabet is not None:
            try:
                table.append(bytes(alphabet[char] for char in piece))
            except KeyError:
                table.append(piece.encode("utf-8"))
        else:
            fallback = _BYTE_FALLBACK.fullmatch(piece)
            table.append(bytes([int(fallback.group(1), 16)]) if fallback
                         else piece.replace(_SPACE_MARKER, " ").encode("utf-8"))
    tokenizer._hetspec_token_bytes = table
    return table


def same_vocabulary(first: PreTrainedTokenizerBase, second: PreTrainedTokenizerBase) -> bool:
    """Identical token ids for identical strings: standard SD applies."""
    return first is second or first.get_vocab() == second.get_vocab()


def intersection_map(drafter_bytes: list[bytes | None], target_bytes: list[bytes | None],
                     drafter_vocab_size: int) -> torch.Tensor:
    """TLI's map (Timor et al. 2025, Alg. 4): drafter id -> target id of the same bytes, or -1.  -> [drafter_vocab_size]

    Where several target tokens share one byte string the lowest id is used.
    """
    target_id_of: dict[bytes, int] = {}
    for target_id, piece in enumerate(target_bytes):
        if piece:
            target_id_of.setdefault(piece, target_id)
    mapping = torch.full((drafter_vocab_size,), -1, dtype=torch.long)
    for drafter_id, piece in enumerate(drafter_bytes):
        if piece and piece in target_id_of:
            mapping[drafter_id] = target_id_of[piece]
    return mapping


def inverse_map(drafter_to_target: torch.Tensor, target_vocab_size: int) -> torch.Tensor:
    """target id -> one drafter id with the same bytes (the lowest), or -1.  -> [target_vocab_size]"""
    inverse = torch.full((target_vocab_size,), -1, dtype=torch.long)
    drafter_ids = torch.nonzero(drafter_to_target >= 0).flatten().flip(0)  # lowest id written last, so it wins
    inverse[drafter_to_target[drafter_ids]] = drafter_ids
    return inverse


def first_target_token_map(drafter_bytes: list[bytes | None], target_tokenizer: PreTrainedTokenizerBase,
                           drafter_vocab_size: int) -> torch.Tensor:
    """SLRS's map: drafter id -> first target token of that drafter token's string, or -1.  -> [drafter_vocab_size]

    A drafter token that is not valid UTF-8 on its own (a piece of a split character) or stands for no
    text maps to -1 and is never proposed.
    """
    mapping = torch.full((drafter_vocab_size,), -1, dtype=torch.long)
    ids, texts = [], []
    for drafter_id, piece in enumerate(drafter_bytes):
        if not piece:
            continue
        try:
            texts.append(piece.decode("utf-8"))
        except UnicodeDecodeError:
            continue
        ids.append(drafter_id)
    encoded = target_tokenizer(texts, add_special_tokens=False)["input_ids"]
    for drafter_id, target_ids in zip(ids, encoded):
        if target_ids:
            mapping[drafter_id] = target_ids[0]
    return mapping
