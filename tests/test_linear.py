"""float32 Linear layers through oneDNN (hetspec/linear.py): the same products, every float32 layer converted,
quantized and other-dtype layers left alone, and a converted real model decoding as the unconverted one."""

from __future__ import annotations

import pytest
import torch

from hetspec import Engine, SamplingParams, SpeculationConfig, load_model
from hetspec import linear
from hetspec.linear import OneDNNLinear, convert_linear_layers, slow_dtype_warning, uses_onednn


@pytest.mark.parametrize("bias", [True, False])
def test_onednn_linear_computes_the_linear_layer_for_any_leading_dimensions(bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 40, bias=bias)
    converted = OneDNNLinear(linear)
    for shape in [(96,), (3, 96), (2, 5, 96), (2, 1, 4, 96)]:
        hidden = torch.randn(shape)
        with torch.no_grad():
            assert torch.allclose(converted(hidden), linear(hidden), atol=1e-5), shape
        assert converted(hidden).shape == (*shape[:-1], 40)
    with torch.no_grad():  # a non-contiguous input (a slice, as the last position of a pass)
        hidden = torch.randn(2, 6, 96)[:, -1:, :]
        assert torch.allclose(converted(hidden), linear(hidden), atol=1e-5)


def test_only_float32_linear_layers_are_converted():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()),
                                torch.nn.Linear(8, 8).to(torch.bfloat16), torch.nn.Embedding(4, 8))
    quantized = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(torch.nn.Linear(8, 8)), {torch.nn.Linear},
                                                       dtype=torch.qint8)
    assert convert_linear_layers(model) == 2 and convert_linear_layers(quantized) == 0
    assert isinstance(model[0], OneDNNLinear) and isinstance(model[1][0], OneDNNLinear)
    assert type(model[2]) is torch.nn.Linear and type(model[3]) is torch.nn.Embedding


def test_auto_converts_float32_on_the_cpu_only_and_onednn_refuses_what_it_cannot_convert():
    assert uses_onednn("auto", torch.float32, "cpu") == torch.backends.mkldnn.is_available()
    assert not uses_onednn("auto", torch.bfloat16, "cpu") and not uses_onednn("auto", torch.float32, "cuda")
    assert not uses_onednn("torch", torch.float32, "cpu")
    with pytest.raises(ValueError, match="float32 models on the CPU"):
        uses_onednn("onednn", torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="linear must be one of"):
        uses_onednn("mkl", torch.float32, "cpu")
    with pytest.raises(ValueError, match="quantize='int8' leaves none"):
        load_model("smollm2-135m", quantize="int8", linear="onednn")
    assert not uses_onednn("auto", torch.float32, "cpu", quantize="int8")


def test_a_model_config_is_checked_by_the_same_rule_before_anything_loads():
    from pydantic import ValidationError

    from hetspec.config import ModelConfig

    with pytest.raises(ValidationError, match="quantize='int8' leaves none"):
        ModelConfig(model="smollm2-135m", quantize="int8", linear="onednn")
    with pytest.raises(ValidationError, match="float32 models on the CPU"):
        ModelConfig(model="smollm2-135m", dtype="bfloat16", linear="onednn")
    assert ModelConfig(model="smollm2-135m", dtype="bfloat16", quantize="none").linear == "auto"


def test_bfloat16_on_a_cpu_without_native_instructions_is_named_as_slow_at_load(monkeypatch, caplog):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert not linear.native_bfloat16()
    assert "float32" in slow_dtype_warning(torch.bfloat16, "cpu")
    for dtype, device in ((torch.float32, "cpu"), (torch.bfloat16, "cuda"), (torch.bfloat16, "cuda:1")):
        assert slow_dtype_warning(dtype, device) is None
    with caplog.at_level("WARNING", logger="hetspec.models"):
        load_model("smollm2-135m", dtype="bfloat16")
    assert "smollm2-135m: bfloat16 on this CPU has no native instructions" in caplog.text
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert linear.native_bfloat16() and slow_dtype_warning(torch.bfloat16, "cpu") is None


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
def test_a_converted_model_decodes_as_torch_kernels_do(gemma, smollm):
    """The suite's float32 models are converted (``linear="auto"``); one loaded with torch's kernels gives the
    same greedy tokens, alone and with a drafter, and logits within float32 rounding."""
    assert any(isinstance(module, OneDNNLinear) for module in gemma.model.modules())
    plain = load_model("gemma3-270m", dtype="float32", linear="torch")
    assert not any(isinstance(module, OneDNNLinear) for module in plain.model.modules())
    prompt_ids = gemma.encode("The capital of France is")
    sessions = [gemma.new_session(), plain.new_session()]
    converted_logits, plain_logits = (session.extend(prompt_ids, len(prompt_ids)) for session in sessions)
    assert float((converted_logits - plain_logits).abs().max()) < 1e-3  # [prompt, vocab], logits of size ~10
    for session in sessions:
        session.release()
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    alone = Engine(plain).generate("def fibonacci(n):", params, speculation=SpeculationConfig(algorithm="ar"))
    for algorithm in ("ar", "slem"):
        result = Engine(gemma, smollm).generate("def fibonacci(n):", params,
                                                speculation=SpeculationConfig(algorithm=algorithm))
        assert result.token_ids == alone.token_ids, algorithm
