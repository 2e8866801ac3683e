"""Request and engine settings (pydantic: unknown fields rejected, every field described, ranges checked)."""

from __future__ import annotations

import math
import secrets
from pathlib import Path
from typing import Literal

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, ValidationInfo, field_validator, model_validator

from hetspec.linear import uses_onednn

Algorithm = Literal["auto", "ar", "sd", "slem", "tli", "slrs"]
ALGORITHMS: tuple[str, ...] = ("auto", "ar", "sd", "slem", "tli", "slrs")


def require_unicode(text: str) -> str:
    """``text`` itself, or a ValueError if it is not valid Unicode text (it holds a lone surrogate).

    Python strings can hold lone surrogates (a JSON escape such as "\\ud800", bytes decoded with
    ``surrogateescape``, e.g. an invalid UTF-8 argument); tokenizers cannot encode them (a TypeError).
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"is not valid Unicode: lone surrogate U+{ord(text[error.start]):04X} at character "
                         f"{error.start}") from None
    return text


# Temperatures above 0 and below this decode greedily (an exact argmax): logits / T overflows float32 for a
# T near 1e-38, and far above that a distribution this sharp is the argmax but for ties anyway.
TEMPERATURE_FLOOR = 1e-4


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @classmethod
    def from_yaml(cls, path: str | Path):
        return cls.model_validate(yaml.safe_load(Path(path).read_text()) or {})

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


class SamplingParams(StrictModel):
    max_new_tokens: int = Field(128, ge=1, le=32768, description="Most tokens to generate.")
    temperature: float = Field(0.0, ge=0.0, le=100.0, description=(
        "0 means greedy (exact argmax); above 0 samples from softmax(logits/T). Below TEMPERATURE_FLOOR (1e-4) "
        "it is taken as 0: greedy."))
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens before sampling; 0 keeps all.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling: keep the smallest set of mass >= top_p.")
    seed: int | None = Field(None, ge=0, lt=2**63, description=(
        "Seed of the per-position random stream (hetspec/sampling.py): the same seed gives the same sample. "
        "None: the request draws a fresh random seed, reported in its statistics (Stats.seed)."))
    stop: list[str] = Field(default_factory=list, max_length=16,
                            description="Generation ends right before the first of these strings to complete "
                                        "(docs/stop-strings.md).")
    ignore_eos: bool = Field(False, description="Keep generating past the end-of-sequence token.")
    stop_token_ids: list[NonNegativeInt] = Field(default_factory=list, max_length=64, description=(
        "Generation ends after any of these target token ids (kept in the output, like EOS); they apply with "
        "ignore_eos too (vLLM's stop_token_ids)."))
    logprobs: int | None = Field(None, ge=0, le=20, description=(
        "Return the target's log-probability of each generated token and of its this-many most likely "
        "alternatives (0: the token's own only); None: none. Raw log-softmax of the target's logits, before "
        "temperature, top-k and top-p (vLLM's default)."))

    @field_validator("temperature", "top_p")
    @classmethod
    def _finite(cls, value: float, info: ValidationInfo) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        if info.field_name == "temperature" and 0.0 < value < TEMPERATURE_FLOOR:
            return 0.0  # greedy, not an overflowing division (TEMPERATURE_FLOOR)
        return value

    def seeded(self) -> "SamplingParams":
        """These parameters with a concrete seed: a fresh random one (from the OS) when none was given."""
        return self if self.seed is not None else self.model_copy(update={"seed": secrets.randbelow(2**63)})

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stops: list[str]) -> list[str]:
        for stop in stops:
            if not stop or len(stop) > 256:
                raise ValueError("each stop string must have 1 to 256 characters")
            require_unicode(stop)
        return stops

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class SpeculationConfig(StrictModel):
    algorithm: Algorithm = Field("auto", description=(
        "ar: target alone; sd: standard speculative decoding (same vocabulary); slem: string-level exact match; "
        "tli: token-level intersection; slrs: string-level rejection sampling; auto: slem for greedy and for "
        "sampling with a given seed (the seed then reproduces the target-only sample at any load), otherwise sd "
        "for identical tokenizers and tli for different ones."))
    draft_tokens: int = Field(5, ge=1, le=64, description="Draft length k (the starting value when adaptive).")
    adaptive: bool = Field(False, description="Grow k by 2 after a fully accepted draft, shrink by 1 after a rejection.")
    min_draft_tokens: int = Field(1, ge=1, le=64, description="Lower bound of the adaptive k.")
    max_draft_tokens: int = Field(16, ge=1, le=64, description="Upper bound of the adaptive k.")
    confidence_threshold: float = Field(0.0, ge=0.0, lt=1.0, description=(
        "Stop a draft early once the drafter's top probability falls below this; 0 disables."))
    tree_width: int = Field(1, ge=1, le=8, description=(
        "SLEM draft tree: branches kept per depth, best drafter path probability first, the drafter's own "
        "chain always among them (one batched drafter pass per depth, one target pass with tree attention); "
        "1 drafts a single chain. Only SLEM (and auto when it picks SLEM) drafts trees."))
    slrs_lookahead: int = Field(1, ge=1, le=4, description=(
        "Drafter tokens per SLRS proposal; above 1 psi is enumerated exactly over all drafter sequences."))
    slrs_enumeration_budget: int = Field(65536, ge=1, description=(
        "Most drafter sequences SLRS may enumerate per proposal; a larger enumeration is refused, never approximated."))
    alignment_window: int = Field(8, ge=1, le=256, description=(
        "Committed tokens re-tokenized together with new text (a bounded window, never the whole context)."))
    load_adaptive: bool = Field(False, description=(
        "Each step, draft (the requests' own length) or not (plain batched decoding), whichever has committed "
        "more tokens per second at the current batch size, as measured (docs/batching.md)."))
    lookup: Literal["off", "auto", "always"] = Field("off", description=(
        "Context lookup drafts (hetspec/lookup.py; prompt lookup decoding, Saxena 2023): the longest suffix of the "
        "request's text (prompt and output, as bytes) that occurred before proposes the text that followed it, "
        "with no drafter pass. auto: a step uses it when it proposes at least lookup_min_draft tokens and its "
        "accepted tokens per draft in the request so far are not clearly below the drafter's; always: whenever "
        "it proposes that many; off: never. Any algorithm, ar included; it changes speed only, never the output."))
    lookup_min_match: int = Field(12, ge=1, le=256, description=(
        "Context lookup: the shortest suffix of the text, in bytes, that counts as a match."))
    lookup_max_match: int = Field(64, ge=1, le=1024, description=(
        "Context lookup: the longest suffix, in bytes, compared when choosing among earlier occurrences."))
    lookup_min_draft: int = Field(2, ge=1, le=64, description=(
        "Context lookup: the fewest target tokens a lookup must propose to be used instead of the drafter."))
    lookup_max_draft: int = Field(16, ge=1, le=64, description=(
        "Context lookup: the most target tokens one lookup draft proposes."))

    @field_validator("tree_width")
    @classmethod
    def _tree_needs_exact_match(cls, tree_width: int, info: ValidationInfo) -> int:
        algorithm = info.data.get("algorithm")
        if tree_width > 1 and algorithm not in ("slem", "auto", "ar"):
            raise ValueError(f"tree_width > 1 needs algorithm slem or auto, not {algorithm!r}: "
                             "trees are verified by exact match")
        return tree_width

    @model_validator(mode="after")
    def _bounds(self) -> "SpeculationConfig":
        if self.min_draft_tokens > self.max_draft_tokens:
            raise ValueError("min_draft_tokens must not exceed max_draft_tokens")
        if self.lookup_min_match > self.lookup_max_match:
            raise ValueError("lookup_min_match must not exceed lookup_max_match")
        if self.lookup_min_draft > self.lookup_max_draft:
            raise ValueError("lookup_min_draft must not exceed lookup_max_draft")
        return self


class BatchingConfig(StrictModel):
    max_batch_size: int = Field(8, ge=1, le=4096, description=(
        "Most requests decoded together; more wait and join as others finish (continuous batching)."))
    prefill_chunk_tokens: int = Field(128, ge=1, le=65536, description=(
        "While other requests decode, a joining prompt is fed at most this many tokens per step, so a long "
        "prompt does not stall their decoding; with nobody decoding it is fed whole with the first verification."))
    pipelined: bool = Field(False, description=(
        "The drafter drafts each next step ahead, on a second thread, while the target verifies, assuming the "
        "whole draft accepted (hetspec/ahead.py): it pays where the models have their own cores or devices; on "
        "one CPU the two models share the cores and a missed guess is drafter work thrown away."))


class ModelConfig(StrictModel):
    model: str = Field(description="Short name (smollm2-135m, gemma3-270m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b), "
                                   ".gguf file, local folder or Hugging Face model id.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights and activations dtype.")
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$", description="cpu, cuda or cuda:N.")
    threads: int | None = Field(None, ge=1, le=256, description="torch intra-op threads; None keeps torch's default.")
    quantize: Literal["none", "int8", "int8-weight-only"] = Field("none", description=(
        "Meant for the drafter: it changes proposals and speed, never the output (CPU only; loads float32 weights "
        "first). int8: torch's dynamic int8 Linear layers (weights and inputs quantized); int8-weight-only: int8 "
        "weights per output channel with float inputs (hetspec/int8.py), a drafter that agrees with its float "
        "model far more often (SmolLM2-135M: 93% of next-token argmaxes against 33%), fast where bfloat16 is "
        "native."))
    forward: Literal["auto", "lean", "transformers"] = Field("auto", description=(
        "Who runs the model's passes: lean is hetspec's own forward for Llama-family models (hetspec/lean.py: "
        "~1.3x a small int8 drafter's pass on a CPU), transformers the model's own; auto is lean for an int8 "
        "model it supports and transformers otherwise."))
    linear: Literal["auto", "onednn", "torch"] = Field("auto", description=(
        "Kernels of the float32 Linear layers on the CPU: onednn converts their weights once for oneDNN "
        "(hetspec/linear.py; a target pass ~2x faster on an AMD EPYC), torch keeps torch's default, auto is "
        "onednn for float32 on the CPU and torch otherwise."))
    bit_exact: bool = Field(False, description=(
        "Attention computes each query alone over exactly the keys it sees (hetspec/exact.py): with row-invariant "
        "Linear kernels (bfloat16 on this project's CPUs) a position's logits are bit-identical whatever shares "
        "its pass (draft length, batch, prompt chunks, trees), so greedy and seeded outputs never depend on load. "
        "Costs a kernel call per query and layer; the load-time self-check reports whether it holds "
        "(docs/losslessness.md)."))

    @model_validator(mode="after")
    def _kernels_fit(self) -> "ModelConfig":
        if self.quantize != "none" and self.device != "cpu":
            raise ValueError(f"quantize: {self.quantize} runs on the CPU only")
        uses_onednn(self.linear, getattr(torch, self.dtype), self.device, self.quantize)  # raises where it cannot
        return self
