from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "algorithm", "draft_tokens", "pipelined", "stop_token_ids", "logprobs")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PIPELINED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    algorithm: str
    draft_tokens: int
    pipelined: bool
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: int
    def __init__(self, prompt: _Optional[str] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., algorithm: _Optional[str] = ..., draft_tokens: _Optional[int] = ..., pipelined: _Optional[bool] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[int] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "total_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ...) -> None: ...

class SpeculationStats(_message.Message):
    __slots__ = ("algorithm", "target_forwards", "drafter_forwards", "drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_per_pass", "drafter_seconds", "target_seconds", "alignment_seconds", "total_seconds", "tokens_per_second", "pipelined", "pipeline_hits", "pipeline_misses", "drafter_lost", "seed", "drafter_drafts", "drafter_drafted_tokens", "drafter_accepted_tokens", "lookup_drafts", "lookup_drafted_tokens", "lookup_accepted_tokens", "mean_batch_size", "mean_draft_length")
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    TARGET_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_PER_PASS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ALIGNMENT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    PIPELINED_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_HITS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_MISSES_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_LOST_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEAN_DRAFT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    algorithm: str
    target_forwards: int
    drafter_forwards: int
    drafted_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    mean_accepted_per_pass: float
    drafter_seconds: float
    target_seconds: float
    alignment_seconds: float
    total_seconds: float
    tokens_per_second: float
    pipelined: bool
    pipeline_hits: int
    pipeline_misses: int
    drafter_lost: bool
    seed: int
    drafter_drafts: int
    drafter_drafted_tokens: int
    drafter_accepted_tokens: int
    lookup_drafts: int
    lookup_drafted_tokens: int
    lookup_accepted_tokens: int
    mean_batch_size: float
    mean_draft_length: float
    def __init__(self, algorithm: _Optional[str] = ..., target_forwards: _Optional[int] = ..., drafter_forwards: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_per_pass: _Optional[float] = ..., drafter_seconds: _Optional[float] = ..., target_seconds: _Optional[float] = ..., alignment_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., pipelined: _Optional[bool] = ..., pipeline_hits: _Optional[int] = ..., pipeline_misses: _Optional[int] = ..., drafter_lost: _Optional[bool] = ..., seed: _Optional[int] = ..., drafter_drafts: _Optional[int] = ..., drafter_drafted_tokens: _Optional[int] = ..., drafter_accepted_tokens: _Optional[int] = ..., lookup_drafts: _Optional[int] = ..., lookup_drafted_tokens: _Optional[int] = ..., lookup_accepted_tokens: _Optional[int] = ..., mean_batch_size: _Optional[float] = ..., mean_draft_length: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "finish_reason", "usage", "stats", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    usage: Usage
    stats: SpeculationStats
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., stats: _Optional[_Union[SpeculationStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...
