"""Prometheus metrics through ``ray.util.metrics`` (exported by every Ray node, charted by
cluster/grafana/hetspec.json, recorded and alerted on by cluster/prometheus/). Names carry the ``hetspec_`` prefix;
Ray adds ``ray_`` in Prometheus. A coordinator's series carry its Serve replica id (``replica``), a model actor's
its role and actor id.

Created lazily, once per process: a metric object holds a reference into the process's metrics agent.
"""

from __future__ import annotations

from functools import lru_cache

from ray.util.metrics import Counter, Gauge, Histogram

SECONDS_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0]
TOKEN_BUCKETS = [0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 8.5, 12.5, 16.5, 32.5, 64.5]


class CoordinatorMetrics:
    def __init__(self) -> None:
        self.requests = Counter("hetspec_requests_total", "Finished requests.",
                                tag_keys=("protocol", "algorithm", "finish_reason", "replica"))
        self.request_errors = Counter("hetspec_request_errors_total", "Requests that ended in an error.",
                                      tag_keys=("protocol", "kind", "replica"))
        self.generated_tokens = Counter("hetspec_generated_tokens_total", "Tokens generated.",
                                        tag_keys=("algorithm", "replica"))
        self.prompt_tokens = Counter("hetspec_prompt_tokens_total", "Prompt tokens read.",
                                     tag_keys=("algorithm", "replica"))
        # source: the draft's, "drafter" (the drafter model) or "lookup" (context lookup, hetspec/lookup.py)
        self.drafted_tokens = Counter("hetspec_drafted_tokens_total", "Candidates sent to the target.",
                                      tag_keys=("algorithm", "source", "replica"))
        self.accepted_tokens = Counter("hetspec_accepted_tokens_total", "Candidates the target kept.",
                                       tag_keys=("algorithm", "source", "replica"))
        self.accepted_length = Histogram("hetspec_accepted_length", "Candidates accepted per target pass.",
                                         boundaries=TOKEN_BUCKETS, tag_keys=("algorithm", "replica"))
        self.draft_length = Histogram("hetspec_draft_length", "Candidates per draft.", boundaries=TOKEN_BUCKETS,
                                      tag_keys=("algorithm", "replica"))
        self.step_seconds = Histogram("hetspec_step_seconds", "Time per decoding step in each stage.",
                                      boundaries=SECONDS_BUCKETS, tag_keys=("stage", "replica"))
        self.time_to_first_token = Histogram(
            "hetspec_time_to_first_token_seconds", "From the request's arrival at a replica to its first text "
            "(time in line included).", boundaries=LATENCY_BUCKETS, tag_keys=("protocol", "replica"))
        self.time_per_output_token = Histogram(
            "hetspec_time_per_output_token_seconds", "Per finished request: seconds per output token after the "
            "first (inter-token latency).", boundaries=SECONDS_BUCKETS, tag_keys=("protocol", "replica"))
        self.request_latency = Histogram("hetspec_request_latency_seconds",
                                         "End-to-end latency of a finished request, from its arrival at a replica.",
                                         boundaries=LATENCY_BUCKETS, tag_keys=("protocol", "replica"))
        self.queue_time = Histogram("hetspec_queue_time_seconds",
                                    "Time a request waited in a replica's line before it ran.",
                                    boundaries=LATENCY_BUCKETS, tag_keys=("protocol", "replica"))
        self.running_requests = Gauge("hetspec_running_requests", "Requests decoding in a replica.",
                                      tag_keys=("replica",))
        self.waiting_requests = Gauge("hetspec_waiting_requests", "Requests waiting in a replica's line.",
                                      tag_keys=("replica",))
        self.pipeline = Counter("hetspec_pipeline_speculations_total",
                                "Speculative drafts, by outcome (hit: used, miss: dropped).",
                                tag_keys=("outcome", "replica"))
        self.drafter_lost = Counter("hetspec_drafter_lost_total",
                                    "Requests that lost their drafter and were finished by the target alone.",
                                    tag_keys=("replica",))
        self.admitted_kv_bytes = Gauge("hetspec_admitted_kv_bytes",
                                       "KV cache bytes the running requests of a replica are admitted with.",
                                       tag_keys=("replica",))
        self.ongoing_requests = Gauge("hetspec_coordinator_ongoing_requests",
                                      "Requests in progress in this coordinator replica.", tag_keys=("replica",))
        self.kv_budget_bytes = Gauge("hetspec_kv_budget_bytes", "A replica's KV cache budget (limits.kv_cache_bytes; "
                                     "absent without one).", tag_keys=("replica",))
        self.actor_replacements = Counter("hetspec_actor_replacements_total",
                                          "Drafter or target actors a replica replaced after they died.",
                                          tag_keys=("role", "replica"))

    def for_replica(self, replica: str) -> None:
        """Tag every series of this process with its replica (one coordinator replica per process)."""
        for metric in vars(self).values():
            metric.set_default_tags({"replica": replica})


class WorkerMetrics:
    def __init__(self) -> None:
        self.active_sessions = Gauge("hetspec_active_sessions", "KV sessions held by a model actor.",
                                     tag_keys=("role", "actor"))
        self.queue_depth = Gauge("hetspec_actor_queue_depth",
                                 "Calls in a model actor, running or waiting for a thread or their session.",
                                 tag_keys=("role", "actor"))
        self.passes = Counter("hetspec_forward_passes_total",
                              "Batched forward passes of a model actor (each feeds every request waiting then).",
                              tag_keys=("role", "actor"))
        self.pass_rows = Histogram("hetspec_pass_rows", "Requests fed by one forward pass (the batch size).",
                                   boundaries=TOKEN_BUCKETS, tag_keys=("role",))
        self.kv_reserved_bytes = Gauge("hetspec_kv_reserved_bytes", "KV cache memory a model actor holds.",
                                       tag_keys=("role", "actor"))
        self.expired_sessions = Counter("hetspec_expired_sessions_total", "KV sessions freed after idling.",
                                        tag_keys=("role",))


@lru_cache(maxsize=1)
def coordinator_metrics() -> CoordinatorMetrics:
    return CoordinatorMetrics()


@lru_cache(maxsize=1)
def worker_metrics() -> WorkerMetrics:
    return WorkerMetrics()
