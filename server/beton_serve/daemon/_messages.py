"""The daemon's plain request, reply and snapshot types (``beton_serve.rpc`` converts protobuf
messages to and from them, so the daemon itself never touches protobuf)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from beton_wire.file_identity import FileIdentity
from numpy.typing import NDArray

from beton_serve.daemon._backend import OutputInfo
from beton_serve.transport.base import TransportSetup
from beton_serve.transport.negotiate import ClientOffer, Rejection

__all__ = [
    "DaemonStats",
    "DecodeGroupRow",
    "OpRequest",
    "PipelineRequest",
    "StreamOpened",
    "StreamRequest",
    "StreamStats",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class OpRequest:
    """One op as sent by a client: registered name and JSON parameters (already decoded)."""

    name: str
    params: Mapping[str, Any]


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineRequest:
    """One output pipeline: its name, the field it reads, its daemon-side ops, or skipped.

    A branch (FFCV's ``PipelineSpec(source=<op>)``) names the pipeline ``branch_of`` and the
    index ``branch_op`` of the op in its ``ops`` whose output it continues from; its ``ops``
    are its own (no decoder).
    """

    name: str
    field: str = ""
    ops: tuple[OpRequest, ...] = ()
    skip: bool = False
    branch_of: str = ""
    branch_op: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class StreamRequest:
    """Everything a client asks for when it opens a stream (validated by :meth:`Daemon.open_stream`)."""

    dataset: str
    pipelines: tuple[PipelineRequest, ...]
    batch_size: int
    order: str = "SEQUENTIAL"
    seed: int = 0
    drop_last: bool = False
    #: Sample ids (``rpc`` builds a uint64 array: no Python int per index); ``None`` for all.
    indices: tuple[int, ...] | NDArray[np.uint64] | None = None
    distributed: bool = False
    rank: int = 0
    world_size: int = 1
    batches_ahead: int = 3
    offer: ClientOffer
    client_name: str = ""
    custom_fields: tuple[str, ...] = ()
    #: The file the client named (``Loader(path)``), checked against the served files by
    #: identity; ``None`` when it named a dataset.
    file: FileIdentity | None = None
    #: The peer is the daemon's own user on its Unix socket (known from the kernel, never from
    #: the request): it may open any file that user can read (files opened on demand).
    owner_peer: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class StreamOpened:
    """The reply to an accepted stream."""

    stream_id: str
    outputs: tuple[OutputInfo, ...]
    setup: TransportSetup
    rejected: tuple[Rejection, ...]
    num_batches: int
    batch_size: int
    num_samples: int
    plan_cached: bool
    max_credits: int
    bad_sample_budget: int = 0
    #: The dataset's files by content (``Dataset.digest``).
    dataset_digest: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class StreamStats:
    """A snapshot of one stream."""

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


@dataclass(frozen=True, kw_only=True, slots=True)
class DecodeGroupRow:
    """One decode group (``beton_serve.fields.decode_cache``) in a daemon snapshot.

    Attributes:
        dataset: the file's name (the group's label).
        field: the decoded field.
        order: a short digest of the group's order key (order, seed, indices, rank, world).
        decode: how the group's shared decode is made (``"full"`` or ``"min_side=S"``).
        members: streams in the group now; ``detached``: those decoding alone for lagging.
        delivered: samples handed to members; ``decoded``: JPEG decodes run for them.
        hits: samples another member had decoded; ``evicted``: entries dropped by the bound.
        live_bytes: bytes of the group's cached images now.
        waits: times a member waited for another member's decode of the same sample.
    """

    dataset: str
    field: str
    order: str
    decode: str
    members: int
    detached: int
    delivered: int
    decoded: int
    hits: int
    evicted: int
    live_bytes: int
    waits: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class DaemonStats:
    """A snapshot of the daemon (what the Stats RPC returns)."""

    pid: int
    uptime_s: float
    workers: int
    streams: tuple[StreamStats, ...]
    datasets: tuple[tuple[str, int, int], ...]  # (name, samples_decoded, batches_decoded)
    shm_bytes: int
    compiled_plans: int
    streams_opened: int
    #: Batches queued in the worker pool, not yet started (approximate).
    queue_depth: int = 0
    #: Share of the workers' time spent running batches since the previous snapshot, in [0, 1].
    worker_utilisation: float = 0.0
    #: Workers that died and were replaced (their batches were redone).
    workers_replaced: int = 0
    #: ``(dataset, samples skipped under the bad-sample budget)``.
    bad_samples: tuple[tuple[str, int], ...] = ()
    #: ``(dataset, why)`` for each dataset refused until a restart (a file changed under it).
    refused: tuple[tuple[str, str], ...] = ()
    #: ``(op, seconds, batches)``: time each op spent, summed over every batch (all plans).
    op_seconds: tuple[tuple[str, float, int], ...] = ()
    #: Decode groups (issue 16): samples decoded against samples delivered, per group.
    decode_groups: tuple[DecodeGroupRow, ...] = ()
    #: The stream memory budget (``max_ring_bytes``; 0: none) and what counts against it: the
    #: open streams' batch slots and the sharing groups' arenas.
    max_ring_bytes: int = 0
    ring_bytes: int = 0
    #: The ops' buffers (``pipeline.workspace_memory``): all live ones (running or kept), the
    #: kept ones, and the bound on those (``max_idle_buffer_bytes``).
    buffer_bytes: int = 0
    idle_buffer_bytes: int = 0
    max_idle_buffer_bytes: int = 0
    #: Kept sets freed to stay within ``max_idle_buffer_bytes``, over the daemon's life.
    idle_buffers_freed: int = 0
