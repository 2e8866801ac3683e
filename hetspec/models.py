"""Causal language models and their loading.

``load_model`` accepts a built-in short name (see ``registry``), a ``.gguf`` file, a local model
folder or a Hugging Face model id. Each model's requests share one batched KV cache (``hetspec.kv``):
``new_session`` gives a request its row; ``extend`` feeds new tokens and returns their logits,
``rollback`` cuts the cache back to any earlier length, ``hetspec.forward.forward`` feeds many rows at once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from dataclasses import dataclass, field
from functools import cached_property, partial
from pathlib import Path
from typing import Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from hetspec import exact, registry
from hetspec.config import require_unicode
from hetspec.int8 import quantize_weights
from hetspec.forward import forward
from hetspec.kv import KVPool, KVSession
from hetspec.lean import FORWARDS, LeanDecoder, uses_lean
from hetspec.linear import convert_linear_layers, slow_dtype_warning, uses_onednn

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZE = ("none", "int8", "int8-weight-only")


@dataclass(repr=False)
class LanguageModel:
    name: str
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    vocab_size: int  # width of the logits; may exceed len(tokenizer) (padded embedding rows)
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    lean: LeanDecoder | None = None  # runs the passes instead of ``model``'s forward (hetspec/lean.py)

    @cached_property
    def bit_exact(self) -> bool:
        """Whether a position's logits have the same bits in every pass layout as in a one-position pass: the
        self-check of hetspec/exact.py, run once (at load by the server's workers), its answer logged."""
        return exact.self_check(self)

    def __repr__(self) -> str:
        return f"LanguageModel({self.name!r}, vocab_size={self.vocab_size}, device={self.device})"

    def new_session(self) -> KVSession:
        return KVSession(self.kv_pool, partial(forward, self))

    @cached_property
    def kv_pool(self) -> KVPool:
        """The KV buffers every session of this model takes a row of."""
        return KVPool(self.model, self.device)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode_prompt(self, prompt: str) -> list[int]:
        """Token ids of a prompt, with the BOS token this model's tokenizer is configured to add."""
        if not isinstance(prompt, str):
            raise TypeError(f"the prompt must be a str, not {type(prompt).__name__}")
        try:
            require_unicode(prompt)
        except ValueError as error:
            raise ValueError(f"the prompt {error}") from None
        ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        if not ids:
            raise ValueError("the prompt encodes to no tokens")
        return ids

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if not self.tokenizer.chat_template:
            raise ValueError(f"model {self.name} has no chat template; send a plain prompt instead")
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("content"), str):
                raise TypeError(f"messages[{index}] must be a dict whose content is a str")
            try:
                require_unicode(message["content"])
            except ValueError as error:
                raise ValueError(f"messages[{index}].content {error}") from None
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False))


def _conversion_dir(gguf_path: Path, kind: str) -> Path:
    key = hashlib.sha256(f"{gguf_path.resolve()}:{gguf_path.stat().st_size}".encode()).hexdigest()[:16]
    return registry.cache_dir() / "converted" / f"{key}-{kind}"


def _gguf_tokenizer(gguf_path: Path) -> PreTrainedTokenizerBase:
    tokenizer_dir = _conversion_dir(gguf_path, "tokenizer")
    if (tokenizer_dir / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    _save_atomically(tokenizer, tokenizer_dir)
    return tokenizer


def _load_gguf(gguf_path: Path, dtype: str) -> tuple[PreTrainedTokenizerBase, torch.nn.Module]:
    """GGUF conversion is slow (Gemma's 262k-token tokenizer ~25 s, de-quantisation up to a minute):
    do it once per file and dtype, keep the result as a transformers folder, load that afterwards."""
    tokenizer = _gguf_tokenizer(gguf_path)
    model_dir = _conversion_dir(gguf_path, dtype)
    if (model_dir / "config.json").exists():
        return tokenizer, AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype])
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=DTYPES[dtype])
    # The weights are de-quantised by now; the GGUF "quantizer" left on the model only blocks saving.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _save_atomically(model, model_dir)
    del model
    # Every load, the first included, reads the converted folder, so every process computes the same logits.
    return tokenizer, AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype])


def _save_atomically(obj, folder: Path) -> None:
    """Several processes (Ray actors, test workers) may convert the same file at once: write, then rename."""
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    obj.save_pretrained(partial)
    try:
        partial.rename(folder)
    except OSError:  # another process finished first; its copy is as good as ours
        shutil.rmtree(partial, ignore_errors=True)


