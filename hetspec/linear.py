"""float32 Linear layers on the CPU through oneDNN with their weights converted once (``linear="onednn"``), and
whether bfloat16 is native on this CPU (``slow_dtype_warning``).

torch's default float32 ``Linear`` on the CPU calls MKL's sgemm. On this project's AMD EPYC machine that path
makes a pass over a few tokens cost about two passes of one (Qwen2.5-Coder-1.5B, 150-token context: 361 ms for
1 token, 797 ms for 6), which is exactly the width speculation and batching feed; oneDNN's kernels with the
weights held in oneDNN's own format take 204 ms for 1 token and 396 ms for 6, logits within 3e-5
(docs/decisions/dtype-and-kernels-on-cpu.md). torch ships the conversion (``torch.utils.mkldnn.to_mkldnn``)
only as TorchScript modules, deprecated in this torch; ``OneDNNLinear`` is the same call
(``aten.mkldnn_linear``) in a plain module.

Only the model's own ``nn.Linear`` layers in float32 on the CPU are converted: int8-quantized layers, other
dtypes and devices keep torch's kernels. The dense weight is dropped, so each weight is held once, except a tied
output layer's: the embedding keeps using the dense one, and the oneDNN copy is extra (0.9 GB for Qwen-1.5B).
"""

from __future__ import annotations

import torch

BACKENDS = ("auto", "onednn", "torch")


class OneDNNLinear(torch.nn.Module):
    """y = x W^T + b with W (and b) held as oneDNN tensors; any number of leading dimensions."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # not parameters or buffers: oneDNN tensors have no storage to save, move or share
        self.onednn_weight = linear.weight.detach().to_mkldnn()  # [out_features, in_features]
        self.onednn_bias = None if linear.bias is None else linear.bias.detach().to_mkldnn()  # [out_features]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., in_features] -> [..., out_features]
        rows = hidden.reshape(-1, self.in_features).contiguous().to_mkldnn()
        out = torch.ops.aten.mkldnn_linear(rows, self.onednn_weight, self.onednn_bias).to_dense()
        return out.reshape(*hidden.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.onednn_bias is not None}"


def uses_onednn(backend: str, dtype: torch.dtype, device: torch.device | str, quantize: str = "none") -> bool:
    """Whether ``backend`` converts a model of ``dtype`` on ``device``: float32 on the CPU, not quantized, oneDNN in
    this torch. The one place this rule is written: ``hetspec.config.ModelConfig`` checks a config with it before
    anything loads, ``hetspec.models.load_model`` a call's arguments."""
    if backend not in BACKENDS:
        raise ValueError(f"linear must be one of {BACKENDS}, got {backend!r}")
    if backend == "onednn" and quantize != "none":
        raise ValueError(f"linear='onednn' converts float32 layers; quantize={quantize!r} leaves none")
    fits = dtype == torch.float32 and torch.device(device).type == "cpu"
    if backend == "onednn" and not fits:
        raise ValueError("linear='onednn' is for float32 models on the CPU")
    if backend == "onednn" and not torch.backends.mkldnn.is_available():
        raise ValueError("linear='onednn': this torch was built without oneDNN")
    return quantize == "none" and (backend == "onednn" or (backend == "auto" and fits
                                                           and torch.backends.mkldnn.is_available()))


def native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX), as torch's CPU kernels see it."""
    # torch.cpu's probes are private, but they are what its kernels dispatch on (cpuinfo), on every OS
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def slow_dtype_warning(dtype: torch.dtype, device: torch.device | str) -> str | None:
    """Why ``dtype`` makes passes slow on this device, or None. bfloat16 on a CPU without native instructions is
    emulated: a pass over n tokens costs nearly n passes of one (Qwen2.5-Coder-1.5B on a 2-core AVX2-only EPYC:
    243 ms for 1 token, 898 ms for 6; with avx512_bf16 189 ms and 207 ms), so neither speculation nor batching pays
    there, and float32 on oneDNN was faster at every width (docs/decisions/dtype-and-kernels-on-cpu.md)."""
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu" or native_bfloat16():
        return None
    return ("bfloat16 on this CPU has no native instructions (no AVX512-BF16 or AMX): a pass over n tokens costs "
            "about n passes of one, so speculation and batching cannot pay; dtype float32 (its Linear layers on "
            "oneDNN, linear='auto') is faster here")


def convert_linear_layers(model: torch.nn.Module) -> int:
    """Replace every float32 ``nn.Linear`` of ``model`` by a ``OneDNNLinear``; returns how many."""
    converted = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear and child.weight.dtype == torch.float32:
                setattr(module, name, OneDNNLinear(child))
                converted += 1
    return converted
