from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_UNSPECIFIED: _ClassVar[Mode]
    MODE_SYNC: _ClassVar[Mode]
    MODE_ASYNC: _ClassVar[Mode]

class Privacy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIVACY_UNSPECIFIED: _ClassVar[Privacy]
    PRIVACY_SHARE_ALL: _ClassVar[Privacy]
    PRIVACY_MATCHED_ONLY: _ClassVar[Privacy]
    PRIVACY_SUMMARIES_ONLY: _ClassVar[Privacy]
MODE_UNSPECIFIED: Mode
MODE_SYNC: Mode
MODE_ASYNC: Mode
PRIVACY_UNSPECIFIED: Privacy
PRIVACY_SHARE_ALL: Privacy
PRIVACY_MATCHED_ONLY: Privacy
PRIVACY_SUMMARIES_ONLY: Privacy

class Manifest(_message.Message):
    __slots__ = ("federation_id", "protocol_version", "dataset_id", "dataset_hash", "seed", "n", "prompts_per_round", "mode", "verifier_name", "verifier_version", "staleness_rounds", "advantage")
    FEDERATION_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    DATASET_HASH_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_NAME_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_VERSION_FIELD_NUMBER: _ClassVar[int]
    STALENESS_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_FIELD_NUMBER: _ClassVar[int]
    federation_id: str
    protocol_version: int
    dataset_id: str
    dataset_hash: str
    seed: int
    n: int
    prompts_per_round: int
    mode: Mode
    verifier_name: str
    verifier_version: str
    staleness_rounds: int
    advantage: str
    def __init__(self, federation_id: _Optional[str] = ..., protocol_version: _Optional[int] = ..., dataset_id: _Optional[str] = ..., dataset_hash: _Optional[str] = ..., seed: _Optional[int] = ..., n: _Optional[int] = ..., prompts_per_round: _Optional[int] = ..., mode: _Optional[_Union[Mode, str]] = ..., verifier_name: _Optional[str] = ..., verifier_version: _Optional[str] = ..., staleness_rounds: _Optional[int] = ..., advantage: _Optional[str] = ...) -> None: ...

