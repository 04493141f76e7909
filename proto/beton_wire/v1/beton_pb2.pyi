from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper

DESCRIPTOR: _descriptor.FileDescriptor

class Order(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ORDER_UNSPECIFIED: _ClassVar[Order]
    ORDER_SEQUENTIAL: _ClassVar[Order]
    ORDER_RANDOM: _ClassVar[Order]
    ORDER_QUASI_RANDOM: _ClassVar[Order]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
    DTYPE_INT8: _ClassVar[DType]
    DTYPE_UINT16: _ClassVar[DType]
    DTYPE_INT16: _ClassVar[DType]
    DTYPE_UINT32: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_UINT64: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]
    DTYPE_BOOL: _ClassVar[DType]
    DTYPE_COMPLEX64: _ClassVar[DType]
    DTYPE_COMPLEX128: _ClassVar[DType]

ORDER_UNSPECIFIED: Order
ORDER_SEQUENTIAL: Order
ORDER_RANDOM: Order
ORDER_QUASI_RANDOM: Order
DTYPE_UNSPECIFIED: DType
DTYPE_UINT8: DType
DTYPE_INT8: DType
DTYPE_UINT16: DType
DTYPE_INT16: DType
DTYPE_UINT32: DType
DTYPE_INT32: DType
DTYPE_UINT64: DType
DTYPE_INT64: DType
DTYPE_FLOAT16: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT64: DType
DTYPE_BOOL: DType
DTYPE_COMPLEX64: DType
DTYPE_COMPLEX128: DType

class ListDatasetsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FieldInfo(_message.Message):
    __slots__ = ("decoders", "name", "type")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    DECODERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    type: str
    decoders: _containers.RepeatedScalarFieldContainer[str]
    def __init__(
        self, name: str | None = ..., type: str | None = ..., decoders: _Iterable[str] | None = ...
    ) -> None: ...

class DatasetInfo(_message.Message):
    __slots__ = ("fields", "name", "num_samples", "schema_key", "shards")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_KEY_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_samples: int
    fields: _containers.RepeatedCompositeFieldContainer[FieldInfo]
    schema_key: str
    shards: _containers.RepeatedScalarFieldContainer[str]
    def __init__(
        self,
        name: str | None = ...,
        num_samples: int | None = ...,
        fields: _Iterable[FieldInfo | _Mapping] | None = ...,
        schema_key: str | None = ...,
        shards: _Iterable[str] | None = ...,
    ) -> None: ...

class ListDatasetsResponse(_message.Message):
    __slots__ = ("datasets",)
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    datasets: _containers.RepeatedCompositeFieldContainer[DatasetInfo]
    def __init__(self, datasets: _Iterable[DatasetInfo | _Mapping] | None = ...) -> None: ...

class DescribeDatasetRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: str | None = ...) -> None: ...

