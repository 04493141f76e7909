"""The daemon's serving core: datasets, streams on one shared engine, leases, stats.

``Daemon.create(datasets, num_workers=...)`` opens and validates the datasets and starts the one
shared engine; ``beton_serve.rpc`` exposes it over gRPC and ``beton_serve.cli`` runs it. Nothing
here touches protobuf.
"""

from __future__ import annotations

from beton_serve.daemon._backend import Backend, EngineBackend, OutputInfo, SourceParams
from beton_serve.daemon._daemon import MAX_BATCH_SIZE, Daemon, ShuttingDown, local_identity
from beton_serve.daemon._datasets import Dataset, DatasetTable, expand_dataset_args
from beton_serve.daemon._messages import (
    DaemonStats,
    OpRequest,
    PipelineRequest,
    StreamOpened,
    StreamRequest,
    StreamStats,
)
from beton_serve.daemon._stream import (
    BatchOut,
    ClientEvent,
    CreditEvent,
    EpochEnd,
    ReleaseSlot,
    StartEpoch,
    TensorOut,
)

__all__ = [
    "MAX_BATCH_SIZE",
    "Backend",
    "BatchOut",
    "ClientEvent",
    "CreditEvent",
    "Daemon",
    "DaemonStats",
    "Dataset",
    "DatasetTable",
    "EngineBackend",
    "EpochEnd",
    "OpRequest",
    "OutputInfo",
    "PipelineRequest",
    "ReleaseSlot",
    "ShuttingDown",
    "SourceParams",
    "StartEpoch",
    "StreamOpened",
    "StreamRequest",
    "StreamStats",
    "TensorOut",
    "expand_dataset_args",
    "local_identity",
]
