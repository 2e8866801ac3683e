"""Drafter and target workers: one model each, and the KV sessions of the requests in flight.

Plain classes: the Serve app makes them Ray actors (``ray.remote``) at bind time, tests may run them in
process. They call the library's steps and nothing else, so the distributed loop computes what
``hetspec.engine.Engine.stream`` computes: the drafter ``algorithm.draft`` on a ``DrafterSide``, the
target ``TargetSide.verify``. Alignment and the bookkeeping stay in the coordinator.

The API (deployments/workers/api.py): ``DrafterWorker`` is a ``DrafterAPI``, ``TargetWorker`` a ``TargetAPI``.

Batching: ``draft`` and ``verify`` take the step of several requests at once (the replica loop sends one
call per model per step, deployments/serving/replica_loop.py). Each request's step is a computation of the
library's (a generator of passes), and every computation of every call shares the model's passes through
``hetspec.passes.SharedPasses``: one pass feeds every request waiting at that moment, and a call that arrives
while a pass runs joins the next one (drafts of several requests advance together, one verification pass
checks every request's draft). A session's prompt is prefilled in chunks when it opens
(``pipeline.prefill_chunk_tokens``), each chunk in a pass with the others' rows, packed (hetspec/layouts.py),
so a long prompt delays the others by one chunk's cost at a time. A session may instead be opened without its
prompt (requests in step; the drafter's also while the replica drafts nothing): the target's prompt then goes a
chunk per ``verify`` call, in the others' verify pass; the drafter's first draft prefills it, in chunks too.

Large tensors leave through ``store`` and arrive through ``fetch`` (``ray.put`` / ``ray.get`` in actors):
``draft_probs`` [k, target_vocab] travels by object reference from the drafter to the target.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from hetspec.algorithms import ALGORITHM_CLASSES, Algorithm, Draft, DrafterSide, PairMaps, make_algorithm
from hetspec.config import ModelConfig, SamplingParams
from hetspec.decoder import TargetSide
from hetspec.passes import PassRecord, SharedPasses
from hetspec.prefill import PrefillStopped, prefill
from hetspec.models import LanguageModel, load_model

from deployments.config import PipelineConfig
from deployments.errors import UnknownSession
from deployments.runtime.heap_trim import HeapTrimmer
from deployments.runtime.metrics import worker_metrics
from deployments.runtime.model_threads import ModelThreads
from deployments.workers.sessions import Sessions
from deployments.workers.api import DraftItem, Drafted, ModelInfo, OpenSession, VerifyItem, VerifyResult

log = logging.getLogger("hetspec.workers")


def _same(value: Any) -> Any:
    return value


# a request between steps (its other model's pass, the coordinator's turn) still counts as served here
IN_FLIGHT_WITHIN_S = 2.0


def _load(model: ModelConfig | LanguageModel) -> LanguageModel:
    if isinstance(model, LanguageModel):
        return model
    return load_model(model.model, dtype=model.dtype, device=model.device, threads=model.threads,
                      quantize=model.quantize, linear=model.linear, forward=model.forward,
                      bit_exact=model.bit_exact)


class _Worker:
    role = "worker"

    def __init__(self, model: ModelConfig | LanguageModel, pipeline: PipelineConfig, release: Callable[[Any], None]):
        # model work, loading included, runs on these threads, not on the actor's (deployments/runtime/model_threads.py)
        self.sessions: Sessions = Sessions(pipeline.max_sessions, pipeline.session_idle_timeout_s, release)
        # Requests at the other model take this model's cores too, unless the models are on different nodes or the
        # requests go in step. Not pipelined, a replica's requests draft together, then verify together
        # (deployments/serving/replica_loop.py): the other model idles while this one runs, and a request
        # between this model's calls is in the coordinator's turn (sending its tokens), not at the other model. Counted,
        # it halved this model's threads while the cores idled: busy 84-87% of the cores at 8 clients
        # (docs/decisions/served-in-step.md, CPU by process).
        shares_cores = pipeline.placement_strategy != "STRICT_SPREAD" and pipeline.pipelined
        self.model_threads = ModelThreads(
            f"hetspec-{self.role}", pipeline.model_lanes, model.threads if isinstance(model, ModelConfig) else None,
            at_other_model=(lambda: self.sessions.elsewhere(IN_FLIGHT_WITHIN_S)) if shares_cores else (lambda: 0))
        # whether a pass fed a prompt's chunk (a pass ~8x dearer) since the last call: the load-adaptive policy
        # (hetspec/step.py Scheduler) measures steps, and such a step priced the prompt, not the draft length
        self._fed_prompt = False
        self.model = self.model_threads.run(_load, model)[0]
        # the self-check (a few passes; it logs its answer) at load, on the model's threads
        self.bit_exact = self.model_threads.run(lambda: self.model.bit_exact)[0]
        self.passes = SharedPasses(self.model, execute=self.model_threads.run, on_pass=self._record_pass)
        self.prefill_chunk_tokens = pipeline.prefill_chunk_tokens
        self.actor_id = uuid.uuid4().hex[:8]
        self.sessions.start_sweeper(self._expired)
        self.heap_trimmer = HeapTrimmer(pipeline.heap_trim_interval_s)
        self.heap_trimmer.start()
        self._calls = 0
        self._calls_guard = threading.Lock()
        self._metrics = worker_metrics()
        self._tags = {"role": self.role, "actor": self.actor_id}

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Free every session's KV row and end this worker's threads (session sweeper, heap trimmer, model lanes).
        For a worker built in a process that goes on (tests, an application embedding one): its threads would
        otherwise run for the process's life, and its model lanes' OpenMP teams slow every later model pass
        (deployments/runtime/model_threads.py). An actor's process ends with the actor, and these with it."""
        self.sessions.stop_sweeper()
        self.heap_trimmer.stop()
        self.sessions.close_all()
        self.model_threads.stop()
        self._publish()

    def __repr__(self) -> str:
        """What the Ray dashboard and ``ray list actors --detail`` show as the actor's ``repr_name`` (Ray takes it once,
        when the actor has started: live counts are in ``stats`` and the metrics)."""
        if "model" not in vars(self):  # Ray asks for the repr of an actor whose __init__ raised (a failed load)
            return f"{type(self).__name__}(not loaded)"
        dtype = getattr(self.model.model, "dtype", None)  # a transformers model's compute dtype
        return (f"{type(self).__name__}(model={self.model.name}, dtype={str(dtype).removeprefix('torch.')}, "
                f"device={self.model.device}, kv_sessions={len(self.sessions)}/{self.sessions.max_sessions}, "
                f"kv_reserved_bytes={self.model.kv_pool.reserved_bytes}, actor={self.actor_id})")

    def info(self) -> ModelInfo:
        return ModelInfo(self.model.name, self.model.tokenizer, self.model.vocab_size, self.model.eos_token_ids,
                         self.model.kv_pool.bytes_per_token, self.bit_exact)

    def ping(self) -> str:
        return self.actor_id

    def set_kv_budget(self, budget_bytes: int | None) -> None:
        """The most bytes this model's KV buffers grow to by doubling (hetspec/kv.py ``KVPool.budget_bytes``): its
        share of the replica's limits.kv_cache_bytes (deployments/workers/actors.py); None: no bound."""
        self.model.kv_pool.budget_bytes = budget_bytes

    def node_id(self) -> str | None:
        try:
            import ray
            return ray.get_runtime_context().get_node_id()
        except Exception:  # not in a Ray worker
            return None

    def stats(self) -> dict:
        pool = self.model.kv_pool
        return {"actor": self.actor_id, "model": self.model.name, "active_sessions": len(self.sessions),
                "max_sessions": self.sessions.max_sessions, "calls_in_progress": self._calls,
                "forward_passes": self.passes.passes, "pass_rows": self.passes.rows,
                "kv_bytes_per_token": pool.bytes_per_token, "kv_reserved_bytes": pool.reserved_bytes,
                "bit_exact": self.bit_exact,
                **self.heap_trimmer.stats()}

    def _run_for(self, items: list[tuple[str, tuple]], computation: Callable[..., Any]) -> tuple[list, float]:
        """(per item its result or exception, seconds): ``computation(session, *args)`` of each (request_id, args),
        all started in the same pass and sharing passes with the other calls running meanwhile."""
        self._count_call(+len(items))
        try:
            with ExitStack() as held:
                outcomes: list[Any] = [None] * len(items)
                started: list[tuple[int, Any]] = []
                for index, (request_id, args) in enumerate(items):
                    try:
                        started.append((index, computation(held.enter_context(self.sessions.use(request_id)), *args)))
                    except Exception as error:  # e.g. UnknownSession: this item fails, the others run
                        outcomes[index] = error
                tick = time.perf_counter()
                for (index, _), outcome in zip(started, self.passes.run_many([steps for _, steps in started])):
                    outcomes[index] = outcome
                return outcomes, time.perf_counter() - tick
        finally:
            self._count_call(-len(items))

    def _record_pass(self, record: PassRecord) -> None:
        self._metrics.passes.inc(tags=self._tags)
        self._metrics.pass_rows.observe(record.rows, tags={"role": self.role})
        self._fed_prompt |= record.prompt_chunk

    def _drain_fed_prompt(self) -> bool:
        """Whether a pass fed a prompt's chunk since the last drain."""
        fed_prompt, self._fed_prompt = self._fed_prompt, False
        return fed_prompt

    def close(self, request_id: str) -> bool:
        closed = self.sessions.close(request_id)
        self._publish()
        log.debug("closed session request_id=%s role=%s found=%s", request_id, self.role, closed)
        return closed

    def _open(self, request_id: str, session: Any) -> None:
        self.sessions.open(request_id, session)
        self._publish()

    def _prefill(self, request_id: str, cached: Callable[[Any], tuple]) -> None:
        """The opened session's prompt into its KV row; ``cached(session)``: (its KVSession, its ids). A close
        meanwhile (the client gone) stops it at the next chunk: ``UnknownSession``, the session already freed."""
        [outcome], _ = self._run_for([(request_id, ())], lambda session: prefill(
            *cached(session), self.prefill_chunk_tokens, stop=self._closed(request_id, session)))
        if isinstance(outcome, PrefillStopped):
            self._publish()
            raise UnknownSession(request_id)
        if isinstance(outcome, BaseException):
            self.close(request_id)  # no half-filled session left behind
            raise outcome
        self._publish()

    def _closed(self, request_id: str, session: Any) -> Callable[[], bool]:
        """Whether ``session`` was closed (taken out of the table, its close waiting for the call running on it):
        what a prefill asks between chunks."""
        return lambda: not self.sessions.holds(request_id, session)

    def _expired(self, request_ids: list[str]) -> None:
        self._metrics.expired_sessions.inc(len(request_ids), tags={"role": self.role})
        self._publish()
        log.warning("freed idle sessions role=%s request_ids=%s", self.role, ",".join(request_ids))

    def _publish(self) -> None:
        self._metrics.active_sessions.set(len(self.sessions), tags=self._tags)
        self._metrics.kv_reserved_bytes.set(self.model.kv_pool.reserved_bytes, tags=self._tags)
        self._metrics.queue_depth.set(self._calls, tags=self._tags)

    def _count_call(self, delta: int) -> None:
        with self._calls_guard:
            self._calls += delta
        self._metrics.queue_depth.set(self._calls, tags=self._tags)


