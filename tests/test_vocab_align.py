"""Vocabulary bytes, TLI maps and window re-tokenization: toy vocabularies with exact ids, real tokenizers with hypothesis."""

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hetspec import vocab
from hetspec.align import DrafterContext, complete_utf8_length, target_candidates, text_window


def _sentencepiece_style(pieces: list[str]) -> PreTrainedTokenizerFast:
    """A BPE vocabulary written the SentencePiece way: ▁ for a space, <0xNN> byte fallback."""
    vocab_ids = {piece: index for index, piece in enumerate(["<bos>", "<eos>"] + pieces)}
    merges = []
    for piece in pieces:
        if len(piece) == 2 and not piece.startswith("<"):
            merges.append((piece[0], piece[1]))
    backend = Tokenizer(models.BPE(vocab=vocab_ids, merges=merges, byte_fallback=True, unk_token=None))
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>")


def _byte_level(pieces: list[str]) -> PreTrainedTokenizerFast:
    """A GPT-2 style byte-level BPE over all 256 bytes plus a few merges."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    base = sorted(alphabet)
    vocab_ids = {piece: index for index, piece in enumerate(["<|end|>"] + base + pieces)}
    merges = [(piece[0], piece[1:]) for piece in pieces]
    backend = Tokenizer(models.BPE(vocab=vocab_ids, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|end|>")


@pytest.fixture(scope="module")
def toy_target():
    return _sentencepiece_style(["a", "b", "c", "\u2581", "\u2581a", "ab", "<0xC3>", "<0xA9>"])


@pytest.fixture(scope="module")
def toy_drafter():
    return _byte_level(["\u0120a", "ab"])  # "Ġa" is " a"


def test_token_bytes_sentencepiece_style(toy_target):
    table = vocab.token_bytes(toy_target)
    assert table[:10] == [None, None, b"a", b"b", b"c", b" ", b" a", b"ab", b"\xc3", b"\xa9"]


def test_token_bytes_byte_level(toy_drafter):
    table = vocab.token_bytes(toy_drafter)
    assert table[0] is None
    assert sorted(table[1:257]) == [bytes([value]) for value in range(256)]
    assert table[257:] == [b" a", b"ab"]


def test_intersection_map_exact_ids(toy_target, toy_drafter):
    drafter_table, target_table = vocab.token_bytes(toy_drafter), vocab.token_bytes(toy_target)
    mapping = vocab.intersection_map(drafter_table, target_table, len(drafter_table))
    expected = {drafter_table.index(piece): target_table.index(piece)
                for piece in [b"a", b"b", b"c", b" ", b" a", b"ab", b"\xc3", b"\xa9"]}
    assert {index: int(value) for index, value in enumerate(mapping) if value >= 0} == expected
    inverse = vocab.inverse_map(mapping, len(target_table))
    assert all(int(inverse[target_id]) == drafter_id for drafter_id, target_id in expected.items())
    assert int(inverse[0]) == -1 and int(inverse[1]) == -1  # special tokens never map


def test_first_target_token_map(toy_target, toy_drafter):
    drafter_table = vocab.token_bytes(toy_drafter)
    mapping = vocab.first_target_token_map(drafter_table, toy_target, len(drafter_table))
    target_table = vocab.token_bytes(toy_target)
    assert int(mapping[drafter_table.index(b" a")]) == target_table.index(b" a")
    assert int(mapping[drafter_table.index(b"\xc3")]) == -1  # half a character on its own is never proposed
    assert int(mapping[0]) == -1


def test_complete_utf8_length():
    assert complete_utf8_length(b"abc") == 3
    assert complete_utf8_length("é".encode()) == 2
    assert complete_utf8_length("é".encode()[:1]) == 0
    assert complete_utf8_length(b"x" + "😀".encode()[:3]) == 1
    assert complete_utf8_length(b"x" + "😀".encode()) == 5


def test_target_candidates_merge_across_window(toy_target):
    encode = lambda text: toy_target.encode(text, add_special_tokens=False)  # noqa: E731
    table = vocab.token_bytes(toy_target)
    committed = [0] + encode(" a")  # <bos> " a"
    # "b" merges with the committed "a"? no: " a" is one token, so "b" follows it on its own.
    assert target_candidates(encode, table, committed, "bc", window=4) == encode("bc")
    # a committed "a" followed by new "b" would merge into "ab": that token straddles the boundary, so nothing.
    committed = [0] + encode("ca")
    assert encode("cab") == [table.index(b"c"), table.index(b"ab")]
    assert target_candidates(encode, table, committed, "b", window=4) == []


def test_text_window_stops_at_special_and_split_characters(toy_target):
    table = vocab.token_bytes(toy_target)
    ids = [0, table.index(b"a"), table.index(b"\xc3"), table.index(b"\xa9"), table.index(b"b")]
    assert text_window(ids, table, 8) == (1, "aéb".encode())
    assert text_window(ids, table, 2) == (4, b"b")  # "\xa9b" alone is not valid UTF-8: the window shrinks


def test_drafter_context_sync_keeps_agreeing_prefix(toy_drafter):
    encode = lambda text: toy_drafter.encode(text, add_special_tokens=False)  # noqa: E731
    table = vocab.token_bytes(toy_drafter)
    context = DrafterContext(prompt_ids=[0], table=table, encode=encode, window=2)
    assert context.sync(b"ab a") == 1  # nothing generated yet: only the prompt is kept
    assert context.generated_ids == encode("ab a")
    before = list(context.generated_ids)
    context.push(table.index(b"c"))  # a draft: "c", then the target commits "b" instead
    kept = context.sync(b"ab ab")
    assert context.generated_ids[:len(before)] == before
    assert b"".join(table[token] for token in context.generated_ids) == b"ab ab"
    assert kept >= 1 + len(before) - 2  # at most the window was re-tokenized


TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)


def _spells(model, table, text: str) -> bool:
    """SmolLM2's GGUF vocabulary lacks some byte tokens (0x16, 0xF1, ...) and its tokenizer silently drops those
    bytes; alignment cannot spell what the tokenizer cannot, which costs acceptance only, never losslessness."""
    return b"".join(table[token] or b"" for token in model.encode(text)) == text.encode()


def _straddles(model, table, committed: list[int], new: str, window: int) -> bool:
    """Whether a token of the re-tokenized window + new text crosses the end of the committed text."""
    _, window_bytes = text_window(committed, table, window)
    ends, end = {0}, 0
    for token in model.encode(window_bytes.decode("utf-8") + new):
        end += len(table[token] or b"")
        ends.add(end)
    return len(window_bytes) not in ends


@pytest.mark.real
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prefix=TEXT, new=TEXT)
def test_real_target_candidates_spell_the_new_text(gemma, smollm, prefix, new):
    """Whatever two real tokenizers do, candidates continue the committed ids and spell exactly the new text,
    or are empty because a target token would cross the end of the committed ids (which are fixed)."""
    for model in (gemma, smollm):
        table = vocab.token_bytes(model.tokenizer)
        assume(_spells(model, table, new))  # text the tokenizer itself cannot spell is not alignment's to spell
        committed = model.encode_prompt("Context: " + prefix)
        candidates = target_candidates(model.encode, table, committed, new, window=8)
        assert all(0 <= token < model.vocab_size for token in candidates)
        if _straddles(model, table, committed, new, window=8):
            assert candidates == []
        else:
            assert b"".join(table[token] or b"" for token in candidates) == new.encode("utf-8")


@pytest.mark.real
def test_real_target_candidates_align_a_word_after_a_space(gemma, smollm):
    """The common case aligns: a word that starts with a space follows a committed word."""
    for model in (gemma, smollm):
        table = vocab.token_bytes(model.tokenizer)
        candidates = target_candidates(model.encode, table, model.encode_prompt("The capital of France"), " is Paris",
                                       window=8)
        assert candidates and b"".join(table[token] for token in candidates) == b" is Paris"


@pytest.mark.real
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first=TEXT, second=TEXT)
def test_real_drafter_sync_spells_the_committed_text(gemma, smollm, first, second):
    for model in (gemma, smollm):
        table = vocab.token_bytes(model.tokenizer)
        context = DrafterContext(prompt_ids=model.encode_prompt("Hi"), table=table, encode=model.encode, window=4)
        assume(_spells(model, table, first) and _spells(model, table, first + second))
        context.sync(first.encode())
        context.sync((first + second).encode())
        assert b"".join(table[token] or b"" for token in context.generated_ids) == (first + second).encode()


@pytest.mark.real
def test_real_vocabularies(gemma, smollm):
    gemma_table, smollm_table = vocab.token_bytes(gemma.tokenizer), vocab.token_bytes(smollm.tokenizer)
    assert gemma_table[gemma.tokenizer.convert_tokens_to_ids("\u2581hello")] == b" hello"
    assert smollm_table[smollm.tokenizer.convert_tokens_to_ids("\u0120hello")] == b" hello"
    assert gemma_table[gemma.tokenizer.convert_tokens_to_ids("<0xE2>")] == b"\xe2"
    assert gemma_table[gemma.tokenizer.bos_token_id] is None
    mapping = vocab.intersection_map(smollm_table, gemma_table, smollm.vocab_size)
    shared = int((mapping >= 0).sum())
    assert 40000 < shared < smollm.vocab_size  # docs/models.md: 46,138 tokens by bytes
    non_ascii = [index for index, piece in enumerate(smollm_table) if piece and max(piece) >= 0x80 and mapping[index] >= 0]
    assert len(non_ascii) > 100  # bytes, not spelling: non-ASCII tokens match too
    for index in non_ascii[:50]:
        assert gemma_table[int(mapping[index])] == smollm_table[index]
    assert not vocab.same_vocabulary(gemma.tokenizer, smollm.tokenizer)
    assert vocab.same_vocabulary(gemma.tokenizer, gemma.tokenizer)


@pytest.mark.real
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first=st.binary(max_size=12), second=st.binary(max_size=12))
def test_real_drafter_sync_takes_bytes_that_are_not_utf8(gemma, smollm, first, second):
    """Sampling can commit a byte token where no character continues (the soak met b'...\\xb5...'): the
    drafter's re-sync raised UnicodeDecodeError (an HTTP 500); now it reads U+FFFD there."""
    for model in (gemma, smollm):
        table = vocab.token_bytes(model.tokenizer)
        context = DrafterContext(prompt_ids=model.encode_prompt("Hi"), table=table, encode=model.encode, window=4)
        context.sync(b"ab" + first)
        context.sync(b"ab" + first + second)
        assert context.text_length == len(b"ab" + first + second)
        assert b"".join(table[token] or b"" for token in context.generated_ids).startswith(b"ab")


@pytest.mark.real
def test_real_slem_proposes_the_utf8_text_before_invalid_bytes(gemma, smollm):
    from hetspec import SamplingParams, SpeculationConfig
    from hetspec.algorithms import Draft, PairMaps, make_algorithm

    slem = make_algorithm("slem", PairMaps(smollm, gemma), SpeculationConfig(), SamplingParams())
    committed = gemma.encode_prompt("The capital of France is")
    aligned = slem.align(Draft(text=b" Paris\xb5 and"), committed)  # was a UnicodeDecodeError
    assert b"".join(vocab.token_bytes(gemma.tokenizer)[token] for token in aligned.candidates) == b" Paris"
