"""The decoding methods compared, and one measured run of a method on a prompt.

Methods:
- ``ar``, ``sd``, ``slem``, ``tli``, ``slrs``: ``hetspec.Engine`` with that algorithm; the draft setting
  is a fixed k or ``adaptive`` (hetspec's DraftLength policy, starting at the largest fixed k).
- ``hf-greedy``: plain ``target.generate`` (greedy, or sampling when a temperature is set), a sanity baseline.
- ``hf-assisted``: transformers' assisted generation with the drafter, passing both tokenizers when the
  vocabularies differ (Universal Assisted Generation for greedy; for sampling, its token-level
  intersection sampler). Its draft settings live on the *assistant's* ``generation_config`` (transformers
  5.24 reads ``num_assistant_tokens`` and friends from there, not from ``generate``'s arguments):
  ``default`` leaves them unset (transformers' defaults: up to 20 tokens, constant schedule, stop drafting
  when the assistant's confidence falls below 0.4); a number k drafts exactly k tokens (constant
  schedule, no confidence stop); ``heuristic`` starts at 5 and grows/shrinks per step, reset every call.
- ``hf-lookup``: transformers' prompt lookup decoding on the target alone (``prompt_lookup_num_tokens`` = the
  draft setting, its default n-gram sizes), the peer of hetspec's context lookup.

Any hetspec method may add context lookup drafts (``SpeculationConfig.lookup``): ``ar+lookup-always`` is
hetspec's prompt lookup alone (no drafter), ``slem/k5+lookup-auto`` lookup and drafter per step;
``slem/k5+lookup-auto/m6`` the same with ``lookup_min_match`` 6 bytes (``--lookup-min-match``).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig

from benchmarks.meter import ForwardCall, ForwardMeter, synchronize
from benchmarks.prompts import PromptCase
from hetspec import Engine, SamplingParams, SpeculationConfig

HETSPEC_FAMILIES = ("ar", "sd", "slem", "tli", "slrs")
HF_FAMILIES = ("hf-greedy", "hf-assisted", "hf-lookup")
HF_PEERS = ("hf-assisted", "hf-lookup")  # the speculative peers a hetspec method is compared with
FAMILIES = HETSPEC_FAMILIES + HF_FAMILIES
ASSISTANT_KEYS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


@dataclass(frozen=True)
class MethodSpec:
    family: str  # one of FAMILIES
    # "-" (no drafter), a draft length "3", "adaptive", for hf-assisted "default"/"heuristic", for hf-lookup
    # the tokens a lookup proposes
    draft: str = "-"
    tree_width: int = 1  # slem: branches per depth of the draft tree (1: a chain)
    lookup: str = "off"  # hetspec families: SpeculationConfig.lookup
    lookup_min_match: int | None = None  # SpeculationConfig.lookup_min_match where set (None: its default)

    @property
    def name(self) -> str:
        name = self.family
        if self.draft != "-":
            name = f"{self.family}/k{self.draft}" if self.draft.isdigit() else f"{self.family}/{self.draft}"
        name = name if self.tree_width == 1 else f"{name}/tree{self.tree_width}"
        if self.lookup == "off":
            return name
        name = f"{name}+lookup-{self.lookup}"
        return name if self.lookup_min_match is None else f"{name}/m{self.lookup_min_match}"

    @property
    def uses_drafter(self) -> bool:
        return self.draft != "-" and self.family != "hf-lookup"

    @property
    def speculates(self) -> bool:
        """Drafts anything (from the drafter or the context): a speculative method, not a baseline."""
        return self.draft != "-" or self.lookup != "off"


def build_methods(families: list[str], draft_tokens: list[int], adaptive: bool, hf_drafts: list[str],
                  same_vocabulary: bool, tree_widths: tuple[int, ...] = (1,), lookups: tuple[str, ...] = ("off",),
                  hf_lookup_tokens: tuple[int, ...] = (10,),
                  lookup_min_matches: tuple[int | None, ...] = (None,)) -> list[MethodSpec]:
    """Every (family, draft setting, lookup mode) to run; ``sd`` only for a pair with one vocabulary; trees
    for slem only; ``ar`` always runs without lookup (the baseline) and once per other lookup mode. Each
    lookup mode other than off runs once per ``lookup_min_matches`` (None: SpeculationConfig's default)."""
    lookup_variants = [("off", None)] * ("off" in lookups) + [
        (mode, min_match) for mode in lookups if mode != "off" for min_match in lookup_min_matches]
    unknown = set(families) - set(FAMILIES)
    if unknown:
        raise ValueError(f"unknown algorithms {sorted(unknown)}; choose from {', '.join(FAMILIES)}")
    methods = []
    for family in families:
        if family == "hf-greedy":
            methods.append(MethodSpec(family))
        elif family == "ar":
            methods.append(MethodSpec(family))
            methods.extend(MethodSpec(family, lookup=mode, lookup_min_match=min_match)
                           for mode, min_match in lookup_variants if mode != "off")
        elif family == "hf-assisted":
            methods.extend(MethodSpec(family, draft) for draft in hf_drafts)
        elif family == "hf-lookup":
            methods.extend(MethodSpec(family, str(tokens)) for tokens in hf_lookup_tokens)
        elif family == "sd" and not same_vocabulary:
            continue
        else:
            for mode, min_match in lookup_variants:
                for width in tree_widths if family == "slem" else (1,):
                    methods.extend(MethodSpec(family, str(k), width, mode, min_match) for k in draft_tokens)
                    if adaptive:
                        methods.append(MethodSpec(family, "adaptive", width, mode, min_match))
    return methods


@dataclass
class RunRecord:
    """One method on one prompt."""

    prompt_id: str
    method: str
    family: str
    draft: str
    prompt_tokens: int
    token_ids: list[int]
    seconds: float  # wall clock of the whole call, prefill included
    target_calls: list[ForwardCall]
    drafter_calls: list[ForwardCall]
    hetspec_stats: dict | None = None  # hetspec's own Stats.to_dict() (exact draft/accept counts)
    extra: dict = field(default_factory=dict)
    lookup: str = "off"  # the method's context lookup mode (hetspec) or "hf" for transformers' prompt lookup


def hf_assistant_settings(draft: str) -> dict:
    if draft == "default":
        return {}
    if draft == "heuristic":
        return {"num_assistant_tokens": 5, "num_assistant_tokens_schedule": "heuristic_transient",
                "assistant_confidence_threshold": 0.0}
    return {"num_assistant_tokens": int(draft), "num_assistant_tokens_schedule": "constant",
            "assistant_confidence_threshold": 0.0}


class Runner:
    """Runs methods on prompts with one loaded pair, measuring every forward of both models."""

    def __init__(self, engine: Engine, params: SamplingParams, chat: bool, same_vocabulary: bool,
                 adaptive_start: int, confidence_threshold: float = 0.0):
        self.engine = engine
        self.adaptive_start = adaptive_start  # first k of the adaptive policy
        self.confidence_threshold = confidence_threshold  # hetspec's early draft stop; 0 never stops
        self.target, self.drafter = engine.target, engine.drafter
        self.params = params
        self.chat = chat
        self.same_vocabulary = same_vocabulary
        self.target_meter = ForwardMeter(self.target, self.target.device)
        self.drafter_meters = []
        self.hf_drafter_model = None
        if self.drafter is not None:
            self.drafter_meters.append(ForwardMeter(self.drafter, self.drafter.device))
            self.hf_drafter_model = self._hf_drafter_model()
        config = self.hf_drafter_model.generation_config if self.hf_drafter_model is not None else None
        self.assistant_defaults = {key: getattr(config, key, None) for key in ASSISTANT_KEYS} if config else {}

    def _hf_drafter_model(self) -> torch.nn.Module:
        if self.params.greedy or self.same_vocabulary:
            return self.drafter.model
        # transformers' sampling path with two tokenizers prunes the assistant's LM head and embeddings in
        # place; a private copy keeps the drafter hetspec uses intact.
        model = copy.deepcopy(self.drafter.model)
        self.drafter_meters.append(ForwardMeter(model, self.drafter.device))
        return model

    def prompt_ids(self, case: PromptCase) -> list[int]:
        if self.chat:
            return self.target.encode_chat([{"role": "user", "content": case.text}])
        return self.target.encode_prompt(case.text)

    def run(self, spec: MethodSpec, case: PromptCase, max_new_tokens: int | None = None) -> RunRecord:
        params = self.params if max_new_tokens is None else self.params.model_copy(
            update={"max_new_tokens": max_new_tokens})
        prompt_ids = self.prompt_ids(case)
        self.target_meter.take()
        for meter in self.drafter_meters:
            meter.take()
        synchronize(self.target.device)
        started = time.perf_counter()
        if spec.family in HETSPEC_FAMILIES:
            token_ids, stats, extra = self._run_hetspec(spec, case, params)
        else:
            token_ids, stats, extra = self._run_hf(spec, prompt_ids, params), None, {}
        synchronize(self.target.device)
        seconds = time.perf_counter() - started
        drafter_calls = [call for meter in self.drafter_meters for call in meter.take()]
        return RunRecord(case.prompt_id, spec.name, spec.family, spec.draft, len(prompt_ids), token_ids, seconds,
                         self.target_meter.take(), drafter_calls, stats, extra,
                         "hf" if spec.family == "hf-lookup" else spec.lookup)

    def _run_hetspec(self, spec: MethodSpec, case: PromptCase, params: SamplingParams):
        speculation = {"algorithm": spec.family, "confidence_threshold": self.confidence_threshold,
                       "tree_width": spec.tree_width, "lookup": spec.lookup}
        if spec.lookup_min_match is not None:
            speculation["lookup_min_match"] = spec.lookup_min_match
        if spec.draft == "adaptive":
            speculation.update(adaptive=True, draft_tokens=self.adaptive_start)
        elif spec.uses_drafter:
            speculation["draft_tokens"] = int(spec.draft)
        prompt = {"messages": [{"role": "user", "content": case.text}]} if self.chat else {"prompt": case.text}
        result = self.engine.generate(params=params, speculation=SpeculationConfig(**speculation), **prompt)
        return result.token_ids, result.stats.to_dict(), {"finish_reason": result.finish_reason}

    def _run_hf(self, spec: MethodSpec, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.target.device)
        kwargs = {"max_new_tokens": params.max_new_tokens, "do_sample": not params.greedy,
                  "eos_token_id": sorted(self.target.eos_token_ids), "repetition_penalty": 1.0,
                  "pad_token_id": self.target.tokenizer.pad_token_id or min(self.target.eos_token_ids),
                  "attention_mask": torch.ones_like(input_ids)}
        if not params.greedy:
            kwargs.update(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
            torch.manual_seed(params.seed)
        if spec.family == "hf-assisted":
            self._set_assistant(spec.draft)
            kwargs["assistant_model"] = self.hf_drafter_model
            if not self.same_vocabulary:
                kwargs.update(tokenizer=self.target.tokenizer, assistant_tokenizer=self.drafter.tokenizer)
        elif spec.family == "hf-lookup":
            kwargs["prompt_lookup_num_tokens"] = int(spec.draft)
        with torch.inference_mode():
            output = self.target.model.generate(input_ids, **kwargs)
        return output[0, len(prompt_ids):].tolist()

    def _set_assistant(self, draft: str) -> None:
        config = self.hf_drafter_model.generation_config
        for key, value in {**self.assistant_defaults, **hf_assistant_settings(draft)}.items():
            setattr(config, key, value)

    def effective_assistant_settings(self, draft: str) -> dict:
        """What transformers will use for this hf-assisted setting, its defaults filled in."""
        defaults = GenerationConfig._get_default_generation_params()
        chosen = {**self.assistant_defaults, **hf_assistant_settings(draft)}
        return {key: defaults.get(key) if chosen.get(key) is None else chosen[key] for key in ASSISTANT_KEYS}

    def close(self) -> None:
        self.target_meter.close()
        for meter in self.drafter_meters:
            meter.close()