@dataclass
class _DrafterSession:
    side: DrafterSide
    algorithm: Algorithm
    params: SamplingParams


class DrafterWorker(_Worker):
    role = "drafter"

    def __init__(self, model: ModelConfig | LanguageModel, pipeline: PipelineConfig,
                 store: Callable[[torch.Tensor], Any] = _same):
        super().__init__(model, pipeline, release=lambda session: session.side.release())
        self.store = store
        self.maps: PairMaps | None = None

    def attach_target(self, target: ModelInfo) -> None:
        """Vocabulary maps of the pair, built once; warmed here because actor threads share them."""
        self.maps = self.model_threads.run(self._built_maps, target)[0]

    def _built_maps(self, target: ModelInfo) -> PairMaps:
        maps = PairMaps(self.model, target.stand_in())
        _ = maps.intersection, maps.intersection_inverse, maps.first_target_token
        return maps

    def open(self, request: OpenSession) -> None:
        """``prefill_now``: the prompt now (its first draft then needs one pass), or at the first draft."""
        if self.maps is None:
            raise RuntimeError("attach_target must run before the drafter opens sessions")
        side, _ = self.model_threads.run(DrafterSide, self.model, request.prompt_ids,
                                         request.speculation.alignment_window)
        session = _DrafterSession(side, make_algorithm(request.algorithm, self.maps, request.speculation,
                                                       request.params), request.params)
        self._open(request.request_id, session)
        if request.prefill_now:
            self._prefill(request.request_id, lambda session: (session.side.session, session.side.context.ids))

    def draft(self, items: list[DraftItem]) -> list[Drafted | Exception]:
        """Per item ``algorithm.draft`` after the committed text (the drafter re-syncs to it first), or the
        exception it raised; the drafts share passes."""
        def draft(session: _DrafterSession, request_id: str, committed: bytes, k: int, first_position: int,
                  draft_round: int):
            # more than a chunk not cached (a prompt opened without prefill, or many tokens committed while the
            # request drafted nothing) goes in chunks first, as a prompt at open, stopped by a close as there; up
            # to a chunk rides with the draft
            session.side.sync(committed)
            yield from prefill(session.side.session, session.side.context.ids, self.prefill_chunk_tokens,
                               leave=self.prefill_chunk_tokens, stop=self._closed(request_id, session))
            return (yield from session.algorithm.draft(session.side, committed, k, session.params, first_position,
                                                       draft_round))

        outcomes, seconds = self._run_for([(item.request_id, (item.request_id, item.committed, item.k,
                                                              item.first_position, item.draft_round))
                                           for item in items], draft)
        fed_prompt = self._drain_fed_prompt()
        results: list[Drafted | Exception] = []
        for item, outcome in zip(items, outcomes):
            if isinstance(outcome, PrefillStopped):  # closed while its prompt was fed
                outcome = UnknownSession(item.request_id)
            elif isinstance(outcome, Draft):
                if outcome.draft_probs is not None:  # [k, target_vocab] travels by reference to the target
                    outcome.draft_probs = self.store(outcome.draft_probs)
                outcome = Drafted(outcome, seconds, fed_prompt)
            results.append(outcome)
        return results


