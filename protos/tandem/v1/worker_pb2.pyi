from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop_token_ids", "max_tokens", "ignore_eos", "logprobs", "grammar", "cache_salt", "num_resumed_tokens")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    NUM_RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    ignore_eos: bool
    logprobs: int
    grammar: OutputGrammar
    cache_salt: str
    num_resumed_tokens: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., grammar: _Optional[_Union[OutputGrammar, _Mapping]] = ..., cache_salt: _Optional[str] = ..., num_resumed_tokens: _Optional[int] = ...) -> None: ...

class OutputGrammar(_message.Message):
    __slots__ = ("kind", "spec")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    kind: str
    spec: str
    def __init__(self, kind: _Optional[str] = ..., spec: _Optional[str] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "decode_address")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    decode_address: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., decode_address: _Optional[str] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("num_cached_tokens", "request_id", "error_code", "error")
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    num_cached_tokens: int
    request_id: str
    error_code: int
    error: str
    def __init__(self, num_cached_tokens: _Optional[int] = ..., request_id: _Optional[str] = ..., error_code: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class PrefillSessionRequest(_message.Message):
    __slots__ = ("submit", "abort")
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    submit: _containers.RepeatedCompositeFieldContainer[SubmitRequest]
    abort: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, submit: _Optional[_Iterable[_Union[SubmitRequest, _Mapping]]] = ..., abort: _Optional[_Iterable[str]] = ...) -> None: ...

class PrefillSessionResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SubmitResponse]
    def __init__(self, results: _Optional[_Iterable[_Union[SubmitResponse, _Mapping]]] = ...) -> None: ...

class SetDestinationRequest(_message.Message):
    __slots__ = ("request_id", "block_ids", "region_descriptor", "fingerprint")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REGION_DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    region_descriptor: bytes
    fingerprint: str
    def __init__(self, request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., region_descriptor: _Optional[bytes] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class SetDestinationResponse(_message.Message):
    __slots__ = ("fingerprint",)
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    fingerprint: str
    def __init__(self, fingerprint: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "prefill_address", "local_prefill")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    prefill_address: str
    local_prefill: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., prefill_address: _Optional[str] = ..., local_prefill: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "num_prompt_tokens", "num_output_tokens", "num_cached_tokens", "request_id", "error_code", "error", "error_transient")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_TRANSIENT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    request_id: str
    error_code: int
    error: str
    error_transient: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_output_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., request_id: _Optional[str] = ..., error_code: _Optional[int] = ..., error: _Optional[str] = ..., error_transient: _Optional[bool] = ...) -> None: ...

class DecodeSessionRequest(_message.Message):
    __slots__ = ("generate", "abort")
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    generate: _containers.RepeatedCompositeFieldContainer[GenerateRequest]
    abort: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, generate: _Optional[_Iterable[_Union[GenerateRequest, _Mapping]]] = ..., abort: _Optional[_Iterable[str]] = ...) -> None: ...

class DecodeSessionResponse(_message.Message):
    __slots__ = ("outputs",)
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[GenerateResponse]
    def __init__(self, outputs: _Optional[_Iterable[_Union[GenerateResponse, _Mapping]]] = ...) -> None: ...

class SetPrefillRequest(_message.Message):
    __slots__ = ("request_id", "prefill_address")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prefill_address: str
    def __init__(self, request_id: _Optional[str] = ..., prefill_address: _Optional[str] = ...) -> None: ...

class SetPrefillResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("role", "num_running", "num_waiting", "num_preallocated", "num_transferring", "kv_blocks_used", "kv_blocks_total", "prompt_tokens_per_s", "gen_tokens_per_s", "prefix_cache_queries", "prefix_cache_hits", "num_retractions", "model", "max_model_len", "fingerprint")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_PREALLOCATED_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFERRING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    GEN_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_RETRACTIONS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    role: str
    num_running: int
    num_waiting: int
    num_preallocated: int
    num_transferring: int
    kv_blocks_used: int
    kv_blocks_total: int
    prompt_tokens_per_s: float
    gen_tokens_per_s: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_retractions: int
    model: str
    max_model_len: int
    fingerprint: str
    def __init__(self, role: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_preallocated: _Optional[int] = ..., num_transferring: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., prompt_tokens_per_s: _Optional[float] = ..., gen_tokens_per_s: _Optional[float] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_retractions: _Optional[int] = ..., model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., fingerprint: _Optional[str] = ...) -> None: ...
