"""The in-process API: ``stream`` and ``generate`` one request, ``generate_batch`` many (continuous batching).

All three drive the one decode step, ``hetspec.step.BatchDecoder`` (one request is a batch of one).
"""

from __future__ import annotations

from typing import Iterator, Sequence

from hetspec.algorithms import PairMaps, resolve_name
from hetspec.config import BatchingConfig, SamplingParams, SpeculationConfig
from hetspec.decoder import Request
from hetspec.step import BatchDecoder
from hetspec.models import LanguageModel
from hetspec.output import GenerationResult, ResultBuilder, StreamEvent

Prompt = str | list[dict[str, str]]  # a plain prompt or chat messages


def prompt_ids(prompt: str | None, messages: list[dict[str, str]] | None, model: LanguageModel) -> list[int]:
    """The ids ``model`` is fed for a plain prompt or chat messages (exactly one of them); ``ValueError`` says what
    is wrong. The one place a prompt is validated, in process and served (deployments/serving/coordinator.py)."""
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt or messages")
    if messages is not None:
        return model.encode_chat(messages)
    if not prompt:
        raise ValueError("prompt must not be empty")
    return model.encode_prompt(prompt)


class Engine:
    """Target plus optional drafter, in this process."""

    def __init__(self, target: LanguageModel, drafter: LanguageModel | None = None,
                 speculation: SpeculationConfig | None = None, batching: BatchingConfig | None = None):
        self.target = target
        self.drafter = drafter
        self.speculation = speculation or SpeculationConfig()
        self.batching = batching or BatchingConfig()
        self.maps = PairMaps(drafter, target) if drafter is not None else None

    def request(self, prompt: str | None = None, params: SamplingParams | dict | None = None, *,
                messages: list[dict[str, str]] | None = None, speculation: SpeculationConfig | dict | None = None,
                request_id: str = "") -> Request:
        """A validated request, ready to join a ``BatchDecoder`` (no KV memory is taken before its first pass)."""
        # a plain dict is accepted too, validated here: a ValidationError names the field
        params = SamplingParams() if params is None else SamplingParams.model_validate(params)
        speculation = self.speculation if speculation is None else SpeculationConfig.model_validate(speculation)
        # ``auto`` resolves on the caller's seed (a given seed picks exact matching), before one is drawn
        algorithm = resolve_name(speculation.algorithm, self.maps, params)
        if speculation.algorithm == "auto":
            speculation = speculation.model_copy(update={"algorithm": algorithm})
        params = params.seeded()
        target_ids = prompt_ids(prompt, messages, self.target)
        drafter_ids = None  # the drafter's own tokenization, only for algorithms that draft
        if algorithm != "ar":
            drafter_ids = prompt_ids(prompt, messages, self.drafter)
        return Request(self.target, self.drafter, self.maps, speculation, params, target_ids, drafter_ids,
                       request_id=request_id, pipelined=self.batching.pipelined)

    def decoder(self, load_adaptive: bool | None = None) -> BatchDecoder:
        adaptive = self.speculation.load_adaptive if load_adaptive is None else load_adaptive
        return BatchDecoder(self.target, self.drafter, self.batching, adaptive)

    def stream(self, prompt: str | None = None, params: SamplingParams | dict | None = None, *,
               messages: list[dict[str, str]] | None = None,
               speculation: SpeculationConfig | dict | None = None) -> Iterator[StreamEvent]:
        request = self.request(prompt, params, messages=messages, speculation=speculation)
        decoder = self.decoder(request.speculation.load_adaptive)
        decoder.add(request)
        try:
            while True:
                for _, event in decoder.step():
                    yield event
                    if event.finish_reason:
                        return
        finally:
            decoder.cancel(request)

    def generate(self, prompt: str | None = None, params: SamplingParams | dict | None = None, *,
                 messages: list[dict[str, str]] | None = None,
                 speculation: SpeculationConfig | dict | None = None) -> GenerationResult:
        return _collect(self.stream(prompt, params, messages=messages, speculation=speculation))

    def generate_batch(self, prompts: Sequence[Prompt],
                       params: SamplingParams | dict | Sequence[SamplingParams | dict] | None = None, *,
                       speculation: SpeculationConfig | dict | None = None,
                       progress: bool = False) -> list[GenerationResult]:
        """Every prompt (a string or chat messages) decoded in batches of up to ``batching.max_batch_size``;
        a request joins as soon as another leaves. Results in the order of ``prompts``; ``params`` is one for
        all or one per prompt. Every prompt is validated before any decoding starts."""
        if isinstance(params, Sequence) and not isinstance(params, (str, dict)):
            if len(params) != len(prompts):
                raise ValueError(f"params: {len(params)} given for {len(prompts)} prompts")
            per_prompt = list(params)
        else:
            per_prompt = [params] * len(prompts)
        waiting = []
        for index, (prompt, prompt_params) in enumerate(zip(prompts, per_prompt)):
            try:
                if isinstance(prompt, str):
                    request = self.request(prompt, prompt_params, speculation=speculation, request_id=str(index))
                else:
                    request = self.request(None, prompt_params, messages=prompt, speculation=speculation,
                                           request_id=str(index))
            except (TypeError, ValueError) as error:
                raise type(error)(f"prompts[{index}]: {error}") from error
            waiting.append(request)
        results: list[GenerationResult | None] = [None] * len(waiting)
        builders = [ResultBuilder(request.target.ids[:request.target.prompt_len]) for request in waiting]
        decoder = self.decoder(waiting[0].speculation.load_adaptive if waiting else None)
        bar = _progress_bar(len(waiting)) if progress else None
        queue = list(reversed(waiting))
        try:
            while queue or len(decoder):
                while queue and len(decoder) < self.batching.max_batch_size:
                    decoder.add(queue.pop())
                for request, event in decoder.step():
                    index = int(request.request_id)
                    results[index] = builders[index].add(event)
                    if event.finish_reason:
                        if bar is not None:
                            bar.update(1)
        finally:
            for request in waiting:
                if not request.finished:
                    decoder.cancel(request)
            if bar is not None:
                bar.close()
        return results  # type: ignore[return-value]


def _collect(events: Iterator[StreamEvent]) -> GenerationResult:
    builder = ResultBuilder()
    for event in events:
        result = builder.add(event)
        if result is not None:
            return result
    raise AssertionError("the stream ended without a finish reason")


def _progress_bar(total: int):
    from tqdm.auto import tqdm  # a dependency of transformers' hub client
    return tqdm(total=total, desc="hetspec", unit="prompt")
