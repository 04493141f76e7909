"""Protobuf messages <-> the daemon's dataclasses (the only module that reads message fields).

Everything received is validated here for *shape* (JSON that parses to an object, enum values in
range, sizes within ``beton_wire.limits``, checked before anything proportional to the input is
built); the daemon validates *meaning*. Nothing is ever unpickled or executed. Client-supplied
text is echoed in errors through ``short_repr`` only.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from beton_wire.file_identity import FileIdentity
from beton_wire.limits import (
    MAX_INDICES,
    MAX_NAME_CHARS,
    MAX_OPS,
    MAX_PARAMS_BYTES,
    MAX_PATH_CHARS,
    MAX_PIPELINES,
    MAX_SPEC_BYTES,
    MAX_WIRE_RECORDS,
    parse_params,
    short_repr,
)
from beton_wire.slots import DTYPE_NAMES
from beton_wire.v1 import beton_pb2 as pb

from beton_serve.daemon import (
    BatchOut,
    ClientEvent,
    CreditEvent,
    DaemonStats,
    Dataset,
    EpochEnd,
    OpRequest,
    PipelineRequest,
    ReleaseSlot,
    StartEpoch,
    StreamOpened,
    StreamRequest,
)
from beton_serve.errors import SpecError
from beton_serve.transport.negotiate import ClientOffer
from beton_serve.transport.peer import UNIX_SOCKET, PeerCredentials

__all__ = [
    "MAX_INDICES",
    "MAX_PARAMS_BYTES",
    "MAX_WIRE_RECORDS",
    "batch_message",
    "check_open_stream_bytes",
    "dataset_info",
    "dataset_name",
    "event_from_message",
    "opened_message",
    "stats_message",
    "stream_request",
]

_ORDERS = {
    pb.ORDER_UNSPECIFIED: "SEQUENTIAL",
    pb.ORDER_SEQUENTIAL: "SEQUENTIAL",
    pb.ORDER_RANDOM: "RANDOM",
    pb.ORDER_QUASI_RANDOM: "QUASI_RANDOM",
}
_DTYPE_CODES: dict[str, Any] = {name: code for code, name in enumerate(DTYPE_NAMES) if name}
#: Wire types (protobuf encoding).
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
#: Where OpenStreamRequest's repeated fields are: a field number of a sub-message that holds
#: some -> that sub-message's own map (PipelineSpec.ops and Capabilities' lists are leaves).
_NESTED: dict[int, dict[int, Any]] = {2: {}, 16: {}}
#: OpenStreamRequest.indices.
_INDICES_FIELD = 7
_STEP = 1 << 20


def _text(value: str, what: str, limit: int = MAX_NAME_CHARS) -> str:
    """``value`` if it has at most ``limit`` characters (SpecError otherwise, echoing its start)."""
    if len(value) > limit:
        raise SpecError(
            f"{what} {short_repr(value)} is longer than the {limit} characters a request may use"
        )
    return value


def _params(op: pb.OpSpec, pipeline: str) -> dict[str, Any]:
    try:
        return parse_params(op.params_json)
    except ValueError as exc:
        raise SpecError(
            f"pipeline {short_repr(pipeline)}, op {short_repr(op.name)}: {exc}"
        ) from None


def _pipelines(msg: pb.OpenStreamRequest) -> tuple[PipelineRequest, ...]:
    if len(msg.pipelines) > MAX_PIPELINES:
        raise SpecError(
            f"the request has {len(msg.pipelines)} pipelines; at most {MAX_PIPELINES} are accepted"
        )
    spec_bytes = 0
    out = []
    for p in msg.pipelines:
        name = _text(p.name, "pipeline name")
        _text(p.field, f"pipeline {short_repr(name)}: field name")
        if len(p.ops) > MAX_OPS:
            raise SpecError(
                f"pipeline {short_repr(name)} has {len(p.ops)} daemon-side ops; at most "
                f"{MAX_OPS} are accepted"
            )
        ops = []
        for o in p.ops:
            _text(o.name, f"pipeline {short_repr(name)}: op name")
            spec_bytes += len(o.name) + len(o.params_json)
            if spec_bytes > MAX_SPEC_BYTES:
                raise SpecError(
                    f"the pipelines' names and parameters exceed {MAX_SPEC_BYTES} bytes in all"
                )
            ops.append(OpRequest(name=o.name, params=_params(o, name)))
        branch_of = _text(p.branch_of, f"pipeline {short_repr(name)}: branch_of")
        out.append(
            PipelineRequest(
                name=name,
                field=p.field,
                skip=p.skip,
                ops=tuple(ops),
                branch_of=branch_of,
                branch_op=int(p.branch_op),
            )
        )
    return tuple(out)


def _indices(msg: pb.OpenStreamRequest) -> np.ndarray | None:
    if not msg.has_indices:
        return None
    n = len(msg.indices)  # O(1): the repeated field is already parsed, no Python list yet
    if n == 0:
        raise SpecError(
            "indices=[] selects no samples; pass indices=None (has_indices=false) for every "
            "sample of the dataset"
        )
    if n > MAX_INDICES:
        raise SpecError(f"the request carries {n} indices; at most {MAX_INDICES} are accepted")
    # one uint64 array, never a list of Python ints (8 bytes per index instead of ~36)
    return np.fromiter(msg.indices, dtype=np.uint64, count=n)


def _varint(raw: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(raw) or shift > 63:
            raise IndexError(pos)
        b = raw[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def _walk(
    view: memoryview,
    data: np.ndarray,
    pos: int,
    end: int,
    nested: dict[int, dict[int, Any]],
    counts: list[int],
    top: bool,
) -> None:
    """Count records and indices in ``view[pos:end]`` (see :func:`check_open_stream_bytes`)."""
    while pos < end:
        key, pos = _varint(view, pos)
        number, wire = key >> 3, key & 7
        counts[0] += 1
        if counts[0] > MAX_WIRE_RECORDS:
            raise SpecError(
                f"the request has more than {MAX_WIRE_RECORDS} fields and list entries (an "
                "OpenStreamRequest with its limits has fewer; repeated numbers are sent packed)"
            )
        if wire == _VARINT:
            _, pos = _varint(view, pos)
            counts[1] += top and number == _INDICES_FIELD  # an unpacked index
        elif wire == _LEN:
            size, pos = _varint(view, pos)
            stop = min(pos + size, end)
            if top and number == _INDICES_FIELD:  # packed: each varint ends at a byte < 0x80
                for i in range(pos, stop, _STEP):
                    counts[1] += int(np.count_nonzero(data[i : min(i + _STEP, stop)] < 0x80))
                if counts[1] > MAX_INDICES:
                    return
            elif number in nested:
                _walk(view, data, pos, stop, nested[number], counts, False)
            pos += size
        elif wire == _I64:
            pos += 8
        elif wire == _I32:
            pos += 4
        else:
            raise IndexError(pos)  # groups are not in our schema: protobuf refuses the message


def check_open_stream_bytes(raw: bytes) -> None:
    """Refuse a serialised ``OpenStreamRequest`` that is too big to parse, before parsing it.

    Parsing costs memory per list entry: 8 bytes per index (13 M one-byte indices: 104 MB),
    a message per pipeline or op (millions of empty two-byte entries: gigabytes), before
    :func:`stream_request` could count them. This walks the records of the request and of the
    sub-messages that hold lists (pipelines, capabilities), up to :data:`MAX_WIRE_RECORDS` of
    them, and counts the packed ``indices`` with NumPy in 1 MiB steps, without copying:
    about 4 ms for 40 MB of indices, about 0.1 s for a request at the record limit. What it
    cannot walk (truncated, corrupt) is left to protobuf, which reports it as malformed.

    Raises:
        SpecError: more than :data:`MAX_INDICES` indices, or more than
            :data:`MAX_WIRE_RECORDS` records.
    """
    counts = [0, 0]  # records, indices
    try:
        _walk(memoryview(raw), np.frombuffer(raw, np.uint8), 0, len(raw), _NESTED, counts, True)
    except IndexError:
        return  # truncated or corrupt: protobuf reports it
    if counts[1] > MAX_INDICES:
        raise SpecError(
            f"the request carries more than {MAX_INDICES} indices; at most {MAX_INDICES} are "
            "accepted (split the dataset, or write the subset to its own .beton)"
        )


def dataset_name(msg: pb.DescribeDatasetRequest) -> str:
    """The dataset a ``DescribeDataset`` call names (SpecError when it is absurdly long)."""
    return _text(msg.name, "dataset name", MAX_PATH_CHARS)


def stream_request(
    msg: pb.OpenStreamRequest, peer: PeerCredentials = PeerCredentials(uid=None)
) -> StreamRequest:
    """Build the daemon's request; raises ``SpecError`` for malformed fields.

    The offer's uid and pid are ``peer``'s (the kernel's, ``transport.peer``), never the ones the
    client wrote in ``msg.host``; the default ``peer`` is unverified (no uid, no pid).
    """
    if msg.order not in _ORDERS:
        raise SpecError(f"unknown order value {msg.order}; use SEQUENTIAL, RANDOM or QUASI_RANDOM")
    _text(msg.dataset, "dataset name", MAX_PATH_CHARS)
    for value, what in (
        (msg.transport, "transport"),
        (msg.device, "device"),
        (msg.compression, "compression"),
        (msg.client_name, "client_name"),
        (msg.host.boot_id, "host.boot_id"),
        (msg.host.hostname, "host.hostname"),
    ):
        _text(value, what)
    if msg.HasField("file"):
        _text(msg.file.path, "file path", MAX_PATH_CHARS)
        _text(msg.file.fingerprint, "file fingerprint")
    for items, what in (
        (msg.custom_fields, "custom fields"),
        (msg.capabilities.cuda_devices, "CUDA devices"),
    ):
        if len(items) > MAX_PIPELINES:
            raise SpecError(f"the request lists {len(items)} {what}; at most {MAX_PIPELINES}")
    for d in msg.capabilities.cuda_devices:
        _text(d.uuid, "CUDA device uuid")
    for f in msg.custom_fields:
        _text(f, "custom field name")
    indices = _indices(msg)
    pipelines = _pipelines(msg)
    h = msg.host
    caps = msg.capabilities
    offer = ClientOffer.from_dict(
        {
            "identity": {
                "boot_id": h.boot_id,
                "hostname": h.hostname,
                "uid": peer.uid,  # never h.uid / h.pid: a client may write anything there
                "pid": peer.pid,
                "ipc_ns": h.ipc_ns if h.has_ipc_ns else None,
            },
            "device": msg.device or "cpu",
            "transport": msg.transport or "auto",
            "has_torch": caps.torch,
            "has_cuda": caps.cuda,
            "has_cupy": caps.cupy,
            "cuda_devices": [{"index": d.index, "uuid": d.uuid} for d in caps.cuda_devices],
        }
    )
    return StreamRequest(
        dataset=msg.dataset,
        pipelines=pipelines,
        batch_size=msg.batch_size,
        order=_ORDERS[msg.order],
        seed=msg.seed,
        drop_last=msg.drop_last,
        indices=indices,
        distributed=msg.distributed,
        # no defaults for 0: world_size=0 and batches_ahead=0 are refused (Daemon._validate)
        rank=msg.rank if msg.distributed else 0,
        world_size=msg.world_size if msg.distributed else 1,
        batches_ahead=msg.batches_ahead,
        offer=offer,
        client_name=msg.client_name,
        custom_fields=tuple(msg.custom_fields),
        file=_file_identity(msg.file) if msg.HasField("file") else None,
        owner_peer=peer.source == UNIX_SOCKET,
    )


def _file_identity(f: pb.FileIdentity) -> FileIdentity:
    return FileIdentity(
        path=f.path,
        device=f.device,
        inode=f.inode,
        size=f.size,
        mtime_ns=f.mtime_ns,
        fingerprint=f.fingerprint,
    )


def opened_message(o: StreamOpened) -> pb.OpenStreamResponse:
    """The OpenStream reply."""
    setup = pb.TransportSetup(kind=o.setup.kind)
    if o.setup.kind == "shm":
        setup.shm.CopyFrom(
            pb.ShmSetup(
                segment=o.setup.segment,
                slot_count=o.setup.slot_count,
                slot_bytes=o.setup.slot_bytes,
                segment_bytes=o.setup.segment_bytes,
                ids_offset=o.setup.ids_offset,
                release_offset=o.setup.release_offset,
                notice_socket=o.setup.notice_socket,
                notice_token=o.setup.notice_token,
            )
        )
    elif o.setup.kind == "cuda_ipc":
        extra = o.setup.extra
        setup.cuda_ipc.CopyFrom(
            pb.CudaIpcSetup(
                device=int(extra.get("device", 0)),
                slot_count=o.setup.slot_count,
                slot_bytes=o.setup.slot_bytes,
                slab_handles=list(extra.get("slab_handles", ())),
                event_handles=list(extra.get("event_handles", ())),
                free_event_handles=list(extra.get("free_event_handles", ())),
                device_uuid=str(extra.get("device_uuid", "")),
                owner_pid=int(extra.get("owner_pid", 0)),
            )
        )
    elif o.setup.kind == "grpc":
        extra = o.setup.extra
        setup.grpc.CopyFrom(
            pb.GrpcSetup(
                compression=str(extra.get("compression", "")),
                chunk_bytes=int(extra.get("chunk_bytes", 0)),
                method=str(extra.get("method", "")),
            )
        )
    return pb.OpenStreamResponse(
        stream_id=o.stream_id,
        outputs=[
            pb.OutputSpec(
                name=x.name,
                shape=list(x.shape),
                dtype=_DTYPE_CODES[x.dtype],
                client_ops=[
                    pb.OpSpec(name=n, params_json=json.dumps(p, sort_keys=True, default=str))
                    for n, p in x.client_ops
                ],
            )
            for x in o.outputs
        ],
        transport=setup,
        rejected=[
            pb.TransportRejection(
                transport=r.transport, reason=r.message, code=r.code.value, hint=r.hint
            )
            for r in o.rejected
        ],
        num_batches=o.num_batches,
        batch_size=o.batch_size,
        num_samples=o.num_samples,
        plan_cached=o.plan_cached,
        max_credits=o.max_credits,
        bad_sample_budget=o.bad_sample_budget,
        dataset_digest=o.dataset_digest,
    )


def event_from_message(msg: pb.ClientMessage) -> ClientEvent:
    """One client message as a daemon event; raises ``SpecError`` for an empty message."""
    kind = msg.WhichOneof("kind")
    if kind == "start":
        s = msg.start
        return StartEpoch(s.stream_id, s.epoch, s.next_batch, s.credits, s.notices)
    if kind == "release":
        r = msg.release
        return ReleaseSlot(r.slot, r.batch_index, r.wait_us)
    if kind == "credit":
        return CreditEvent(msg.credit.count)
    if kind == "ack":
        return CreditEvent(1)
    raise SpecError("empty ClientMessage: set one of start, release, credit, ack")


def batch_message(item: BatchOut | EpochEnd) -> pb.ServerMessage:
    """A published batch or the end of an epoch as a server message."""
    if isinstance(item, EpochEnd):
        return pb.ServerMessage(end=pb.EndOfEpoch(epoch=item.epoch, batches=item.batches))
    return pb.ServerMessage(
        batch=pb.BatchReady(
            epoch=item.epoch,
            batch_index=item.batch_index,
            slot=item.slot,
            length=item.length,
            tensors=[
                pb.TensorDesc(
                    name=t.name,
                    shape=list(t.shape),
                    dtype=_DTYPE_CODES[t.dtype],
                    offset=t.offset,
                    nbytes=t.nbytes,
                )
                for t in item.tensors
            ],
            sample_ids=item.sample_ids.astype("<u8", copy=False).tobytes(),
            data=list(item.published.data),
        )
    )


def dataset_info(ds: Dataset, decoders: dict[str, list[str]] | None = None) -> pb.DatasetInfo:
    """Describe one dataset."""
    decoders = decoders or {}
    return pb.DatasetInfo(
        name=ds.name,
        num_samples=ds.num_samples,
        fields=[pb.FieldInfo(name=n, type=t, decoders=decoders.get(t, [])) for n, t in ds.fields],
        schema_key=ds.schema_key,
        shards=[p.rsplit("/", 1)[-1] for p in ds.paths],
    )


def stats_message(s: DaemonStats) -> pb.StatsResponse:
    """The Stats reply."""
    bad, refused = dict(s.bad_samples), dict(s.refused)
    return pb.StatsResponse(
        pid=s.pid,
        uptime_s=s.uptime_s,
        workers=s.workers,
        streams=[
            pb.StreamStats(
                stream_id=x.stream_id,
                dataset=x.dataset,
                client_name=x.client_name,
                client_pid=x.client_pid,
                transport=x.transport,
                batches_sent=x.batches_sent,
                samples_sent=x.samples_sent,
                slots_leased=x.slots_leased,
                slot_count=x.slot_count,
                client_wait_us=x.client_wait_us,
                age_s=x.age_s,
            )
            for x in s.streams
        ],
        datasets=[
            pb.DatasetStats(
                name=n,
                samples_decoded=sd,
                batches_decoded=bd,
                bad_samples=bad.get(n, 0),
                refused=refused.get(n, ""),
            )
            for n, sd, bd in s.datasets
        ],
        shm_bytes=s.shm_bytes,
        compiled_plans=s.compiled_plans,
        streams_opened=s.streams_opened,
        queue_depth=s.queue_depth,
        worker_utilisation=s.worker_utilisation,
        workers_replaced=s.workers_replaced,
        max_ring_bytes=s.max_ring_bytes,
        ring_bytes=s.ring_bytes,
        buffer_bytes=s.buffer_bytes,
        idle_buffer_bytes=s.idle_buffer_bytes,
        max_idle_buffer_bytes=s.max_idle_buffer_bytes,
        idle_buffers_freed=s.idle_buffers_freed,
        decode_groups=[
            pb.DecodeGroupStats(
                dataset=g.dataset,
                field=g.field,
                order=g.order,
                decode=g.decode,
                members=g.members,
                detached=g.detached,
                delivered=g.delivered,
                decoded=g.decoded,
                hits=g.hits,
                evicted=g.evicted,
                live_bytes=g.live_bytes,
                waits=g.waits,
            )
            for g in s.decode_groups
        ],
    )
