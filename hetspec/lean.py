"""A lean forward for Llama-family decoders (``llama``, ``qwen2``) over hetspec's KV pool.

Why beside transformers' forward: for a small drafter on a CPU, about half of a one-token pass is Python and
dispatch outside the ops (SmolLM2-135M int8: ~20 ms a pass, ~12 ms of it in ops), and transformers' decoder
layers, attention interface, cache and mask plumbing are most of that. This forward computes the same layers
with the model's own weights and rotary embedding, writes keys and values straight into the pool through the
pass's layout (hetspec/layouts.py), skips the mask where a query sees every key, and in an int8-quantized
model multiplies q/k/v and gate/up as one quantized layer each (4 matmuls and input roundings a layer instead of
7: 121 a pass instead of 211). SmolLM2-135M's forward while drafting on this project's 2-core CPU: dynamic int8
28.1 -> 19.7 ms, weight-only int8 31.6 -> 24.4 ms (docs/decisions/drafter-int8-weight-only-lean.md).

Weight-only int8 layers (hetspec/int8.py) are joined exactly. Dynamic int8 layers are requantized per output
channel from their dequantized weights, so such a model's logits differ from its transformers forward's (both
approximate the float weights): a drafter's proposals change, never the output. Float layers are the model's own
modules, called in transformers' order.

Supported: ``llama`` and ``qwen2`` models whose layers all use full attention (``unsupported`` says why not);
anything else keeps transformers' forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hetspec.exact import exact_attention, uses_exact_attention
from hetspec.int8 import Int8WeightLinear

SUPPORTED_TYPES = ("llama", "qwen2")
_DynamicInt8 = torch.ao.nn.quantized.dynamic.Linear


def unsupported(model: torch.nn.Module) -> str | None:
    """Why ``LeanDecoder`` cannot run ``model``, or None."""
    config = model.config
    if config.model_type not in SUPPORTED_TYPES:
        return f"model type {config.model_type!r} (supported: {', '.join(SUPPORTED_TYPES)})"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return "sliding-window layers"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    return None


FORWARDS = ("auto", "lean", "transformers")


def uses_lean(forward: str, model: torch.nn.Module, quantize: str) -> bool:
    """Whether ``forward`` runs ``model`` lean: "lean" insists (raises where unsupported), "transformers" never,
    "auto" for an int8-quantized model (either kind) it supports: a drafter, 1.3-1.4x a pass (this module's
    docstring). Float models stay on transformers' forward, the reference: the ~8 ms of plumbing a pass saves
    (SmolLM2's 30 layers) would be ~4% of Qwen2.5-Coder-1.5B's ~190 ms bfloat16 pass (28 layers; not measured)."""
    if forward not in FORWARDS:
        raise ValueError(f"forward must be one of {FORWARDS}, got {forward!r}")
    reason = unsupported(model)
    if forward == "lean" and reason:
        raise ValueError(f"forward='lean' does not support {reason}")
    return forward == "lean" or (forward == "auto" and quantize != "none" and reason is None)


def _fused_int8(parts: list[_DynamicInt8]) -> _DynamicInt8:
    """One dynamic int8 layer computing ``parts`` side by side, quantized per output channel."""
    weight = torch.cat([part.weight().dequantize() for part in parts])  # [sum of out_features, in_features]
    biases = [part.bias() for part in parts]
    dense = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=biases[0] is not None)
    dense.weight.data = weight
    if dense.bias is not None:
        dense.bias.data = torch.cat(biases)
    wrapper = torch.nn.Sequential(dense)  # quantize_dynamic converts children only
    return torch.ao.quantization.quantize_dynamic(
        wrapper, {torch.nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig})[0]


class _Layer:
    def __init__(self, layer: torch.nn.Module):
        attention, mlp = layer.self_attn, layer.mlp
        self.input_norm, self.post_attention_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.o_proj, self.down_proj, self.act_fn = attention.o_proj, mlp.down_proj, mlp.act_fn
        self.scaling = attention.scaling
        qkv = [attention.q_proj, attention.k_proj, attention.v_proj]
        gate_up = [mlp.gate_proj, mlp.up_proj]
        self.qkv, self.gate_up = _fused(qkv), _fused(gate_up)


def _fused(parts: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """``parts`` as one int8 layer where they are int8 (fewer calls, one activation rounding), else as they are."""
    if all(type(part) is Int8WeightLinear for part in parts):
        return [Int8WeightLinear.concatenated(parts)]
    if all(type(part) is _DynamicInt8 for part in parts):
        return [_fused_int8(parts)]
    return parts


def _side_by_side(parts: list[torch.nn.Module], hidden: torch.Tensor) -> torch.Tensor:
    """The parts' outputs joined on the last dimension (one call where ``_fused`` joined them)."""
    return parts[0](hidden) if len(parts) == 1 else torch.cat([part(hidden) for part in parts], -1)


def _norm(norm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``LlamaRMSNorm``/``Qwen2RMSNorm``'s computation, in its order (bitwise the same), without a module call."""
    states = hidden.to(torch.float32)
    states = states * torch.rsqrt(states.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * states.to(hidden.dtype)


class LeanDecoder(torch.nn.Module):
    """The model's forward over a pass of hetspec's KV pool (``hetspec.forward.forward`` calls it).

    A module so that forward hooks on it see every pass, as they see the transformers model's."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        if reason := unsupported(model):
            raise ValueError(f"the lean forward does not support {reason}")
        config = model.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        decoder = model.model
        self.head_dim = decoder.layers[0].self_attn.head_dim
        self.embed_tokens, self.rotary_emb, self.norm = decoder.embed_tokens, decoder.rotary_emb, decoder.norm
        self.lm_head = model.lm_head
        self.exact = uses_exact_attention(model)  # loaded bit_exact: each query alone (hetspec/exact.py)
        # plain objects, not submodules: the model owns the shared modules, the fused layers are ours alone
        self._layers = [_Layer(layer) for layer in decoder.layers]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                cache, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        """input_ids, position_ids: [batch, queries]; attention_mask: additive [batch, 1, queries, keys] or None
        (every query sees every key); ``cache``: the pass's ``write``/``read`` of the pool's buffers
        (hetspec/layouts.py); ``logits_to_keep``: a count of last positions or their indices.
        -> [batch, kept, vocab]"""
        hidden = self.embed_tokens(input_ids)  # [batch, queries, hidden]
        batch, queries, _ = hidden.shape
        cos, sin = self.rotary_emb(hidden, position_ids)  # [batch, queries, head_dim]
        half = self.head_dim // 2
        cos = cos[:, None]
        # rotate_half(x) * sin == roll(x, half) * (sin with its first half negated): one roll, no cat per layer
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), -1)[:, None]
        pool_keys, pool_values = cache.pool.keys, cache.pool.values
        rotated_heads = self.heads + self.kv_heads
        for index, layer in enumerate(self._layers):
            normed = _norm(layer.input_norm, hidden)
            qkv = _side_by_side(layer.qkv, normed)
            qkv = qkv.view(batch, queries, rotated_heads + self.kv_heads, self.head_dim).transpose(1, 2)
            rotated = qkv[:, :rotated_heads]  # queries' and keys' heads: [batch, heads + kv_heads, queries, head_dim]
            rotated = rotated * cos + rotated.roll(half, -1) * signed_sin
            query_states, key_states = rotated[:, :self.heads], rotated[:, self.heads:]
            cache.write(pool_keys[index], key_states)
            cache.write(pool_values[index], qkv[:, rotated_heads:])
            if self.exact:
                attended = exact_attention(None, query_states, cache.read(pool_keys[index]),
                                           cache.read(pool_values[index]), attention_mask,
                                           scaling=layer.scaling)[0].transpose(1, 2)
            else:
                attended = F.scaled_dot_product_attention(
                    query_states, cache.read(pool_keys[index]), cache.read(pool_values[index]),
                    attn_mask=attention_mask, scale=layer.scaling, enable_gqa=self.kv_heads != self.heads)
            hidden = hidden + layer.o_proj(attended.transpose(1, 2).reshape(batch, queries, -1))
            normed = _norm(layer.post_attention_norm, hidden)
            gate, up = _side_by_side(layer.gate_up, normed).chunk(2, -1)
            hidden = hidden + layer.down_proj(layer.act_fn(gate) * up)
        kept = hidden[:, -logits_to_keep:] if isinstance(logits_to_keep, int) else hidden[:, logits_to_keep]
        return self.lm_head(_norm(self.norm, kept))
