"""Weight-only int8 Linear layers for a CPU drafter (``quantize="int8-weight-only"``).

Why not only torch's dynamic int8 (``quantize="int8"``): it also quantizes each layer's input, one scale for the
whole activation, and SmolLM2-135M's activations have outlier channels (its MLP's down projection above all), so
its next-token argmax agrees with the float32 model's on 33% of the positions of a text of prose and code (weights
per channel do not help: 33%) and on 61-63% over HumanEval prompts and completions; with the inputs left in
floating point and the weights int8 per output channel, 93% and 97% (tests/test_lean.py checks the first;
docs/decisions/drafter-int8-weight-only-lean.md the second: 2.75 tokens a target pass against 2.35). A drafter
that agrees with the float model more often is accepted more often, and its weights still stream as int8.

The matmul is ``torch._weight_int8pack_mm`` (bfloat16 input, int8 weight, a bfloat16 scale per output channel):
the CPU kernel torchao's int8 weight-only config dispatches to, called directly because torchao's tensor
subclass adds a Python dispatch to every call, which is what a small model's pass can least afford. The layer
takes and returns float32 (the residual stream and the KV cache stay float32); only the matmul's input is
rounded to bfloat16. Needs a CPU with bfloat16 instructions to be fast (``hetspec.linear.native_bfloat16``).
"""

from __future__ import annotations

import torch


class Int8WeightLinear(torch.nn.Module):
    """y = x W^T + b with W int8 per output channel (W ~ weight_int8 * scales[:, None])."""

    def __init__(self, weight_int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.register_buffer("weight_int8", weight_int8)  # [out_features, in_features] int8
        self.register_buffer("scales", scales)  # [out_features] bfloat16
        self.register_buffer("bias", bias)  # [out_features] float32 or None

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> "Int8WeightLinear":
        weight = linear.weight.detach().float()  # [out_features, in_features]
        scales = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        weight_int8 = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
        bias = None if linear.bias is None else linear.bias.detach().float()
        return cls(weight_int8, scales.to(torch.bfloat16), bias)

    @classmethod
    def concatenated(cls, parts: list["Int8WeightLinear"]) -> "Int8WeightLinear":
        """One layer computing ``parts`` side by side (exact: each output channel keeps its weights and scale).
        The parts then hold views of its tensors, so the weights are stored once."""
        biases = [part.bias for part in parts]
        bias = None if all(b is None for b in biases) else torch.cat(
            [torch.zeros(part.out_features) if b is None else b for part, b in zip(parts, biases)])
        joined = cls(torch.cat([part.weight_int8 for part in parts]), torch.cat([part.scales for part in parts]), bias)
        start = 0
        for part in parts:
            rows = slice(start, start + part.out_features)
            part.weight_int8, part.scales = joined.weight_int8[rows], joined.scales[rows]
            if part.bias is not None:
                part.bias = joined.bias[rows]
            start += part.out_features
        return joined

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., in_features] float32 -> [..., out_features]
        rows = hidden.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch._weight_int8pack_mm(rows, self.weight_int8, self.scales).float()
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*hidden.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_weights(model: torch.nn.Module) -> int:
    """Replace every float ``nn.Linear`` of ``model`` by an ``Int8WeightLinear``; returns how many."""
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(module, name, Int8WeightLinear.from_linear(child))
                replaced += 1
    return replaced
