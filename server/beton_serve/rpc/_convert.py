"""Protobuf messages <-> the daemon's dataclasses (the only module that reads message fields).

Everything received is validated here for *shape* (JSON that parses to an object, enum values in
range, sizes that fit); the daemon validates *meaning*. Nothing is ever unpickled or executed.
"""

from __future__ import annotations

import json
from typing import Any

from beton_wire.file_identity import FileIdentity
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

__all__ = [
    "batch_message",
    "dataset_info",
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
#: Largest JSON parameter text accepted for one op.
MAX_PARAMS_BYTES = 1 << 20
#: Most indices a request may carry.
MAX_INDICES = 1 << 31


def _params(op: pb.OpSpec, pipeline: str) -> dict[str, Any]:
    text = op.params_json or "{}"
    if len(text) > MAX_PARAMS_BYTES:
        raise SpecError(f"pipeline {pipeline!r}, op {op.name!r}: parameters exceed 1 MiB")
    try:
        params = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(
            f"pipeline {pipeline!r}, op {op.name!r}: parameters are not valid JSON ({exc})"
        ) from None
    if not isinstance(params, dict):
        raise SpecError(
            f"pipeline {pipeline!r}, op {op.name!r}: parameters must be a JSON object, "
            f"not {type(params).__name__}"
        )
    return params


def stream_request(msg: pb.OpenStreamRequest) -> StreamRequest:
    """Build the daemon's request; raises ``SpecError`` for malformed fields."""
    if msg.order not in _ORDERS:
        raise SpecError(f"unknown order value {msg.order}; use SEQUENTIAL, RANDOM or QUASI_RANDOM")
    pipelines = tuple(
        PipelineRequest(
            name=p.name,
            field=p.field,
            skip=p.skip,
            ops=tuple(OpRequest(name=o.name, params=_params(o, p.name)) for o in p.ops),
        )
        for p in msg.pipelines
    )
    h = msg.host
    caps = msg.capabilities
    offer = ClientOffer.from_dict(
        {
            "identity": {
                "boot_id": h.boot_id,
                "hostname": h.hostname,
                "uid": h.uid,
                "pid": h.pid,
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
        indices=tuple(msg.indices) if msg.has_indices else None,
        distributed=msg.distributed,
        rank=msg.rank if msg.distributed else 0,
        world_size=(msg.world_size or 1) if msg.distributed else 1,
        batches_ahead=msg.batches_ahead or 3,
        offer=offer,
        client_name=msg.client_name,
        custom_fields=tuple(msg.custom_fields),
        file=_file_identity(msg.file) if msg.HasField("file") else None,
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
    bad = dict(getattr(s, "bad_samples", ()))
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
                name=n, samples_decoded=sd, batches_decoded=bd, bad_samples=bad.get(n, 0)
            )
            for n, sd, bd in s.datasets
        ],
        shm_bytes=s.shm_bytes,
        compiled_plans=s.compiled_plans,
        streams_opened=s.streams_opened,
        queue_depth=getattr(s, "queue_depth", 0),
        worker_utilisation=getattr(s, "worker_utilisation", 0.0),
        workers_replaced=getattr(s, "workers_replaced", 0),
    )