@dataclass
class _TargetSession:
    side: TargetSide
    algorithm: Algorithm
    params: SamplingParams


class TargetWorker(_Worker):
    role = "target"

    def __init__(self, model: ModelConfig | LanguageModel, pipeline: PipelineConfig,
                 fetch: Callable[[Any], torch.Tensor] = _same):
        super().__init__(model, pipeline, release=lambda session: session.side.release())
        self.fetch = fetch

    def open(self, request: OpenSession) -> None:
        """``prefill_now``: the prompt now, or a chunk per ``verify`` item without a draft."""
        # Verification reads only the algorithm's acceptance rule (``exact``): no vocabulary maps needed here.
        session = _TargetSession(self.model_threads.run(TargetSide, self.model, request.prompt_ids)[0],
                                 ALGORITHM_CLASSES[request.algorithm](None, request.speculation), request.params)
        self._open(request.request_id, session)
        if request.prefill_now:
            self._prefill(request.request_id, lambda session: (session.side.session, session.side.ids))

    def verify(self, items: list[VerifyItem]) -> list[VerifyResult | Exception]:
        """Per item the ids the target commits, or the exception; one pass verifies them all. An item without a
        draft (None) feeds the next chunk of its session's prompt (opened without prefill) in that pass instead,
        and its result says the prompt tokens still to feed (``prompt_left``): one call, so the chunk and the
        others' drafts share a pass (two calls sent together would run one pass each, hetspec.passes.SharedPasses)."""
        def verify(session: _TargetSession, draft: Draft | None):
            if draft is None:
                left = yield from prefill(session.side.session, session.side.ids, self.prefill_chunk_tokens, chunks=1)
                return VerifyResult([], prompt_left=left)
            draft = replace(draft, draft_probs=self._draft_probs(draft, session), first_row=0)
            new_ids = yield from session.side.verify(session.algorithm, draft, session.params)
            return VerifyResult(new_ids, logprobs=session.side.step_logprobs)

        outcomes, seconds = self._run_for([(item.request_id, (item.draft,)) for item in items], verify)
        fed_prompt = self._drain_fed_prompt()
        results = [replace(outcome, seconds=seconds, fed_prompt=fed_prompt) if isinstance(outcome, VerifyResult)
                   else outcome for outcome in outcomes]
        if any(item.draft is None for item in items):
            self._publish()
        return results

    def _draft_probs(self, draft: Draft, session: _TargetSession) -> torch.Tensor | None:
        """[len(candidates), target_vocab] rows of the stored draft distribution, or None (a point-mass draft's
        one-hot rows are built by ``TargetSide.verify``, they never travel)."""
        if session.algorithm.exact or session.params.greedy or draft.point_mass:
            return None
        if draft.draft_probs is None:  # no draft this step: k = 0 rows, the target samples on its own
            return torch.zeros(0, self.model.vocab_size)
        return replace(draft, draft_probs=self.fetch(draft.draft_probs)).candidate_probs()
