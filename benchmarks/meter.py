"""Timing of model forward passes: live counting during a run, and isolated per-pass costs.

The same forward hooks watch hetspec and Hugging Face generation, so "target passes", "drafter
forwards" and the time spent inside each model are measured the same way for every method.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so wall-clock times cover it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class ForwardCall:
    tokens: int  # tokens fed in this forward
    seconds: float


@dataclass
class ForwardMeter:
    """Records every top-level forward call of one model: tokens fed and seconds taken. ``module`` is the model,
    or a hetspec ``LanguageModel``, whose passes run through its lean forward where it has one (hetspec/lean.py)
    and through the model otherwise (transformers' generation): both are watched."""

    module: Any
    device: torch.device
    calls: list[ForwardCall] = field(default_factory=list)

    def __post_init__(self):
        self._pending: tuple[int, float] | None = None
        modules = [self.module.model, self.module.lean] if hasattr(self.module, "lean") else [self.module]
        self._handles = [handle for module in modules if module is not None for handle in (
            module.register_forward_pre_hook(self._before, with_kwargs=True),
            module.register_forward_hook(self._after, with_kwargs=True))]

    def _before(self, module, args, kwargs):
        fed = kwargs.get("input_ids", args[0] if args else None)
        tokens = fed.shape[-1] if fed is not None else kwargs["inputs_embeds"].shape[1]
        synchronize(self.device)
        self._pending = (int(tokens), time.perf_counter())

    def _after(self, module, args, kwargs, output):
        synchronize(self.device)
        tokens, started = self._pending
        self.calls.append(ForwardCall(tokens, time.perf_counter() - started))

    def take(self) -> list[ForwardCall]:
        """The calls since the last ``take``."""
        calls, self.calls = self.calls, []
        return calls

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def pass_costs(model, context_ids: list[int], continuation_ids: list[int], sizes: list[int], repeats: int,
               logits_rows: str) -> dict[int, float]:
    """Median seconds of one forward over ``n`` new tokens after ``context_ids``, for each n in ``sizes``.

    ``model`` is a hetspec ``LanguageModel``. Each measurement feeds the first n ids of
    ``continuation_ids`` (padded by repetition) and rolls the cache back. ``logits_rows`` is "all" for a
    target verification pass (logits for every fed position, as in verification) or "last" for a
    drafter step.
    """
    session = model.new_session()
    session.extend(context_ids, logits_to_keep=1)
    filler = (continuation_ids or context_ids) * (max(sizes) // max(1, len(continuation_ids or context_ids)) + 1)
    costs = {}
    try:
        for size in sorted(sizes):
            samples = []
            for attempt in range(repeats + 1):  # the first run of each size warms caches and is dropped
                synchronize(model.device)
                started = time.perf_counter()
                session.extend(filler[:size], logits_to_keep=size if logits_rows == "all" else 1)
                synchronize(model.device)
                if attempt:
                    samples.append(time.perf_counter() - started)
                session.rollback(len(context_ids))
            costs[size] = statistics.median(samples)
    finally:
        session.release()
    return costs


def cost_sizes(observed_tokens: list[int]) -> list[int]:
    """Feed sizes to measure so that every observed forward lies within them: powers of two and the largest."""
    largest = max(observed_tokens, default=1)
    sizes = {1, largest}
    power = 2
    while power < largest:
        sizes.add(power)
        power *= 2
    return sorted(sizes)