class RequestTag(_message.Message):
    __slots__ = ("request_id", "sent_at_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sent_at_ms: int
    def __init__(self, request_id: _Optional[str] = ..., sent_at_ms: _Optional[int] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("node_id", "model_id", "tokenizer_id", "manifest", "privacy", "resume_round", "tag", "node_secret")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    PRIVACY_FIELD_NUMBER: _ClassVar[int]
    RESUME_ROUND_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    NODE_SECRET_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    model_id: str
    tokenizer_id: str
    manifest: Manifest
    privacy: Privacy
    resume_round: int
    tag: RequestTag
    node_secret: str
    def __init__(self, node_id: _Optional[str] = ..., model_id: _Optional[str] = ..., tokenizer_id: _Optional[str] = ..., manifest: _Optional[_Union[Manifest, _Mapping]] = ..., privacy: _Optional[_Union[Privacy, str]] = ..., resume_round: _Optional[int] = ..., tag: _Optional[_Union[RequestTag, _Mapping]] = ..., node_secret: _Optional[str] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("session_id", "manifest", "current_round", "heartbeat_interval_ms", "max_bundle_mib")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CURRENT_ROUND_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_BUNDLE_MIB_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    manifest: Manifest
    current_round: int
    heartbeat_interval_ms: int
    max_bundle_mib: int
    def __init__(self, session_id: _Optional[str] = ..., manifest: _Optional[_Union[Manifest, _Mapping]] = ..., current_round: _Optional[int] = ..., heartbeat_interval_ms: _Optional[int] = ..., max_bundle_mib: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("node_id", "session_id", "tag")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    session_id: str
    tag: RequestTag
    def __init__(self, node_id: _Optional[str] = ..., session_id: _Optional[str] = ..., tag: _Optional[_Union[RequestTag, _Mapping]] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "session_id", "round", "tag")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    session_id: str
    round: int
    tag: RequestTag
    def __init__(self, node_id: _Optional[str] = ..., session_id: _Optional[str] = ..., round: _Optional[int] = ..., tag: _Optional[_Union[RequestTag, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("current_round", "online_nodes", "heartbeat_interval_ms")
    CURRENT_ROUND_FIELD_NUMBER: _ClassVar[int]
    ONLINE_NODES_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    current_round: int
    online_nodes: int
    heartbeat_interval_ms: int
    def __init__(self, current_round: _Optional[int] = ..., online_nodes: _Optional[int] = ..., heartbeat_interval_ms: _Optional[int] = ...) -> None: ...

class GroupSummary(_message.Message):
    __slots__ = ("prompt_id", "round", "policy_version", "n", "k", "reward_mean", "reward_std", "lengths", "mean_logprobs", "bundle_digest")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    REWARD_STD_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    MEAN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    round: int
    policy_version: int
    n: int
    k: int
    reward_mean: float
    reward_std: float
    lengths: _containers.RepeatedScalarFieldContainer[int]
    mean_logprobs: _containers.RepeatedScalarFieldContainer[float]
    bundle_digest: str
    def __init__(self, prompt_id: _Optional[str] = ..., round: _Optional[int] = ..., policy_version: _Optional[int] = ..., n: _Optional[int] = ..., k: _Optional[int] = ..., reward_mean: _Optional[float] = ..., reward_std: _Optional[float] = ..., lengths: _Optional[_Iterable[int]] = ..., mean_logprobs: _Optional[_Iterable[float]] = ..., bundle_digest: _Optional[str] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("node_id", "session_id", "round", "summaries", "tag", "columns")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SUMMARIES_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    session_id: str
    round: int
    summaries: _containers.RepeatedCompositeFieldContainer[GroupSummary]
    tag: RequestTag
    columns: SummaryColumns
    def __init__(self, node_id: _Optional[str] = ..., session_id: _Optional[str] = ..., round: _Optional[int] = ..., summaries: _Optional[_Iterable[_Union[GroupSummary, _Mapping]]] = ..., tag: _Optional[_Union[RequestTag, _Mapping]] = ..., columns: _Optional[_Union[SummaryColumns, _Mapping]] = ...) -> None: ...

class SummaryColumns(_message.Message):
    __slots__ = ("prompt_ids", "policy_versions", "n", "k", "reward_means", "reward_stds", "n_responses", "lengths", "mean_logprobs")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEANS_FIELD_NUMBER: _ClassVar[int]
    REWARD_STDS_FIELD_NUMBER: _ClassVar[int]
    N_RESPONSES_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    MEAN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[str]
    policy_versions: bytes
    n: bytes
    k: bytes
    reward_means: bytes
    reward_stds: bytes
    n_responses: bytes
    lengths: bytes
    mean_logprobs: bytes
    def __init__(self, prompt_ids: _Optional[_Iterable[str]] = ..., policy_versions: _Optional[bytes] = ..., n: _Optional[bytes] = ..., k: _Optional[bytes] = ..., reward_means: _Optional[bytes] = ..., reward_stds: _Optional[bytes] = ..., n_responses: _Optional[bytes] = ..., lengths: _Optional[bytes] = ..., mean_logprobs: _Optional[bytes] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("accepted", "duplicates")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    duplicates: int
    def __init__(self, accepted: _Optional[int] = ..., duplicates: _Optional[int] = ...) -> None: ...

class MatchOffer(_message.Message):
    __slots__ = ("prompt_id", "source_node_id", "source_model_id", "source_round", "source_k", "source_n", "bundle_digest")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ROUND_FIELD_NUMBER: _ClassVar[int]
    SOURCE_K_FIELD_NUMBER: _ClassVar[int]
    SOURCE_N_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    source_node_id: str
    source_model_id: str
    source_round: int
    source_k: int
    source_n: int
    bundle_digest: str
    def __init__(self, prompt_id: _Optional[str] = ..., source_node_id: _Optional[str] = ..., source_model_id: _Optional[str] = ..., source_round: _Optional[int] = ..., source_k: _Optional[int] = ..., source_n: _Optional[int] = ..., bundle_digest: _Optional[str] = ...) -> None: ...

class MatchRequest(_message.Message):
    __slots__ = ("node_id", "session_id", "round", "wait_ms", "wait_for_bundles")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOR_BUNDLES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    session_id: str
    round: int
    wait_ms: int
    wait_for_bundles: bool
    def __init__(self, node_id: _Optional[str] = ..., session_id: _Optional[str] = ..., round: _Optional[int] = ..., wait_ms: _Optional[int] = ..., wait_for_bundles: _Optional[bool] = ...) -> None: ...

class UploadRequest(_message.Message):
    __slots__ = ("prompt_id", "round")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    round: int
    def __init__(self, prompt_id: _Optional[str] = ..., round: _Optional[int] = ...) -> None: ...

class MatchResponse(_message.Message):
    __slots__ = ("ready", "offers", "upload_requests", "candidates", "solved_by_peers")
    READY_FIELD_NUMBER: _ClassVar[int]
    OFFERS_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    SOLVED_BY_PEERS_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    offers: _containers.RepeatedCompositeFieldContainer[MatchOffer]
    upload_requests: _containers.RepeatedCompositeFieldContainer[UploadRequest]
    candidates: int
    solved_by_peers: int
    def __init__(self, ready: _Optional[bool] = ..., offers: _Optional[_Iterable[_Union[MatchOffer, _Mapping]]] = ..., upload_requests: _Optional[_Iterable[_Union[UploadRequest, _Mapping]]] = ..., candidates: _Optional[int] = ..., solved_by_peers: _Optional[int] = ...) -> None: ...

class BundleChunk(_message.Message):
    __slots__ = ("digest", "total_size", "offset", "data", "node_id", "session_id", "prompt_id", "round", "signature", "signer_cert", "tag")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    SIGNER_CERT_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    digest: str
    total_size: int
    offset: int
    data: bytes
    node_id: str
    session_id: str
    prompt_id: str
    round: int
    signature: bytes
    signer_cert: bytes
    tag: RequestTag
    def __init__(self, digest: _Optional[str] = ..., total_size: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., node_id: _Optional[str] = ..., session_id: _Optional[str] = ..., prompt_id: _Optional[str] = ..., round: _Optional[int] = ..., signature: _Optional[bytes] = ..., signer_cert: _Optional[bytes] = ..., tag: _Optional[_Union[RequestTag, _Mapping]] = ...) -> None: ...

class UploadResponse(_message.Message):
    __slots__ = ("digest", "stored")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    digest: str
    stored: bool
    def __init__(self, digest: _Optional[str] = ..., stored: _Optional[bool] = ...) -> None: ...

class HasBundlesRequest(_message.Message):
    __slots__ = ("node_id", "session_id", "digests")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    session_id: str
    digests: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_id: _Optional[str] = ..., session_id: _Optional[str] = ..., digests: _Optional[_Iterable[str]] = ...) -> None: ...

class HasBundlesResponse(_message.Message):
    __slots__ = ("present",)
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    present: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, present: _Optional[_Iterable[str]] = ...) -> None: ...

class FetchBundleRequest(_message.Message):
    __slots__ = ("node_id", "session_id", "digest")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    session_id: str
    digest: str
    def __init__(self, node_id: _Optional[str] = ..., session_id: _Optional[str] = ..., digest: _Optional[str] = ...) -> None: ...

class CompatibilityReport(_message.Message):
    __slots__ = ("node_id", "session_id", "round", "entries", "tag")
    class Entry(_message.Message):
        __slots__ = ("source_node_id", "prompt_id", "mean_s", "admitted_fraction", "rejected", "undelivered")
        SOURCE_NODE_ID_FIELD_NUMBER: _ClassVar[int]
        PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
        MEAN_S_FIELD_NUMBER: _ClassVar[int]
        ADMITTED_FRACTION_FIELD_NUMBER: _ClassVar[int]
        REJECTED_FIELD_NUMBER: _ClassVar[int]
        UNDELIVERED_FIELD_NUMBER: _ClassVar[int]
        source_node_id: str
        prompt_id: str
        mean_s: float
        admitted_fraction: float
        rejected: bool
        undelivered: bool
        def __init__(self, source_node_id: _Optional[str] = ..., prompt_id: _Optional[str] = ..., mean_s: _Optional[float] = ..., admitted_fraction: _Optional[float] = ..., rejected: _Optional[bool] = ..., undelivered: _Optional[bool] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    session_id: str
    round: int
    entries: _containers.RepeatedCompositeFieldContainer[CompatibilityReport.Entry]
    tag: RequestTag
    def __init__(self, node_id: _Optional[str] = ..., session_id: _Optional[str] = ..., round: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[CompatibilityReport.Entry, _Mapping]]] = ..., tag: _Optional[_Union[RequestTag, _Mapping]] = ...) -> None: ...

class ReportResponse(_message.Message):
    __slots__ = ("accepted", "duplicates")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    duplicates: int
    def __init__(self, accepted: _Optional[int] = ..., duplicates: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("manifest", "current_round", "nodes", "pairs", "bundles", "bundle_bytes", "pairs_total", "max_node_summaries", "max_node_bundle_bytes")
    class Node(_message.Message):
        __slots__ = ("node_id", "model_id", "state", "round", "published", "last_seen_s", "summaries_held", "bundle_bytes_held")
        NODE_ID_FIELD_NUMBER: _ClassVar[int]
        MODEL_ID_FIELD_NUMBER: _ClassVar[int]
        STATE_FIELD_NUMBER: _ClassVar[int]
        ROUND_FIELD_NUMBER: _ClassVar[int]
        PUBLISHED_FIELD_NUMBER: _ClassVar[int]
        LAST_SEEN_S_FIELD_NUMBER: _ClassVar[int]
        SUMMARIES_HELD_FIELD_NUMBER: _ClassVar[int]
        BUNDLE_BYTES_HELD_FIELD_NUMBER: _ClassVar[int]
        node_id: str
        model_id: str
        state: str
        round: int
        published: int
        last_seen_s: float
        summaries_held: int
        bundle_bytes_held: int
        def __init__(self, node_id: _Optional[str] = ..., model_id: _Optional[str] = ..., state: _Optional[str] = ..., round: _Optional[int] = ..., published: _Optional[int] = ..., last_seen_s: _Optional[float] = ..., summaries_held: _Optional[int] = ..., bundle_bytes_held: _Optional[int] = ...) -> None: ...
    class Pair(_message.Message):
        __slots__ = ("source", "receiver", "groups", "mean_s", "admitted_fraction", "rejected", "reported", "undelivered")
        SOURCE_FIELD_NUMBER: _ClassVar[int]
        RECEIVER_FIELD_NUMBER: _ClassVar[int]
        GROUPS_FIELD_NUMBER: _ClassVar[int]
        MEAN_S_FIELD_NUMBER: _ClassVar[int]
        ADMITTED_FRACTION_FIELD_NUMBER: _ClassVar[int]
        REJECTED_FIELD_NUMBER: _ClassVar[int]
        REPORTED_FIELD_NUMBER: _ClassVar[int]
        UNDELIVERED_FIELD_NUMBER: _ClassVar[int]
        source: str
        receiver: str
        groups: int
        mean_s: float
        admitted_fraction: float
        rejected: int
        reported: int
        undelivered: int
        def __init__(self, source: _Optional[str] = ..., receiver: _Optional[str] = ..., groups: _Optional[int] = ..., mean_s: _Optional[float] = ..., admitted_fraction: _Optional[float] = ..., rejected: _Optional[int] = ..., reported: _Optional[int] = ..., undelivered: _Optional[int] = ...) -> None: ...
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CURRENT_ROUND_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    PAIRS_FIELD_NUMBER: _ClassVar[int]
    BUNDLES_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAIRS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MAX_NODE_SUMMARIES_FIELD_NUMBER: _ClassVar[int]
    MAX_NODE_BUNDLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    manifest: Manifest
    current_round: int
    nodes: _containers.RepeatedCompositeFieldContainer[StatusResponse.Node]
    pairs: _containers.RepeatedCompositeFieldContainer[StatusResponse.Pair]
    bundles: int
    bundle_bytes: int
    pairs_total: int
    max_node_summaries: int
    max_node_bundle_bytes: int
    def __init__(self, manifest: _Optional[_Union[Manifest, _Mapping]] = ..., current_round: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[StatusResponse.Node, _Mapping]]] = ..., pairs: _Optional[_Iterable[_Union[StatusResponse.Pair, _Mapping]]] = ..., bundles: _Optional[int] = ..., bundle_bytes: _Optional[int] = ..., pairs_total: _Optional[int] = ..., max_node_summaries: _Optional[int] = ..., max_node_bundle_bytes: _Optional[int] = ...) -> None: ...

class Scalar(_message.Message):
    __slots__ = ("name", "value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: float
    def __init__(self, name: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...

class ScalarsRequest(_message.Message):
    __slots__ = ("node_id", "session_id", "step", "scalars")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SCALARS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    session_id: str
    step: int
    scalars: _containers.RepeatedCompositeFieldContainer[Scalar]
    def __init__(self, node_id: _Optional[str] = ..., session_id: _Optional[str] = ..., step: _Optional[int] = ..., scalars: _Optional[_Iterable[_Union[Scalar, _Mapping]]] = ...) -> None: ...

class ScalarsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