class OpSpec(_message.Message):
    __slots__ = ("name", "params_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    params_json: str
    def __init__(self, name: str | None = ..., params_json: str | None = ...) -> None: ...

class PipelineSpec(_message.Message):
    __slots__ = ("branch_of", "branch_op", "field", "name", "ops", "skip")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    SKIP_FIELD_NUMBER: _ClassVar[int]
    BRANCH_OF_FIELD_NUMBER: _ClassVar[int]
    BRANCH_OP_FIELD_NUMBER: _ClassVar[int]
    name: str
    field: str
    ops: _containers.RepeatedCompositeFieldContainer[OpSpec]
    skip: bool
    branch_of: str
    branch_op: int
    def __init__(
        self,
        name: str | None = ...,
        field: str | None = ...,
        ops: _Iterable[OpSpec | _Mapping] | None = ...,
        skip: bool | None = ...,
        branch_of: str | None = ...,
        branch_op: int | None = ...,
    ) -> None: ...

class HostIdentity(_message.Message):
    __slots__ = ("boot_id", "has_ipc_ns", "hostname", "ipc_ns", "pid", "uid")
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    IPC_NS_FIELD_NUMBER: _ClassVar[int]
    HAS_IPC_NS_FIELD_NUMBER: _ClassVar[int]
    boot_id: str
    hostname: str
    uid: int
    pid: int
    ipc_ns: int
    has_ipc_ns: bool
    def __init__(
        self,
        boot_id: str | None = ...,
        hostname: str | None = ...,
        uid: int | None = ...,
        pid: int | None = ...,
        ipc_ns: int | None = ...,
        has_ipc_ns: bool | None = ...,
    ) -> None: ...

class CudaDevice(_message.Message):
    __slots__ = ("index", "uuid")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    def __init__(self, index: int | None = ..., uuid: str | None = ...) -> None: ...

class Capabilities(_message.Message):
    __slots__ = ("compressions", "cuda", "cuda_devices", "cupy", "torch", "transports")
    TORCH_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    CUPY_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    COMPRESSIONS_FIELD_NUMBER: _ClassVar[int]
    CUDA_DEVICES_FIELD_NUMBER: _ClassVar[int]
    torch: bool
    cuda: bool
    cupy: bool
    transports: _containers.RepeatedScalarFieldContainer[str]
    compressions: _containers.RepeatedScalarFieldContainer[str]
    cuda_devices: _containers.RepeatedCompositeFieldContainer[CudaDevice]
    def __init__(
        self,
        torch: bool | None = ...,
        cuda: bool | None = ...,
        cupy: bool | None = ...,
        transports: _Iterable[str] | None = ...,
        compressions: _Iterable[str] | None = ...,
        cuda_devices: _Iterable[CudaDevice | _Mapping] | None = ...,
    ) -> None: ...

class OpenStreamRequest(_message.Message):
    __slots__ = (
        "batch_size",
        "batches_ahead",
        "capabilities",
        "client_name",
        "compression",
        "custom_fields",
        "dataset",
        "device",
        "distributed",
        "drop_last",
        "file",
        "has_indices",
        "host",
        "indices",
        "order",
        "pipelines",
        "rank",
        "seed",
        "transport",
        "world_size",
    )
    DATASET_FIELD_NUMBER: _ClassVar[int]
    PIPELINES_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DROP_LAST_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    HAS_INDICES_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTED_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCHES_AHEAD_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_FIELDS_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    pipelines: _containers.RepeatedCompositeFieldContainer[PipelineSpec]
    batch_size: int
    order: Order
    seed: int
    drop_last: bool
    indices: _containers.RepeatedScalarFieldContainer[int]
    has_indices: bool
    distributed: bool
    rank: int
    world_size: int
    batches_ahead: int
    transport: str
    device: str
    host: HostIdentity
    capabilities: Capabilities
    client_name: str
    compression: str
    custom_fields: _containers.RepeatedScalarFieldContainer[str]
    file: FileIdentity
    def __init__(
        self,
        dataset: str | None = ...,
        pipelines: _Iterable[PipelineSpec | _Mapping] | None = ...,
        batch_size: int | None = ...,
        order: Order | str | None = ...,
        seed: int | None = ...,
        drop_last: bool | None = ...,
        indices: _Iterable[int] | None = ...,
        has_indices: bool | None = ...,
        distributed: bool | None = ...,
        rank: int | None = ...,
        world_size: int | None = ...,
        batches_ahead: int | None = ...,
        transport: str | None = ...,
        device: str | None = ...,
        host: HostIdentity | _Mapping | None = ...,
        capabilities: Capabilities | _Mapping | None = ...,
        client_name: str | None = ...,
        compression: str | None = ...,
        custom_fields: _Iterable[str] | None = ...,
        file: FileIdentity | _Mapping | None = ...,
    ) -> None: ...

class FileIdentity(_message.Message):
    __slots__ = ("device", "fingerprint", "inode", "mtime_ns", "path", "size")
    PATH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    INODE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MTIME_NS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    path: str
    device: int
    inode: int
    size: int
    mtime_ns: int
    fingerprint: str
    def __init__(
        self,
        path: str | None = ...,
        device: int | None = ...,
        inode: int | None = ...,
        size: int | None = ...,
        mtime_ns: int | None = ...,
        fingerprint: str | None = ...,
    ) -> None: ...

class OutputSpec(_message.Message):
    __slots__ = ("client_ops", "dtype", "name", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_OPS_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    client_ops: _containers.RepeatedCompositeFieldContainer[OpSpec]
    def __init__(
        self,
        name: str | None = ...,
        shape: _Iterable[int] | None = ...,
        dtype: DType | str | None = ...,
        client_ops: _Iterable[OpSpec | _Mapping] | None = ...,
    ) -> None: ...

class TransportRejection(_message.Message):
    __slots__ = ("code", "hint", "reason", "transport")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    HINT_FIELD_NUMBER: _ClassVar[int]
    transport: str
    reason: str
    code: str
    hint: str
    def __init__(
        self,
        transport: str | None = ...,
        reason: str | None = ...,
        code: str | None = ...,
        hint: str | None = ...,
    ) -> None: ...

class ShmSetup(_message.Message):
    __slots__ = (
        "ids_offset",
        "notice_socket",
        "notice_token",
        "release_offset",
        "segment",
        "segment_bytes",
        "slot_bytes",
        "slot_count",
    )
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SLOT_COUNT_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    IDS_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NOTICE_SOCKET_FIELD_NUMBER: _ClassVar[int]
    NOTICE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RELEASE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    segment: str
    slot_count: int
    slot_bytes: int
    segment_bytes: int
    ids_offset: int
    notice_socket: str
    notice_token: bytes
    release_offset: int
    def __init__(
        self,
        segment: str | None = ...,
        slot_count: int | None = ...,
        slot_bytes: int | None = ...,
        segment_bytes: int | None = ...,
        ids_offset: int | None = ...,
        notice_socket: str | None = ...,
        notice_token: bytes | None = ...,
        release_offset: int | None = ...,
    ) -> None: ...

class CudaIpcSetup(_message.Message):
    __slots__ = (
        "device",
        "device_uuid",
        "event_handles",
        "free_event_handles",
        "owner_pid",
        "slab_handles",
        "slot_bytes",
        "slot_count",
    )
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SLOT_COUNT_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLAB_HANDLES_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLES_FIELD_NUMBER: _ClassVar[int]
    FREE_EVENT_HANDLES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    OWNER_PID_FIELD_NUMBER: _ClassVar[int]
    device: int
    slot_count: int
    slot_bytes: int
    slab_handles: _containers.RepeatedScalarFieldContainer[bytes]
    event_handles: _containers.RepeatedScalarFieldContainer[bytes]
    free_event_handles: _containers.RepeatedScalarFieldContainer[bytes]
    device_uuid: str
    owner_pid: int
    def __init__(
        self,
        device: int | None = ...,
        slot_count: int | None = ...,
        slot_bytes: int | None = ...,
        slab_handles: _Iterable[bytes] | None = ...,
        event_handles: _Iterable[bytes] | None = ...,
        free_event_handles: _Iterable[bytes] | None = ...,
        device_uuid: str | None = ...,
        owner_pid: int | None = ...,
    ) -> None: ...

class GrpcSetup(_message.Message):
    __slots__ = ("chunk_bytes", "compression", "method")
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    compression: str
    chunk_bytes: int
    method: str
    def __init__(
        self, compression: str | None = ..., chunk_bytes: int | None = ..., method: str | None = ...
    ) -> None: ...

class TransportSetup(_message.Message):
    __slots__ = ("cuda_ipc", "grpc", "kind", "shm")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    GRPC_FIELD_NUMBER: _ClassVar[int]
    kind: str
    shm: ShmSetup
    cuda_ipc: CudaIpcSetup
    grpc: GrpcSetup
    def __init__(
        self,
        kind: str | None = ...,
        shm: ShmSetup | _Mapping | None = ...,
        cuda_ipc: CudaIpcSetup | _Mapping | None = ...,
        grpc: GrpcSetup | _Mapping | None = ...,
    ) -> None: ...

class OpenStreamResponse(_message.Message):
    __slots__ = (
        "bad_sample_budget",
        "batch_size",
        "dataset_digest",
        "max_credits",
        "num_batches",
        "num_samples",
        "outputs",
        "plan_cached",
        "rejected",
        "stream_id",
        "transport",
    )
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    NUM_BATCHES_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PLAN_CACHED_FIELD_NUMBER: _ClassVar[int]
    MAX_CREDITS_FIELD_NUMBER: _ClassVar[int]
    BAD_SAMPLE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    DATASET_DIGEST_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    outputs: _containers.RepeatedCompositeFieldContainer[OutputSpec]
    transport: TransportSetup
    rejected: _containers.RepeatedCompositeFieldContainer[TransportRejection]
    num_batches: int
    batch_size: int
    num_samples: int
    plan_cached: bool
    max_credits: int
    bad_sample_budget: int
    dataset_digest: str
    def __init__(
        self,
        stream_id: str | None = ...,
        outputs: _Iterable[OutputSpec | _Mapping] | None = ...,
        transport: TransportSetup | _Mapping | None = ...,
        rejected: _Iterable[TransportRejection | _Mapping] | None = ...,
        num_batches: int | None = ...,
        batch_size: int | None = ...,
        num_samples: int | None = ...,
        plan_cached: bool | None = ...,
        max_credits: int | None = ...,
        bad_sample_budget: int | None = ...,
        dataset_digest: str | None = ...,
    ) -> None: ...

class Start(_message.Message):
    __slots__ = ("credits", "epoch", "next_batch", "notices", "stream_id")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NEXT_BATCH_FIELD_NUMBER: _ClassVar[int]
    CREDITS_FIELD_NUMBER: _ClassVar[int]
    NOTICES_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    epoch: int
    next_batch: int
    credits: int
    notices: bool
    def __init__(
        self,
        stream_id: str | None = ...,
        epoch: int | None = ...,
        next_batch: int | None = ...,
        credits: int | None = ...,
        notices: bool | None = ...,
    ) -> None: ...

class Release(_message.Message):
    __slots__ = ("batch_index", "slot", "wait_us")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    BATCH_INDEX_FIELD_NUMBER: _ClassVar[int]
    WAIT_US_FIELD_NUMBER: _ClassVar[int]
    slot: int
    batch_index: int
    wait_us: int
    def __init__(
        self, slot: int | None = ..., batch_index: int | None = ..., wait_us: int | None = ...
    ) -> None: ...

class Credit(_message.Message):
    __slots__ = ("count",)
    COUNT_FIELD_NUMBER: _ClassVar[int]
    count: int
    def __init__(self, count: int | None = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("batch_index", "wait_us")
    BATCH_INDEX_FIELD_NUMBER: _ClassVar[int]
    WAIT_US_FIELD_NUMBER: _ClassVar[int]
    batch_index: int
    wait_us: int
    def __init__(self, batch_index: int | None = ..., wait_us: int | None = ...) -> None: ...

class ClientMessage(_message.Message):
    __slots__ = ("ack", "credit", "release", "start")
    START_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    start: Start
    release: Release
    credit: Credit
    ack: Ack
    def __init__(
        self,
        start: Start | _Mapping | None = ...,
        release: Release | _Mapping | None = ...,
        credit: Credit | _Mapping | None = ...,
        ack: Ack | _Mapping | None = ...,
    ) -> None: ...

class TensorDesc(_message.Message):
    __slots__ = ("dtype", "name", "nbytes", "offset", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    offset: int
    nbytes: int
    def __init__(
        self,
        name: str | None = ...,
        shape: _Iterable[int] | None = ...,
        dtype: DType | str | None = ...,
        offset: int | None = ...,
        nbytes: int | None = ...,
    ) -> None: ...

class BatchReady(_message.Message):
    __slots__ = ("batch_index", "data", "epoch", "length", "sample_ids", "slot", "tensors")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BATCH_INDEX_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    batch_index: int
    slot: int
    length: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorDesc]
    sample_ids: bytes
    data: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(
        self,
        epoch: int | None = ...,
        batch_index: int | None = ...,
        slot: int | None = ...,
        length: int | None = ...,
        tensors: _Iterable[TensorDesc | _Mapping] | None = ...,
        sample_ids: bytes | None = ...,
        data: _Iterable[bytes] | None = ...,
    ) -> None: ...

class EndOfEpoch(_message.Message):
    __slots__ = ("batches", "epoch")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    batches: int
    def __init__(self, epoch: int | None = ..., batches: int | None = ...) -> None: ...

class ServerMessage(_message.Message):
    __slots__ = ("batch", "end")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    batch: BatchReady
    end: EndOfEpoch
    def __init__(
        self, batch: BatchReady | _Mapping | None = ..., end: EndOfEpoch | _Mapping | None = ...
    ) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StreamStats(_message.Message):
    __slots__ = (
        "age_s",
        "batches_sent",
        "client_name",
        "client_pid",
        "client_wait_us",
        "dataset",
        "samples_sent",
        "slot_count",
        "slots_leased",
        "stream_id",
        "transport",
    )
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    CLIENT_PID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    BATCHES_SENT_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_SENT_FIELD_NUMBER: _ClassVar[int]
    SLOTS_LEASED_FIELD_NUMBER: _ClassVar[int]
    SLOT_COUNT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_WAIT_US_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    dataset: str
    client_name: str
    client_pid: int
    transport: str
    batches_sent: int
    samples_sent: int
    slots_leased: int
    slot_count: int
    client_wait_us: int
    age_s: float
    def __init__(
        self,
        stream_id: str | None = ...,
        dataset: str | None = ...,
        client_name: str | None = ...,
        client_pid: int | None = ...,
        transport: str | None = ...,
        batches_sent: int | None = ...,
        samples_sent: int | None = ...,
        slots_leased: int | None = ...,
        slot_count: int | None = ...,
        client_wait_us: int | None = ...,
        age_s: float | None = ...,
    ) -> None: ...

class DatasetStats(_message.Message):
    __slots__ = ("bad_samples", "batches_decoded", "name", "refused", "samples_decoded")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_DECODED_FIELD_NUMBER: _ClassVar[int]
    BATCHES_DECODED_FIELD_NUMBER: _ClassVar[int]
    BAD_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    name: str
    samples_decoded: int
    batches_decoded: int
    bad_samples: int
    refused: str
    def __init__(
        self,
        name: str | None = ...,
        samples_decoded: int | None = ...,
        batches_decoded: int | None = ...,
        bad_samples: int | None = ...,
        refused: str | None = ...,
    ) -> None: ...

class DecodeGroupStats(_message.Message):
    __slots__ = (
        "dataset",
        "decode",
        "decoded",
        "delivered",
        "detached",
        "evicted",
        "field",
        "hits",
        "live_bytes",
        "members",
        "order",
        "waits",
    )
    DATASET_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    DETACHED_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_FIELD_NUMBER: _ClassVar[int]
    DECODED_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    LIVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    WAITS_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    field: str
    order: str
    members: int
    detached: int
    delivered: int
    decoded: int
    hits: int
    evicted: int
    live_bytes: int
    decode: str
    waits: int
    def __init__(
        self,
        dataset: str | None = ...,
        field: str | None = ...,
        order: str | None = ...,
        members: int | None = ...,
        detached: int | None = ...,
        delivered: int | None = ...,
        decoded: int | None = ...,
        hits: int | None = ...,
        evicted: int | None = ...,
        live_bytes: int | None = ...,
        decode: str | None = ...,
        waits: int | None = ...,
    ) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = (
        "buffer_bytes",
        "compiled_plans",
        "datasets",
        "decode_groups",
        "idle_buffer_bytes",
        "idle_buffers_freed",
        "max_idle_buffer_bytes",
        "max_ring_bytes",
        "pid",
        "queue_depth",
        "ring_bytes",
        "shm_bytes",
        "streams",
        "streams_opened",
        "uptime_s",
        "worker_utilisation",
        "workers",
        "workers_replaced",
    )
    PID_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    SHM_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPILED_PLANS_FIELD_NUMBER: _ClassVar[int]
    STREAMS_OPENED_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    WORKER_UTILISATION_FIELD_NUMBER: _ClassVar[int]
    WORKERS_REPLACED_FIELD_NUMBER: _ClassVar[int]
    DECODE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    MAX_RING_BYTES_FIELD_NUMBER: _ClassVar[int]
    RING_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUFFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    IDLE_BUFFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_IDLE_BUFFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    IDLE_BUFFERS_FREED_FIELD_NUMBER: _ClassVar[int]
    pid: int
    uptime_s: float
    workers: int
    streams: _containers.RepeatedCompositeFieldContainer[StreamStats]
    datasets: _containers.RepeatedCompositeFieldContainer[DatasetStats]
    shm_bytes: int
    compiled_plans: int
    streams_opened: int
    queue_depth: int
    worker_utilisation: float
    workers_replaced: int
    decode_groups: _containers.RepeatedCompositeFieldContainer[DecodeGroupStats]
    max_ring_bytes: int
    ring_bytes: int
    buffer_bytes: int
    idle_buffer_bytes: int
    max_idle_buffer_bytes: int
    idle_buffers_freed: int
    def __init__(
        self,
        pid: int | None = ...,
        uptime_s: float | None = ...,
        workers: int | None = ...,
        streams: _Iterable[StreamStats | _Mapping] | None = ...,
        datasets: _Iterable[DatasetStats | _Mapping] | None = ...,
        shm_bytes: int | None = ...,
        compiled_plans: int | None = ...,
        streams_opened: int | None = ...,
        queue_depth: int | None = ...,
        worker_utilisation: float | None = ...,
        workers_replaced: int | None = ...,
        decode_groups: _Iterable[DecodeGroupStats | _Mapping] | None = ...,
        max_ring_bytes: int | None = ...,
        ring_bytes: int | None = ...,
        buffer_bytes: int | None = ...,
        idle_buffer_bytes: int | None = ...,
        max_idle_buffer_bytes: int | None = ...,
        idle_buffers_freed: int | None = ...,
    ) -> None: ...
