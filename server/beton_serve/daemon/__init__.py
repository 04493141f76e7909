"""The daemon's serving core: datasets, streams on one shared engine, leases, stats.

``Daemon.create(datasets, num_workers=...)`` opens and validates the datasets and starts the one
shared engine; ``beton_serve.rpc`` exposes it over gRPC (with :func:`producer_factory` for the
grpc transport's batch method) and ``beton_serve.cli`` runs it (with :func:`parse_precompile`
and :func:`start_precompile` for the config's ``[[precompile]]`` tables). Nothing here touches
protobuf.

A stream's batches reach its client through one :class:`Publisher` per serving path (the
``Batches`` call, the shm notice channel, the grpc batch method); the stream itself owns the
credits, the slots and the booking of every batch (``daemon._publish``).
"""

from __future__ import annotations

from beton_serve.daemon._backend import Backend, EngineBackend, OutputInfo, SourceParams
from beton_serve.daemon._daemon import (
    MAX_BATCH_SIZE,
    Daemon,
    ShuttingDown,
    local_identity,
    ring_budget,
)
from beton_serve.daemon._datasets import Dataset, DatasetTable, expand_dataset_args
from beton_serve.daemon._events import (
    ClientEvent,
    CreditEvent,
    ReleaseSlot,
    StartEpoch,
)
from beton_serve.daemon._grpc_batches import SAMPLE_IDS, producer_factory
from beton_serve.daemon._messages import (
    DaemonStats,
    DecodeGroupRow,
    OpRequest,
    PipelineRequest,
    StreamOpened,
    StreamRequest,
    StreamStats,
)
from beton_serve.daemon._precompile import (
    PrecompileOp,
    PrecompileResult,
    PrecompileSpec,
    parse_precompile,
    start_precompile,
)
from beton_serve.daemon._publish import BatchOut, EpochEnd, Finished, Publisher, TensorOut

__all__ = [
    "Backend",
    "BatchOut",
    "ClientEvent",
    "CreditEvent",
    "Daemon",
    "DaemonStats",
    "Dataset",
    "DatasetTable",
    "DecodeGroupRow",
    "EngineBackend",
    "EpochEnd",
    "Finished",
    "MAX_BATCH_SIZE",
    "OpRequest",
    "OutputInfo",
    "PipelineRequest",
    "PrecompileOp",
    "PrecompileResult",
    "PrecompileSpec",
    "Publisher",
    "ReleaseSlot",
    "SAMPLE_IDS",
    "ShuttingDown",
    "SourceParams",
    "StartEpoch",
    "StreamOpened",
    "StreamRequest",
    "StreamStats",
    "TensorOut",
    "expand_dataset_args",
    "local_identity",
    "parse_precompile",
    "producer_factory",
    "ring_budget",
    "start_precompile",
]
