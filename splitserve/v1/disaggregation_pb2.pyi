from splitserve.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Fingerprint(_message.Message):
    __slots__ = ("model", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "tensor_parallel_size", "stage_first_layers", "draft")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIRST_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tensor_parallel_size: int
    stage_first_layers: _containers.RepeatedScalarFieldContainer[int]
    draft: str
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., stage_first_layers: _Optional[_Iterable[int]] = ..., draft: _Optional[str] = ...) -> None: ...

class KVHandle(_message.Message):
    __slots__ = ("connector", "connector_address", "block_ids", "num_tokens", "fingerprint", "prefill_address", "lease_s", "request_id", "pull_token", "signature", "chunk_digests", "rank_connector_addresses", "draft_token_ids", "draft_kv_digest")
    CONNECTOR_FIELD_NUMBER: _ClassVar[int]
    CONNECTOR_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PULL_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    RANK_CONNECTOR_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_KV_DIGEST_FIELD_NUMBER: _ClassVar[int]
    connector: str
    connector_address: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    fingerprint: Fingerprint
    prefill_address: str
    lease_s: float
    request_id: str
    pull_token: bytes
    signature: bytes
    chunk_digests: _containers.RepeatedScalarFieldContainer[bytes]
    rank_connector_addresses: _containers.RepeatedScalarFieldContainer[str]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_kv_digest: bytes
    def __init__(self, connector: _Optional[str] = ..., connector_address: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., fingerprint: _Optional[_Union[Fingerprint, _Mapping]] = ..., prefill_address: _Optional[str] = ..., lease_s: _Optional[float] = ..., request_id: _Optional[str] = ..., pull_token: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., chunk_digests: _Optional[_Iterable[bytes]] = ..., rank_connector_addresses: _Optional[_Iterable[str]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_kv_digest: _Optional[bytes] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "priority", "cache_salt", "kv_only")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    KV_ONLY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    priority: int
    cache_salt: str
    kv_only: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., kv_only: bool = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token_id", "first_logprob", "finish_reason", "kv", "num_cached_tokens", "phases")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    first_logprob: _generation_pb2.TokenLogprob
    finish_reason: str
    kv: KVHandle
    num_cached_tokens: int
    phases: _generation_pb2.RequestPhases
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_logprob: _Optional[_Union[_generation_pb2.TokenLogprob, _Mapping]] = ..., finish_reason: _Optional[str] = ..., kv: _Optional[_Union[KVHandle, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., phases: _Optional[_Union[_generation_pb2.RequestPhases, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "first_token_id", "sampling", "kv", "priority", "cache_salt", "allow_recompute", "may_hand_over")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    ALLOW_RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    MAY_HAND_OVER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_id: int
    sampling: _generation_pb2.SamplingParams
    kv: KVHandle
    priority: int
    cache_salt: str
    allow_recompute: bool
    may_hand_over: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., first_token_id: _Optional[int] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., kv: _Optional[_Union[KVHandle, _Mapping]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., allow_recompute: bool = ..., may_hand_over: bool = ...) -> None: ...

class KVTransfer(_message.Message):
    __slots__ = ("num_pulled_blocks", "num_local_hit_blocks", "num_bytes", "seconds", "recomputed")
    NUM_PULLED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOCAL_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    num_pulled_blocks: int
    num_local_hit_blocks: int
    num_bytes: int
    seconds: float
    recomputed: bool
    def __init__(self, num_pulled_blocks: _Optional[int] = ..., num_local_hit_blocks: _Optional[int] = ..., num_bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., recomputed: bool = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "finish_reason", "stop_token_id", "kv_transfer", "num_cached_tokens", "phases", "handed_over")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    HANDED_OVER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    finish_reason: str
    stop_token_id: int
    kv_transfer: KVTransfer
    num_cached_tokens: int
    phases: _generation_pb2.RequestPhases
    handed_over: bool
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., kv_transfer: _Optional[_Union[KVTransfer, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., phases: _Optional[_Union[_generation_pb2.RequestPhases, _Mapping]] = ..., handed_over: bool = ...) -> None: ...

class RequestRef(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class RenewKVRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RenewKVResponse(_message.Message):
    __slots__ = ("unknown_request_ids",)
    UNKNOWN_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    unknown_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, unknown_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseKVResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: bool = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: bool = ...) -> None: ...

class LoadReportRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("instance_id", "role", "num_waiting", "num_running", "num_free_blocks", "num_total_blocks", "fingerprint", "connector", "connector_address", "prefix_cache_hit_rate", "kv_transfers", "kv_transfer_bytes", "kv_transfer_seconds", "max_model_len", "num_pending_prefill_tokens", "prefill_tokens_per_s", "counters", "engine_error", "num_kv_transfers_in_flight", "num_kv_connections")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CONNECTOR_FIELD_NUMBER: _ClassVar[int]
    CONNECTOR_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_PENDING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_TRANSFERS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    role: str
    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
    fingerprint: Fingerprint
    connector: str
    connector_address: str
    prefix_cache_hit_rate: float
    kv_transfers: int
    kv_transfer_bytes: int
    kv_transfer_seconds: float
    max_model_len: int
    num_pending_prefill_tokens: int
    prefill_tokens_per_s: float
    counters: InstanceCounters
    engine_error: str
    num_kv_transfers_in_flight: int
    num_kv_connections: int
    def __init__(self, instance_id: _Optional[str] = ..., role: _Optional[str] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., fingerprint: _Optional[_Union[Fingerprint, _Mapping]] = ..., connector: _Optional[str] = ..., connector_address: _Optional[str] = ..., prefix_cache_hit_rate: _Optional[float] = ..., kv_transfers: _Optional[int] = ..., kv_transfer_bytes: _Optional[int] = ..., kv_transfer_seconds: _Optional[float] = ..., max_model_len: _Optional[int] = ..., num_pending_prefill_tokens: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., counters: _Optional[_Union[InstanceCounters, _Mapping]] = ..., engine_error: _Optional[str] = ..., num_kv_transfers_in_flight: _Optional[int] = ..., num_kv_connections: _Optional[int] = ...) -> None: ...

class InstanceCounters(_message.Message):
    __slots__ = ("num_preemptions", "num_lease_renewals", "num_lease_expiries", "num_pulls_cut_off", "num_kv_pull_failures", "num_kv_recomputes", "num_kv_handbacks", "num_kv_handles_refused", "num_local_prefills", "num_spec_draft_tokens", "num_spec_accepted_tokens", "num_steps", "step_seconds", "num_spec_draft_tokens_per_pos", "num_spec_accepted_tokens_per_pos", "num_spec_verifications_by_accepted", "num_handovers")
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASE_RENEWALS_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASE_EXPIRIES_FIELD_NUMBER: _ClassVar[int]
    NUM_PULLS_CUT_OFF_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_PULL_FAILURES_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_RECOMPUTES_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HANDBACKS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HANDLES_REFUSED_FIELD_NUMBER: _ClassVar[int]
    NUM_LOCAL_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_DRAFT_TOKENS_PER_POS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_ACCEPTED_TOKENS_PER_POS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_VERIFICATIONS_BY_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NUM_HANDOVERS_FIELD_NUMBER: _ClassVar[int]
    num_preemptions: int
    num_lease_renewals: int
    num_lease_expiries: int
    num_pulls_cut_off: int
    num_kv_pull_failures: int
    num_kv_recomputes: int
    num_kv_handbacks: int
    num_kv_handles_refused: int
    num_local_prefills: int
    num_spec_draft_tokens: int
    num_spec_accepted_tokens: int
    num_steps: int
    step_seconds: float
    num_spec_draft_tokens_per_pos: _containers.RepeatedScalarFieldContainer[int]
    num_spec_accepted_tokens_per_pos: _containers.RepeatedScalarFieldContainer[int]
    num_spec_verifications_by_accepted: _containers.RepeatedScalarFieldContainer[int]
    num_handovers: int
    def __init__(self, num_preemptions: _Optional[int] = ..., num_lease_renewals: _Optional[int] = ..., num_lease_expiries: _Optional[int] = ..., num_pulls_cut_off: _Optional[int] = ..., num_kv_pull_failures: _Optional[int] = ..., num_kv_recomputes: _Optional[int] = ..., num_kv_handbacks: _Optional[int] = ..., num_kv_handles_refused: _Optional[int] = ..., num_local_prefills: _Optional[int] = ..., num_spec_draft_tokens: _Optional[int] = ..., num_spec_accepted_tokens: _Optional[int] = ..., num_steps: _Optional[int] = ..., step_seconds: _Optional[float] = ..., num_spec_draft_tokens_per_pos: _Optional[_Iterable[int]] = ..., num_spec_accepted_tokens_per_pos: _Optional[_Iterable[int]] = ..., num_spec_verifications_by_accepted: _Optional[_Iterable[int]] = ..., num_handovers: _Optional[int] = ...) -> None: ...

class KVEventsRequest(_message.Message):
    __slots__ = ("epoch", "after_seq", "max_hashes", "snapshot_offset", "heartbeat_ms")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    MAX_HASHES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    after_seq: int
    max_hashes: int
    snapshot_offset: int
    heartbeat_ms: int
    def __init__(self, epoch: _Optional[int] = ..., after_seq: _Optional[int] = ..., max_hashes: _Optional[int] = ..., snapshot_offset: _Optional[int] = ..., heartbeat_ms: _Optional[int] = ...) -> None: ...

class KVEvents(_message.Message):
    __slots__ = ("epoch", "last_seq", "snapshot", "stored", "removed", "block_size", "block_hash", "snapshot_offset", "more", "resync")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    last_seq: int
    snapshot: bool
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    block_size: int
    block_hash: str
    snapshot_offset: int
    more: bool
    resync: bool
    def __init__(self, epoch: _Optional[int] = ..., last_seq: _Optional[int] = ..., snapshot: bool = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ..., block_size: _Optional[int] = ..., block_hash: _Optional[str] = ..., snapshot_offset: _Optional[int] = ..., more: bool = ..., resync: bool = ...) -> None: ...

class Registration(_message.Message):
    __slots__ = ("grpc_address", "report", "unix_s", "serving", "signature")
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    UNIX_S_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    grpc_address: str
    report: LoadReport
    unix_s: float
    serving: bool
    signature: bytes
    def __init__(self, grpc_address: _Optional[str] = ..., report: _Optional[_Union[LoadReport, _Mapping]] = ..., unix_s: _Optional[float] = ..., serving: bool = ..., signature: _Optional[bytes] = ...) -> None: ...
