"""Tiny synthetic models and tokenizers whose next-token distributions can be enumerated exactly.

Tokenizers are BPE over the alphabet {a, b, c, space} with a few multi-character merges, in three
styles: literal characters (what ``hetspec.vocab`` treats as SentencePiece-style, no marker present),
byte-level (GPT-2's ``Ġ`` for a space) and SentencePiece's ``▁`` marker. Models are random 1-layer
Llamas with a scaled output head, so their distributions are far from uniform.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Iterator

import torch
from scipy import stats
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hetspec.models import LanguageModel
from hetspec.sampling import logits_to_probs

ALPHABET = ("a", "b", "c", " ")
SPACE_MARKERS = {"literal": " ", "byte_level": "\u0120", "metaspace": "\u2581"}


def char_bpe_tokenizer(merges: list[tuple[str, str]], style: str = "literal") -> PreTrainedTokenizerFast:
    """BPE over ALPHABET; ids 0-3 are a, b, c, space, then one id per merge in order. No special tokens.

    ``merges`` are written with a literal space; ``style`` picks how the vocabulary spells it.
    """
    space = SPACE_MARKERS[style]
    spelled = [(left.replace(" ", space), right.replace(" ", space)) for left, right in merges]
    token_ids = {piece.replace(" ", space): index for index, piece in enumerate(ALPHABET)}
    for left, right in spelled:
        token_ids[left + right] = len(token_ids)
    backend = Tokenizer(models.BPE(token_ids, spelled))
    if style == "byte_level":
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
    elif style == "metaspace":
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=space, prepend_scheme="never", split=False)
        backend.decoder = decoders.Metaspace(replacement=space, prepend_scheme="never", split=False)
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def target_tokenizer() -> PreTrainedTokenizerFast:
    """a b c ' ' ab 'b ' ' c' abc: literal characters."""
    return char_bpe_tokenizer([("a", "b"), ("b", " "), (" ", "c"), ("ab", "c")])


def drafter_tokenizer() -> PreTrainedTokenizerFast:
    """a b c ' ' bb abb ca ' a': byte-level, different merges. Shares only a, b, c and space with the target;
    'abb' starts with the target token 'ab' (SLRS's first-target-token map is not just the intersection)."""
    return char_bpe_tokenizer([("b", "b"), ("a", "bb"), ("c", "a"), (" ", "a")], style="byte_level")


def tiny_llama(vocab_size: int, seed: int, head_scale: float = 40.0, layers: int = 1) -> LlamaForCausalLM:
    """A random Llama with hidden size 16. The output head is scaled up from its 0.02-std init so the
    next-token distributions are peaked, not near-uniform."""
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    return model


def perturbed_copy(model: torch.nn.Module, noise: float, seed: int) -> torch.nn.Module:
    """A drafter like ``model`` but not too like it: every weight gets Gaussian noise of ``noise`` times
    that tensor's standard deviation."""
    drafter = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in drafter.parameters():
            weight.add_(torch.randn(weight.shape, generator=generator) * noise * weight.std())
    return drafter


def language_model(name: str, tokenizer: PreTrainedTokenizerFast, seed: int,
                   model: torch.nn.Module | None = None) -> LanguageModel:
    """Wrap a tiny Llama (built from ``seed`` unless ``model`` is given) without EOS ids."""
    vocab_size = len(tokenizer)
    return LanguageModel(name, model if model is not None else tiny_llama(vocab_size, seed), tokenizer,
                         torch.device("cpu"), vocab_size, eos_token_ids=frozenset())


@contextmanager
def single_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread, and the test machine's cores are shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@torch.inference_mode()
def sequence_distribution(target: LanguageModel, prompt_ids: list[int], length: int, temperature: float,
                          top_k: int = 0, top_p: float = 1.0) -> dict[tuple[int, ...], float]:
    """Exact probability of every sequence of ``length`` target ids after the prompt (chain rule, one full
    forward pass per prefix, no KV cache). Sequences of probability 0 are left out."""
    distribution = {(): 1.0}
    for _ in range(length):
        extended = {}
        for prefix, prefix_prob in distribution.items():
            logits = target.model(input_ids=torch.tensor([prompt_ids + list(prefix)])).logits[0, -1]
            next_probs = logits_to_probs(logits, temperature, top_k, top_p).double()
            for token_id in torch.nonzero(next_probs).flatten().tolist():
                extended[prefix + (token_id,)] = prefix_prob * float(next_probs[token_id])
        distribution = extended
    return distribution


def chi_square_pvalue(samples: list[tuple[int, ...]], expected_probs: dict[tuple[int, ...], float],
                      min_expected: float = 5.0) -> float:
    """Pearson chi-square p-value of ``samples`` against ``expected_probs``.

    Outcomes expected fewer than ``min_expected`` times are pooled into one bin (with any outcome the
    distribution does not contain), so the chi-square approximation holds.
    """
    total = len(samples)
    observed: dict[tuple[int, ...], int] = {}
    for sample in samples:
        observed[sample] = observed.get(sample, 0) + 1
    large = [outcome for outcome, prob in expected_probs.items() if prob * total >= min_expected]
    observed_counts = [observed.get(outcome, 0) for outcome in large]
    expected_counts = [expected_probs[outcome] * total for outcome in large]
    pooled_expected = total - sum(expected_counts)
    pooled_observed = total - sum(observed_counts)
    if pooled_expected >= 1e-9 * total:
        observed_counts.append(pooled_observed)
        expected_counts.append(pooled_expected)
    elif pooled_observed:
        return 0.0  # outcomes of probability 0 were observed
    scale = total / sum(expected_counts)  # absorb float rounding of the enumerated probabilities
    return float(stats.chisquare(observed_counts, [count * scale for count in expected_counts]).pvalue)


def bigram_llama(next_logits: torch.Tensor) -> LlamaForCausalLM:
    """A 1-layer Llama whose next-token logits are ``next_logits[last token]``  (next_logits: [V, V], V <= 16).

    Attention and MLP write nothing (zero output projections), so the residual stream is the last token's
    one-hot embedding; the final RMSNorm scales it to 4 (hidden size 16) and the head reads column ``last``.
    A bigram model's distribution depends on which tokens spell its context, which is what the drafter-noise
    regression test needs (tests/test_exact_distribution.py).
    """
    vocab_size = next_logits.shape[0]
    model = tiny_llama(vocab_size, seed=0)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(vocab_size, 16))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.copy_(torch.cat([next_logits.T, torch.zeros(vocab_size, 16 - vocab_size)], 1) / 4)
    return model
