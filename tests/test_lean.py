"""hetspec's lean forward (hetspec/lean.py) and weight-only int8 layers (hetspec/int8.py)."""

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from hetspec import Engine, SamplingParams, SpeculationConfig, kv, load_model
from hetspec.exact import LAYOUTS, compare_layouts, make_exact
from hetspec.int8 import Int8WeightLinear, quantize_weights
from hetspec.forward import forward
from hetspec.kv import Feed
from hetspec.lean import LeanDecoder, uses_lean
from hetspec.models import LanguageModel

TEXT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n" * 4


def _tiny(kind: str, dtype: torch.dtype) -> LanguageModel:
    """A small random Llama or Qwen2 (q/k/v biases), grouped-query attention, in ``dtype``."""
    torch.manual_seed(0)
    shape = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512)
    model = (LlamaForCausalLM(LlamaConfig(**shape)) if kind == "llama"
             else Qwen2ForCausalLM(Qwen2Config(**shape))).to(dtype).eval()
    return LanguageModel(name=kind, model=model, tokenizer=None, device=torch.device("cpu"), vocab_size=300)


def _passes(model: LanguageModel) -> list[torch.Tensor]:
    """Logits of every kind of pass: prefills, a padded batch, a packed batch with a prompt chunk, a tree, and
    a request alone decoding one token (the pass without a mask)."""
    ids = [(7 * index) % 300 for index in range(60)]
    first, second, third = model.new_session(), model.new_session(), model.new_session()
    try:
        logits = [first.extend(ids[:40], 2), second.extend(ids[:25], 3)]
        logits += forward(model, [Feed(first, ids[40:41]), Feed(second, ids[25:29], 4)], packed=False)
        logits += forward(model, [Feed(first, ids[41:42]), Feed(second, ids[29:30]), Feed(third, ids[:20], 2)],
                          packed=True)
        logits += forward(model, [Feed(first, ids[42:45], 3, parents=[-1, 0, 0])])
        first.keep(list(range(42)) + [42, 44])
        logits.append(first.extend(ids[45:46]))
    finally:
        for session in (first, second, third):
            session.release()
    return logits


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lean_forward_computes_what_transformers_computes_in_every_layout(kind, dtype):
    model = _tiny(kind, dtype)
    reference = _passes(model)
    model.lean = LeanDecoder(model.model)
    ours = _passes(model)
    # bfloat16: equal here; the bound leaves room for another CPU's kernels, below what a wrong rotation makes (4e-3)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-3
    for expected, got in zip(reference, ours, strict=True):
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=tolerance, rtol=0)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_bit_exact_lean_forward_is_bit_exact_and_computes_what_transformers_computes(kind):
    """Loaded bit_exact (hetspec/exact.py), the lean forward attends one query at a time too: every layout gives
    the transformers forward's bits, and every position the bits of a one-position pass."""
    model = _tiny(kind, torch.bfloat16)
    make_exact(model.model)
    reference = _passes(model)
    model.lean = LeanDecoder(model.model)
    assert model.lean.exact
    for expected, got in zip(reference, _passes(model), strict=True):
        assert torch.equal(got, expected)
    assert compare_layouts(model) == dict.fromkeys(LAYOUTS, True)


def test_the_lean_forward_runs_int8_drafters_only_where_asked_and_refuses_what_it_cannot_run(gemma, smollm):
    assert smollm.lean is None and gemma.lean is None  # float models keep transformers' forward unless asked
    assert uses_lean("auto", smollm.model, "int8") and not uses_lean("transformers", smollm.model, "int8")
    assert not uses_lean("auto", gemma.model, "int8")  # gemma3: sliding-window layers, its own norms
    with pytest.raises(ValueError, match="gemma3_text"):
        uses_lean("lean", gemma.model, "none")
    with pytest.raises(ValueError, match="forward must be one of"):
        load_model("smollm2-135m", forward="fast")


def test_int8_weight_layers_match_their_float_layer_and_concatenate_exactly():
    torch.manual_seed(0)
    parts = [torch.nn.Linear(96, out, bias=bias) for out, bias in ((64, True), (32, False))]
    quantized = [Int8WeightLinear.from_linear(part) for part in parts]
    hidden = torch.randn(3, 5, 96)  # [batch, tokens, in_features]
    for part, layer in zip(parts, quantized):
        expected = part(hidden).detach()
        assert (layer(hidden) - expected).abs().max() < 0.02 * expected.abs().max()
    alone = torch.cat([layer(hidden) for layer in quantized], -1)
    joined = Int8WeightLinear.concatenated(quantized)
    assert torch.equal(joined(hidden), alone)
    assert torch.equal(torch.cat([layer(hidden) for layer in quantized], -1), alone)  # the parts, now views
    assert quantized[1].weight_int8.untyped_storage().data_ptr() == joined.weight_int8.untyped_storage().data_ptr()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    assert quantize_weights(model) == 2 and all(type(model[index]) is Int8WeightLinear for index in (0, 2))


def _agreement(model: LanguageModel, reference_logits: torch.Tensor, ids: list[int]) -> float:
    session = model.new_session()
    try:
        logits = session.extend(ids)
    finally:
        session.release()
    return (logits.argmax(-1) == reference_logits.argmax(-1)).float().mean().item()


def test_a_weight_only_int8_drafter_agrees_with_its_float_model_where_dynamic_int8_does_not(smollm):
    # why int8-weight-only exists (hetspec/int8.py): dynamic int8 rounds SmolLM2's outlier activations away;
    # the text: the start of one of this repository's modules (prose and code)
    ids = smollm.encode(Path(kv.__file__).read_text()[:3000])[:300]
    session = smollm.new_session()
    reference = session.extend(ids)
    session.release()
    weight_only = load_model("smollm2-135m", quantize="int8-weight-only")
    dynamic = load_model("smollm2-135m", quantize="int8")
    assert weight_only.lean is not None and dynamic.lean is not None  # auto: int8 drafters run lean
    assert _agreement(weight_only, reference, ids) > 0.85 > 0.5 > _agreement(dynamic, reference, ids)


@pytest.mark.parametrize("quantize", ["int8", "int8-weight-only"])
def test_a_lean_int8_drafter_changes_speed_never_the_output(gemma, quantize):
    drafter = load_model("smollm2-135m", quantize=quantize)
    assert drafter.lean is not None
    engine = Engine(gemma, drafter)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    reference = engine.generate(TEXT, params, speculation=SpeculationConfig(algorithm="ar")).token_ids
    for speculation in (SpeculationConfig(algorithm="slem", draft_tokens=4),
                        SpeculationConfig(algorithm="slem", draft_tokens=3, tree_width=2)):
        result = engine.generate(TEXT, params, speculation=speculation)
        assert result.token_ids == reference and result.stats.accepted_tokens > 0
    with pytest.raises(ValueError, match="CPU only"):
        load_model("smollm2-135m", quantize=quantize, device="cuda")