def resolve_source(spec: str, progress: Callable[[str], None] | None = None) -> tuple[str, str | None]:
    """Map a model spec to (``from_pretrained`` location, GGUF file name or None)."""
    if spec in registry.OFFLINE_MODELS:
        path = registry.resolve(spec, progress)
        return str(path.parent), path.name
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {spec} does not exist")
        return str(path.parent), path.name
    if path.is_dir():
        return str(path), None
    if spec.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model folder {spec} does not exist")
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        return spec, None  # a Hugging Face model id
    known = ", ".join(sorted(registry.OFFLINE_MODELS))
    raise ValueError(f"model {spec!r} is not a short name ({known}), a .gguf file, a folder or a hub id")


def load_tokenizer(spec: str, progress: Callable[[str], None] | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of ``load_model(spec)`` alone, without the weights (text tools, benchmarks' replays)."""
    location, gguf_file = resolve_source(spec, progress)
    return _gguf_tokenizer(Path(location) / gguf_file) if gguf_file else AutoTokenizer.from_pretrained(location)


def load_model(spec: str, dtype: str = "float32", device: str = "cpu", threads: int | None = None,
               progress: Callable[[str], None] | None = None, quantize: str = "none",
               linear: str = "auto", forward: str = "auto", bit_exact: bool = False) -> LanguageModel:
    """``quantize="int8"``: int8 dynamic quantization of every Linear layer (torch.ao, CPU; weights loaded in
    float32 first, ``dtype`` then applies to nothing else). For drafters: it changes their proposals, never
    the output, and a 135M drafter's step drops ~2x on a 2-core CPU (benchmarks/README.md).
    ``quantize="int8-weight-only"``: int8 weights per output channel, float inputs (``hetspec.int8``): a drafter
    that agrees with its float model far more often than dynamic int8's, as cheap a step where bfloat16 is native.
    ``linear``: "auto" runs float32 Linear layers on the CPU through oneDNN with weights converted once
    (hetspec/linear.py: ~2x faster passes on this project's CPU), "onednn" insists, "torch" keeps torch's.
    ``forward``: "auto" runs an int8-quantized Llama-family model through ``hetspec.lean.LeanDecoder`` (a drafter's
    pass 1.3-1.4x faster), "lean" insists (Llama-family models only), "transformers" keeps the model's forward.
    ``bit_exact``: attention computes each query alone over exactly its keys, and Linear layers too wide to be
    row-invariant go row by row (hetspec/exact.py), so that (bfloat16 here) a position's logits do not depend on
    what shares its pass; the model's own ``generate`` runs the same. ``LanguageModel.bit_exact`` checks it."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if forward not in FORWARDS:
        raise ValueError(f"forward must be one of {FORWARDS}, got {forward!r}")
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {QUANTIZE}, got {quantize!r}")
    if quantize != "none":
        if device != "cpu":
            raise ValueError(f"quantize={quantize!r} (int8 CPU kernels) runs on the CPU only")
        dtype = "float32"
    onednn = uses_onednn(linear, DTYPES[dtype], device, quantize)
    weight_only = quantize == "int8-weight-only"  # its matmuls take bfloat16 inputs (hetspec/int8.py)
    if slow := slow_dtype_warning(torch.bfloat16 if weight_only else DTYPES[dtype], device):
        log.warning("hetspec: %s: %s%s", spec, "int8-weight-only multiplies in bfloat16; " if weight_only else "", slow)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for but CUDA is not available")
    if threads:
        torch.set_num_threads(threads)
    location, gguf_file = resolve_source(spec, progress)
    if progress:
        progress(f"hetspec: loading {spec} ({dtype}, {device}) ...")
    if gguf_file:
        tokenizer, model = _load_gguf(Path(location) / gguf_file, dtype)
    else:
        tokenizer = AutoTokenizer.from_pretrained(location)
        model = AutoModelForCausalLM.from_pretrained(location, dtype=DTYPES[dtype])
    model.to(device).eval()
    eos_ids = set()
    configured = model.generation_config.eos_token_id if model.generation_config else None
    for candidate in (configured if isinstance(configured, list) else [configured]) + [tokenizer.eos_token_id]:
        if candidate is not None:
            eos_ids.add(int(candidate))
    vocab_size = model.get_output_embeddings().weight.shape[0]
    if quantize == "int8":
        model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    elif quantize == "int8-weight-only":
        quantize_weights(model)
    if onednn:
        convert_linear_layers(model)
    if bit_exact:
        exact.make_exact(model)
    lean = LeanDecoder(model) if uses_lean(forward, model, quantize) else None
    return LanguageModel(name=spec, model=model, tokenizer=tokenizer, device=torch.device(device),
                         vocab_size=vocab_size, eos_token_ids=frozenset(eos_ids), lean=lean)
