"""The daemon: datasets, one shared engine, a compiled-plan cache, streams and their leases.

Everything here runs on the event-loop thread of the control plane, except compilation and
dataset opening (on a helper thread, ``beton-compile``) and the engine's workers. Protobuf is
never touched here: ``beton_serve.rpc`` converts messages to the dataclasses of this package.

Liveness: a monitor task checks, every :attr:`Daemon.liveness_interval` seconds, that the
process of every local client is alive (``kill(pid, 0)``), and cancels the serving task of a
stream whose client is gone. With the stream closing on disconnect, a killed client loses its
leases within a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from beton_wire.limits import (
    MAX_BATCH_SIZE,
    MAX_BATCHES_AHEAD,
    MAX_INDICES,
    MAX_WORLD_SIZE,
    short_repr,
)
from beton_wire.slots import slot_layout

from beton_serve.daemon._backend import (
    Backend,
    EngineBackend,
    EngineLike,
    OutputInfo,
    PlanLike,
    SourceParams,
)
from beton_serve.daemon._datasets import Dataset, DatasetTable
from beton_serve.daemon._messages import (
    DaemonStats,
    OpRequest,
    PipelineRequest,
    StreamOpened,
    StreamRequest,
    StreamStats,
)
from beton_serve.daemon._on_demand import (
    CLIENT_OP,
    IMPORT_OP,
    FilePolicy,
    OpImportPolicy,
    resolve_field_classes,
    resolve_ops,
)
from beton_serve.daemon._pump import NoticePump
from beton_serve.daemon._stream import (
    BatchOut,
    ClientEvent,
    ClientHungUp,
    CreditEvent,
    EpochEnd,
    ReleaseSlot,
    StartEpoch,
    Stream,
)
from beton_serve.daemon._transports import default_factories, with_cuda_facts
from beton_serve.errors import ShuttingDown, SpecError, TransportError
from beton_serve.transport.base import SlotTransport, TransportFactory
from beton_serve.transport.negotiate import (
    ClientOffer,
    DaemonFacts,
    HostIdentity,
    Negotiation,
    negotiate,
)
from beton_serve.transport.shm import ShmFactory, ShmNamer, pid_alive, sweep_stale_segments

__all__ = [
    "MAX_BATCH_SIZE",
    "Daemon",
    "DaemonStats",
    "OpRequest",
    "PipelineRequest",
    "StreamOpened",
    "StreamRequest",
    "ShuttingDown",
    "StreamStats",
    "local_identity",
]

log = logging.getLogger("beton_serve.daemon")

# Request limits (MAX_BATCH_SIZE, MAX_BATCHES_AHEAD, MAX_WORLD_SIZE, MAX_INDICES) are
# beton_wire.limits', the numbers the client checks too; _validate applies them.
#: Largest slot, in bytes (one batch of every output).
MAX_SLOT_BYTES = 4 << 30
#: Seconds a stream may stay open without a Batches call before it is reclaimed.
UNATTACHED_TIMEOUT_S = 30.0


#: Rings of small slots may grow to this many bytes (deeper prefetch hides per-batch latency).
SMALL_RING_BYTES = 32 << 20
#: ... but to at most this many slots.
MAX_RING_SLOTS = 16
#: Group buffers of a shm stream's sharing arena beyond its ring size (zero-copy sharing).
ARENA_EXTRA = 2


def ring_size(batches_ahead: int, slot_bytes: int) -> int:
    """Slots of a stream's ring: the batch the client holds plus ``batches_ahead`` in flight, and,
    when slots are small (CIFAR-sized batches), more, up to :data:`SMALL_RING_BYTES` in all.

    Measured here (2 cores): with 38 MB ImageNet slots, 5 slots in flight cost ~15 % throughput
    against 4 (more live buffers); with 1.5 MB CIFAR slots the per-batch round trip dominates and
    a deeper ring hides it.
    """
    base = batches_ahead + 1
    return max(base, min(MAX_RING_SLOTS, SMALL_RING_BYTES // max(1, slot_bytes)))


def local_identity() -> HostIdentity:
    """This process's host identity (boot id, hostname, uid, pid, IPC namespace)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = ""
    try:
        ipc_ns: int | None = os.stat("/proc/self/ns/ipc").st_ino
    except OSError:
        ipc_ns = None
    return HostIdentity(
        boot_id=boot_id,
        hostname=socket.gethostname(),
        uid=os.getuid(),
        pid=os.getpid(),
        ipc_ns=ipc_ns,
    )


@dataclass(kw_only=True)
class _PlanEntry:
    plan: PlanLike
    outputs: tuple[OutputInfo, ...]


def _sharing_registry(max_lag: int, retain: int) -> Any:
    from beton_serve.engine.sharing import SharingRegistry

    return SharingRegistry(max_lag=max_lag, retain=retain)


def _shared(
    source: Any,
    registry: Any,
    spec_key: str,
    req: StreamRequest,
    dataset: str,
    make_arena: Any = None,
) -> Any:
    """Wrap a stream's source so that identical streams decode each batch once (issue 6);
    ``make_arena`` (shm streams) makes the sharing zero-copy."""
    from beton_serve.engine.shared_source import SharedSource
    from beton_serve.engine.sharing import ShareKey

    key = ShareKey.build(
        dataset=dataset,
        pipeline=spec_key,
        seed=req.seed,
        order=req.order,
        batch_size=req.batch_size,
        drop_last=req.drop_last,
        distributed=req.distributed,
        rank=req.rank,
        world_size=req.world_size,
        indices=req.indices,
    )
    return SharedSource(source, registry, key, make_arena=make_arena)


@dataclass(kw_only=True)
class Daemon:
    """The serving core (see the module docstring).

    Build it with :meth:`create` (which opens and validates the datasets), start the liveness
    monitor with :meth:`start` on the event loop, and always :meth:`close` it.

    Attributes:
        datasets: the served datasets.
        backend: the decoding layers.
        engine: the one shared engine.
        workers: its worker count.
        facts: what transport negotiation knows about this daemon.
        factories: transport factories by kind (``shm`` built in; issue 5 adds the others).
    """

    datasets: DatasetTable
    backend: Backend
    engine: EngineLike | None
    workers: int
    facts: DaemonFacts
    factories: dict[str, TransportFactory]
    liveness_interval: float = 0.25
    started: float = field(default_factory=time.monotonic)
    streams: dict[str, Stream] = field(default_factory=dict)
    streams_opened: int = 0
    draining: bool = False
    _plans: dict[str, asyncio.Future[_PlanEntry]] = field(default_factory=dict)
    #: plan key -> the key of the dataset it was compiled over (to drop it with the dataset).
    _plan_owner: dict[str, str] = field(default_factory=dict)
    _compile_pool: ThreadPoolExecutor | None = None
    _monitor: asyncio.Task[None] | None = None
    #: Identical streams share decoding (``beton_serve.engine.sharing``); ``None`` turns it off.
    sharing: Any = None
    #: Failing samples each stream may skip (``--bad-sample-budget``; 0: fail the stream).
    bad_sample_budget: int = 0
    #: Called on SIGHUP by ``beton-serve serve`` (``cli._reload.ConfigReloader``), if set.
    reloader: Any = None
    _util_prev: tuple[float, float] = (0.0, 0.0)  # (monotonic time, engine busy seconds)
    _util_last: float = 0.0
    #: CUDA facts not gathered yet: done by the first stream that wants CUDA (``_transports``).
    cuda_pending: bool = False
    #: The shm notice channel (``beton_serve.transport.notice``), listening once :meth:`start`
    #: ran; ``None`` before, or where it cannot listen (shm clients then use the Batches call).
    notices: Any = None
    #: Zero-copy sharing arenas (``transport.arena``) not yet unlinked.
    _arenas: list[Any] = field(default_factory=list)
    #: Which files clients may make the daemon open (``_on_demand``).
    files: FilePolicy = field(default_factory=FilePolicy)
    #: ``--verify-checksums``: files opened on demand need a current sidecar too.
    verify_checksums: bool = False
    #: Which peers may make the daemon import a user op's module (``_on_demand``).
    op_imports: OpImportPolicy = field(default_factory=OpImportPolicy)
    #: Opens in progress, by real path (concurrent opens of one file share one).
    _opening: dict[str, asyncio.Future[Dataset]] = field(default_factory=dict)

    @classmethod
    def create(
        cls,
        datasets: Mapping[str, Sequence[str]],
        *,
        num_workers: int | None = None,
        backend: Backend | None = None,
        facts: DaemonFacts | None = None,
        factories: Mapping[str, TransportFactory] | None = None,
        sweep: bool = True,
        share: bool = True,
        share_max_lag: int = 8,
        share_retain: int = 4,
        bad_sample_budget: int = 0,
        verify_checksums: bool = False,
        open_on_demand: bool = True,
        data_roots: Sequence[str] = (),
        idle_close_s: float = 300.0,
        allow_op_imports: bool = False,
    ) -> Daemon:
        """Sweep stale segments, open every dataset and start the engine.

        ``verify_checksums``: every dataset file must have a current CRC32C sidecar
        (``beton-serve checksum FILE``); each sample is checked against it before decoding.
        ``open_on_demand``, ``data_roots``, ``idle_close_s``: which files a client may name that
        were not given here, and when they are closed again (``_on_demand``).
        ``allow_op_imports``: any peer, not only the daemon's user, may make it import a user
        op's module from its own disk (``_on_demand.OpImportPolicy``; docs/custom-ops.md).

        Raises:
            FormatError: a file is invalid (the reader's error), or ``verify_checksums`` and a
                sidecar is missing, stale or damaged.
            ConfigError: bad dataset arguments or shards with different schemas.
        """
        if sweep:
            sweep_stale_segments()
        backend = backend or EngineBackend()
        table = DatasetTable(datasets, backend)
        try:
            if verify_checksums:
                for ds in list(table):  # type: ignore[call-overload]
                    ds.checksums = backend.open_checksums(ds.readers)
                    log.info(
                        "checksums dataset=%s sidecars=%d verified=before-decode",
                        ds.name,
                        len(ds.readers),
                    )
            workers = num_workers or os.cpu_count() or 1
            engine = backend.make_engine(workers)
        except BaseException:
            table.close()
            raise
        cuda_pending = facts is None  # gathered when a client first asks for CUDA (issue 5)
        facts = facts or DaemonFacts(identity=local_identity())
        fac: dict[str, TransportFactory] = {**default_factories(), **(factories or {})}
        fac.setdefault("shm", ShmFactory(ShmNamer()))
        return cls(
            datasets=table,
            backend=backend,
            engine=engine,
            workers=workers,
            facts=facts,
            factories=fac,
            _compile_pool=ThreadPoolExecutor(1, thread_name_prefix="beton-compile"),
            sharing=_sharing_registry(share_max_lag, share_retain) if share else None,
            bad_sample_budget=max(0, int(bad_sample_budget)),
            cuda_pending=cuda_pending,
            files=FilePolicy.build(
                enabled=open_on_demand, data_roots=data_roots, idle_close_s=idle_close_s
            ),
            verify_checksums=verify_checksums,
            op_imports=OpImportPolicy(allow_any_peer=allow_op_imports),
        )

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the liveness monitor (call on the event-loop thread)."""
        loop = asyncio.get_running_loop()
        if self._monitor is None:
            self._monitor = loop.create_task(self._watch_clients())
        shm = self.factories.get("shm")
        if self.notices is None and isinstance(shm, ShmFactory):
            from beton_serve.transport.notice import NoticeHub

            try:
                self.notices = NoticeHub(shm.namer, loop)
            except OSError as exc:
                log.warning("no shm notice channel (%s); shm batches go over gRPC", exc)

    async def _watch_clients(self) -> None:
        while True:
            await asyncio.sleep(self.liveness_interval)
            now = time.monotonic()
            for s in list(self.streams.values()):
                if s.client_pid and not pid_alive(s.client_pid):
                    # A client process that exits without closing its Loader is a normal end
                    # of a stream (INFO), not a fault: real failures are logged where they occur.
                    log.info(
                        "stream %s: client pid %d exited; reclaiming its %d slot(s)",
                        s.stream_id,
                        s.client_pid,
                        s.ring.leased(),
                    )
                    self._end_stream(s)
                elif s.task is None and s.closed_before_start():
                    # Its Batches call may never reach the daemon (a call cancelled early is
                    # dropped by gRPC), but the notice channel's end-of-file always does.
                    log.info("stream %s: closed by the client before it started", s.stream_id)
                    self._end_stream(s)
                elif s.task is None and now - s.created > UNATTACHED_TIMEOUT_S:
                    log.info("stream %s: never started; closing it", s.stream_id)
                    self._end_stream(s)
            self.close_idle(now)

    def _end_stream(self, s: Stream) -> None:
        if s.task is not None and not s.task.done():
            s.task.cancel()
        self.streams.pop(s.stream_id, None)
        s.close()

    async def drain(self, timeout: float = 3.0) -> None:
        """Refuse new streams, end every open one with ``ShuttingDown`` and free its slots.

        Streams being served get the error as their final status (``UNAVAILABLE``); tasks that
        have not ended after ``timeout`` seconds are cancelled.
        """
        self.draining = True
        tasks = []
        for s in list(self.streams.values()):
            if s.task is not None and not s.task.done():
                tasks.append(s.task)
                s.abort(
                    ShuttingDown("the daemon is shutting down (SIGTERM); reconnect to a new one")
                )
            else:
                self._end_stream(s)
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=timeout)
            for t in late:
                t.cancel()
        for s in list(self.streams.values()):
            self._end_stream(s)

    def close(self) -> None:
        """Free every stream, stop the engine and close the datasets (idempotent)."""
        if self._monitor is not None:
            self._monitor.cancel()
            self._monitor = None
        for s in list(self.streams.values()):
            self._end_stream(s)
        if self.notices is not None:
            self.notices.close()
            self.notices = None
        for arena in self._arenas:  # every stream is gone: nothing may still read them
            arena.force_close()
        self._arenas = []
        try:
            if self.engine is not None:
                self.backend.close_engine(self.engine)
                self.engine = None
        finally:
            if self._compile_pool is not None:
                self._compile_pool.shutdown(wait=True, cancel_futures=True)
                self._compile_pool = None
            self.datasets.close()

    # -- datasets --------------------------------------------------------------------------
    def dataset(self, name: str) -> Dataset:
        """The dataset called ``name`` (``SpecError`` otherwise)."""
        return self.datasets.get(name)

    def all_datasets(self) -> list[Dataset]:
        """Every dataset, in start-up order."""
        return list(self.datasets)  # type: ignore[call-overload]

    # -- opening streams -------------------------------------------------------------------
    def _validate(self, req: StreamRequest, ds: Dataset) -> None:
        """Refuse a request that cannot be served, before anything is compiled or allocated.

        The limits are ``beton_wire.limits`` (the client checks the same ones); every echoed
        client-supplied text goes through ``short_repr``.

        Raises:
            SpecError: the message names the argument and the accepted range.
        """
        if not 1 <= req.batch_size <= MAX_BATCH_SIZE:
            raise SpecError(f"batch_size {req.batch_size} is out of range: use 1..{MAX_BATCH_SIZE}")
        if not 1 <= req.batches_ahead <= MAX_BATCHES_AHEAD:
            raise SpecError(
                f"batches_ahead {req.batches_ahead} is out of range: use 1..{MAX_BATCHES_AHEAD}"
            )
        if not 0 <= req.seed < 2**64:
            raise SpecError(f"seed {req.seed} is out of range: use 0..2**64-1")
        if req.order not in ("SEQUENTIAL", "RANDOM", "QUASI_RANDOM"):
            raise SpecError(
                f"unknown order {short_repr(req.order)}: use SEQUENTIAL, RANDOM or QUASI_RANDOM"
            )
        if req.distributed:
            # The distributed order pads to world_size * ceil(n / world_size) ids: bounded here.
            if not 1 <= req.world_size <= MAX_WORLD_SIZE:
                raise SpecError(
                    f"world_size {req.world_size} is out of range: use 1..{MAX_WORLD_SIZE}"
                )
            if not 0 <= req.rank < req.world_size:
                raise SpecError(
                    f"rank {req.rank} / world_size {req.world_size}: need 0 <= rank < world_size"
                )
        offer = req.offer
        if offer.wants_cuda and offer.device_index not in {d.index for d in offer.cuda_devices}:
            seen = [f"cuda:{d.index}" for d in offer.cuda_devices] or "none"
            raise SpecError(
                f"device {short_repr(offer.device)} is not a CUDA device of the client (it "
                f"reports {seen}); pick one of those, or ToDevice('cpu')"
            )
        names = {n for n, _ in ds.fields}
        seen_names = set()
        for p in req.pipelines:
            fld = p.field or p.name
            if fld not in names:
                raise SpecError(
                    f"dataset {ds.name!r} has no field {short_repr(fld)}; its fields are "
                    f"{sorted(names)}"
                )
            if p.name in seen_names:
                raise SpecError(f"pipeline {short_repr(p.name)} is given twice")
            seen_names.add(p.name)
        if req.indices is not None:
            n = len(req.indices)
            if n == 0:
                raise SpecError("indices=[] selects no samples; pass indices=None for every sample")
            if n > MAX_INDICES:
                raise SpecError(f"{n} indices are too many: at most {MAX_INDICES} are accepted")
            ids = np.asarray(req.indices)
            if ids.dtype.kind not in "iu":
                raise SpecError(f"indices must be integers, not {ids.dtype}")
            outside = (
                (ids < 0) | (ids >= ds.num_samples)
                if ids.dtype.kind == "i"
                else (ids >= ds.num_samples)
            )
            if outside.any():
                bad = ids[outside][:5].tolist()
                raise SpecError(f"indices {bad} are outside the dataset's {ds.num_samples} samples")

    def _import_refusal(self, req: StreamRequest) -> str | None:
        """Why this request's peer may not make the daemon import op modules (or ``None``)."""
        return self.op_imports.refusal(owner_peer=req.owner_peer, peer_uid=req.offer.identity.uid)

    def _spec_key(self, req: StreamRequest, ds: Dataset) -> str:
        spec = [
            [p.name, p.field or p.name, p.skip, [[o.name, dict(o.params)] for o in p.ops]]
            for p in req.pipelines
        ]
        # Whether the peer may make the daemon import op modules decides which ops the plan holds.
        imports = any(o.name == IMPORT_OP for p in req.pipelines for o in p.ops)
        allowed = imports and self._import_refusal(req) is None
        # The plan holds the dataset's reader: keyed by the dataset's identity, not only its schema
        # (train and val files share a schema; issue 11).
        text = json.dumps([ds.key, ds.schema_key, req.batch_size, spec, allowed], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    def _compile_sync(self, req: StreamRequest, ds: Dataset) -> _PlanEntry:
        pipelines: dict[str, Any] = {}  # ops, a PipelineSpec (another output), or None
        local: dict[str, tuple[str, dict[str, Any]] | None] = {}
        refusal = self._import_refusal(req)
        for p in req.pipelines:
            if p.skip:
                pipelines[p.name] = None
                continue
            # User ops: plugin, else imported here, else run by the client (_on_demand).
            ops, local[p.name] = resolve_ops(
                p.ops, build=self.backend.build_op, import_refusal=refusal
            )
            # Another output of a field (FFCV's PipelineSpec(source=field)) keeps its name.
            renamed = bool(p.field) and p.field != p.name
            pipelines[p.name] = self.backend.field_output(p.field, ops) if renamed else ops
            handed = local[p.name]
            if handed is not None:
                log.info(
                    "dataset=%s pipeline=%s: ops from #%d run in the client (%s)",
                    ds.name,
                    short_repr(p.name),
                    handed[1]["from"],
                    "; ".join(handed[1]["why"]),
                )
        check = {} if ds.checksums is None else {"sample_check": ds.checksums.check}
        plan = self.backend.compile(ds.reader, pipelines, req.batch_size, **check)
        tail = self.backend.client_tail(plan)
        outputs = []
        for o in self.backend.outputs(plan):
            ops = [t for t in tail.get(o.name, ()) if t[0] != CLIENT_OP]
            marker = local.get(o.name)
            outputs.append(
                dataclasses.replace(o, client_ops=tuple([marker, *ops] if marker else ops))
            )
        return _PlanEntry(plan=plan, outputs=tuple(outputs))

    async def _plan(self, req: StreamRequest, ds: Dataset) -> tuple[_PlanEntry, bool]:
        key = self._spec_key(req, ds)
        fut = self._plans.get(key)
        if fut is not None:
            if not fut.done() or fut.exception() is None:
                return await asyncio.shield(fut), True
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._compile_pool, self._compile_sync, req, ds)
        self._plans[key] = fut
        self._plan_owner[key] = ds.key
        try:
            return await asyncio.shield(fut), False
        except BaseException:
            if self._plans.get(key) is fut:
                del self._plans[key]
            raise

    async def _dataset_for(self, req: StreamRequest, same_host: bool) -> Dataset:
        """The dataset ``req`` names: served, or the file it names opened on demand when the
        peer may (``_on_demand``); never another file than the one named."""
        if req.custom_fields:
            return await self._custom_dataset_for(req, same_host)
        f = req.file
        if f is None:
            return self.datasets.resolve(req.dataset, None, same_host=same_host)
        found = self.datasets.find_file(f, same_host=same_host)
        if found is not None:
            return found
        why = self.files.refusal(f, owner_peer=req.owner_peer)
        if why is not None:
            return self.datasets.resolve(req.dataset, f, same_host=same_host, why_not_open=why)
        real = os.path.realpath(f.path)
        fut = self._opening.get(real)
        if fut is None:
            loop = asyncio.get_running_loop()
            fut = loop.run_in_executor(self._compile_pool, self._open_file_sync, real)
            self._opening[real] = fut
            try:
                opened = await asyncio.shield(fut)
            finally:
                if self._opening.get(real) is fut:
                    del self._opening[real]
            ds = self.datasets.find_file(opened.files[0], same_host=True)
            if ds is None:
                ds = self.datasets.adopt(opened)
                log.info(
                    "dataset %s opened on demand: %s (%d samples)",
                    ds.name,
                    real,
                    ds.num_samples,
                )
            elif ds is not opened:  # two opens of one file raced: keep the first
                self.datasets.remove(opened)
        else:
            opened = await asyncio.shield(fut)
            ds = self.datasets.find_file(opened.files[0], same_host=True) or opened
        if not any(i.same_file(f, same_host=same_host) for i in ds.files):
            raise SpecError(
                f"this Loader names {f.describe()}, but the file at that path is now "
                f"{ds.files[0].describe()} (it was replaced); open it again"
            )
        return ds

    async def _custom_dataset_for(self, req: StreamRequest, same_host: bool) -> Dataset:
        """The dataset ``req`` names, read with its ``custom_fields`` classes: a variant of the
        file(s) opened with those classes (on demand, closed when idle like any on-demand file),
        shared by every stream asking for the same files and classes.

        The files are the served dataset's (by name or by identity), or the file the client
        named when the peer may open it (``_on_demand.FilePolicy``). The classes come from the
        daemon's plugins or are imported from its own disk (``resolve_field_classes``)."""
        classes = resolve_field_classes(
            req.custom_fields,
            import_refusal=self._import_refusal(req),
            is_field=self.backend.is_field_class,
        )
        custom = tuple(sorted(f"{k}={c.__module__}:{c.__qualname__}" for k, c in classes.items()))
        f = req.file
        if f is None:
            paths = list(self.datasets.get(req.dataset).paths)
        else:
            served = self.datasets.find_file(f, same_host=same_host)
            if served is not None:
                paths = list(served.paths)
            else:
                why = self.files.refusal(f, owner_peer=req.owner_peer)
                if why is not None:
                    raise SpecError(
                        f"this daemon does not serve {f.describe()} and does not open it for this "
                        f"client ({why})"
                    )
                paths = [os.path.realpath(f.path)]
        found = self.datasets.find_variant(paths, custom)
        if found is None:
            key = json.dumps([[os.path.realpath(p) for p in paths], list(custom)])
            fut = self._opening.get(key)
            if fut is None:
                loop = asyncio.get_running_loop()
                fut = loop.run_in_executor(self._compile_pool, self._open_file_sync, paths, classes)
                self._opening[key] = fut
                try:
                    opened = await asyncio.shield(fut)
                finally:
                    if self._opening.get(key) is fut:
                        del self._opening[key]
                found = self.datasets.find_variant(paths, custom)
                if found is None:
                    found = self.datasets.adopt(opened)
                    log.info(
                        "dataset %s opened with custom fields %s: %s",
                        found.name,
                        ",".join(custom),
                        ",".join(paths),
                    )
                elif found is not opened:
                    self.datasets.remove(opened)
            else:
                opened = await asyncio.shield(fut)
                found = self.datasets.find_variant(paths, custom) or opened
        if f is not None and not any(i.same_file(f, same_host=same_host) for i in found.files):
            raise SpecError(
                f"this Loader names {f.describe()}, but the file at that path is now "
                f"{found.files[0].describe()} (it was replaced); open it again"
            )
        return found

    def _open_file_sync(
        self, path: str | Sequence[str], custom_fields: Mapping[str, type] | None = None
    ) -> Dataset:
        ds = self.datasets.open_file(path, custom_fields)
        try:
            if self.verify_checksums:
                ds.checksums = self.backend.open_checksums(ds.readers)
        except BaseException:
            self.datasets.remove(ds)
            raise
        return ds

    def close_idle(self, now: float) -> None:
        """Close datasets opened on demand that had no stream for ``files.idle_close_s``."""
        busy = {id(s.dataset) for s in self.streams.values()}
        for ds in self.all_datasets():
            if not ds.on_demand:
                continue
            if id(ds) in busy:
                ds.idle_since = None
                continue
            if ds.idle_since is None:
                ds.idle_since = now
            elif now - ds.idle_since >= self.files.idle_close_s:
                self._drop_plans(ds)
                self.datasets.remove(ds)
                log.info("dataset %s closed after %.0f s unused", ds.name, now - ds.idle_since)

    def _drop_plans(self, ds: Dataset) -> None:
        """Forget the compiled plans over ``ds``'s reader (they would keep it mapped)."""
        for key in [k for k, owner in self._plan_owner.items() if owner == ds.key]:
            self._plans.pop(key, None)
            del self._plan_owner[key]

    def _arena_maker(self, layout: Any, count: int) -> Any:
        """``make() -> ShmArena`` of ``count`` buffers of ``layout`` for zero-copy sharing; the
        daemon keeps every arena so that :meth:`close` unlinks those still held."""
        from beton_serve.transport.arena import ShmArena

        namer = self.factories["shm"].namer  # type: ignore[attr-defined]

        def make() -> ShmArena:
            arena = ShmArena(layout, count, namer.next("share"))
            self._arenas = [a for a in self._arenas if not a.unlinked]
            self._arenas.append(arena)
            return arena

        return make

    def _negotiate(self, offer: ClientOffer) -> tuple[Negotiation, TransportFactory]:
        if self.cuda_pending and offer.wants_cuda:
            self.cuda_pending = False
            self.facts = with_cuda_facts(self.facts)
        neg = negotiate(offer, self.facts)
        factory = self.factories.get(neg.transport)
        if factory is None:
            reasons = "; ".join(str(r) for r in neg.rejected) or "it was requested"
            raise TransportError(
                f"the {neg.transport} transport was chosen ({reasons}) but this daemon does not "
                f"offer it (it offers {sorted(self.factories)}); run the trainer on the daemon's "
                "host, as the daemon's user"
            )
        return neg, factory

    async def open_stream(self, req: StreamRequest) -> StreamOpened:
        """Validate ``req``, compile (or reuse) its plan, negotiate a transport, create its ring.

        Raises:
            SpecError: the request is invalid (unknown dataset, field or op, bad parameters,
                absurd sizes); the message says what to change.
            TransportError: the forced transport cannot work, or no transport can.
            PipelineError: the pipeline failed to compile.
        """
        if self.draining:
            raise ShuttingDown("the daemon is shutting down; retry against a new daemon")
        ident = req.offer.identity
        same_host = bool(ident.boot_id) and ident.boot_id == self.facts.identity.boot_id
        ds = await self._dataset_for(req, same_host)
        self._validate(req, ds)
        neg, factory = self._negotiate(req.offer)
        entry, cached = await self._plan(req, ds)
        layout = slot_layout([(o.name, o.shape, o.dtype) for o in entry.outputs], req.batch_size)
        if layout.slot_bytes > MAX_SLOT_BYTES:
            raise SpecError(
                f"one batch needs {layout.slot_bytes} bytes, more than the {MAX_SLOT_BYTES} a slot "
                "may hold; use a smaller batch_size or output size"
            )
        params = SourceParams(
            order=req.order,
            batch_size=req.batch_size,
            seed=req.seed,
            indices=None if req.indices is None else np.asarray(req.indices, dtype=np.uint64),
            drop_last=req.drop_last,
            distributed=req.distributed,
            rank=req.rank,
            world_size=req.world_size,
            batches_ahead=ring_size(req.batches_ahead, layout.slot_bytes),
            # A batch split over the workers arrives sooner; with many streams the pool is busy
            # anyway and the split costs little (BatchSource splits only sliceable plans).
            slices=self.workers,
            bad_sample_budget=self.bad_sample_budget,
            pre_run=ds.check_files,  # workers re-check the files right before reading
        )
        source = self.backend.make_source(self.engine, entry.plan, params)
        slot_count = ring_size(req.batches_ahead, layout.slot_bytes)
        if self.sharing is not None:
            make_arena = (
                self._arena_maker(layout, slot_count + ARENA_EXTRA)
                if neg.transport == "shm" and isinstance(factory, ShmFactory)
                else None
            )
            source = _shared(source, self.sharing, self._spec_key(req, ds), req, ds.key, make_arena)
        ring: SlotTransport = factory.create(layout, slot_count, device_index=neg.device_index)
        stream = Stream(
            stream_id=secrets.token_hex(8),
            dataset=ds,
            source=source,
            ring=ring,
            layout=layout,
            outputs=entry.outputs,
            client_pid=ident.pid if same_host else 0,
            client_name=req.client_name,
        )
        setup = ring.setup()
        if setup.kind == "shm" and self.notices is not None:
            stream.notice_token, stream.notice_future = self.notices.register()
            stream.notice_unregister = self.notices.unregister
            setup = dataclasses.replace(
                setup, notice_socket=self.notices.name, notice_token=stream.notice_token
            )
        self.streams[stream.stream_id] = stream
        self.streams_opened += 1
        n = len(req.indices) if req.indices is not None else ds.num_samples
        if req.distributed:
            n = math.ceil(n / req.world_size)
        log.info(
            "stream %s opened: dataset=%s client=%s pid=%d batch_size=%d batches=%d %s%s",
            stream.stream_id,
            ds.name,
            req.client_name or "-",
            ident.pid,
            req.batch_size,
            stream.num_batches,
            neg.summary(),
            " (cached plan)" if cached else "",
        )
        return StreamOpened(
            stream_id=stream.stream_id,
            outputs=entry.outputs,
            setup=setup,
            rejected=neg.rejected,
            num_batches=stream.num_batches,
            batch_size=req.batch_size,
            num_samples=n,
            plan_cached=cached,
            max_credits=slot_count,
        )

    # -- serving a stream ------------------------------------------------------------------
    async def run_stream(
        self, events: AsyncIterator[ClientEvent]
    ) -> AsyncIterator[BatchOut | EpochEnd]:
        """Serve one Batches call: the first event must be a :class:`StartEpoch`.

        Ends (and frees the stream) when the client stops sending, or raises ``SpecError`` for
        a protocol misuse, ``PipelineError`` for a failed batch.
        """
        first = await anext(aiter(events), None)
        if not isinstance(first, StartEpoch):
            raise SpecError("a Batches call must start with a Start message naming the stream")
        stream = self.streams.get(first.stream_id)
        if stream is None:
            raise SpecError(
                f"unknown stream {first.stream_id!r}: open it with OpenStream first (streams "
                "are closed when their Batches call ends)"
            )
        if stream.task is not None:
            raise SpecError(f"stream {first.stream_id!r} is already being served")
        stream.task = asyncio.current_task()
        starts = stream.starts
        starts.put_nowait(first)
        hung_up = asyncio.Event()

        async def pump() -> None:
            try:
                async for ev in events:
                    if isinstance(ev, ReleaseSlot):
                        stream.on_release(ev)
                    elif isinstance(ev, CreditEvent):
                        stream.on_credit(ev)
                    else:
                        starts.put_nowait(ev)
            finally:
                hung_up.set()
                starts.put_nowait(None)
                stream._wake.set()
                if stream.pump is not None:  # the client hung up mid-epoch
                    stream.pump.fail(ClientHungUp("the client closed its Batches call"))

        def notice_closed() -> None:
            hung_up.set()
            stream.abort(ClientHungUp("the client closed its notice channel"))

        reader = asyncio.get_running_loop().create_task(pump())
        try:
            while True:
                start = await starts.get()
                if stream.abort_exc is not None:
                    raise stream.abort_exc
                if start is None:
                    return
                if start.stream_id and start.stream_id != stream.stream_id:
                    raise SpecError("a Batches call serves one stream; open another call")
                if start.notices:  # published from the workers, off this loop (daemon._pump)
                    await stream.attach_notices(notice_closed)
                    await NoticePump(stream, start, asyncio.get_running_loop()).run()
                    continue
                # Closed here, not by the garbage collector: its frame holds slot views.
                async with contextlib.aclosing(stream.run_epoch(start)) as items:
                    async for item in items:
                        if hung_up.is_set():
                            return  # the client closed its side mid-epoch: nobody will read more
                        yield item
        except ClientHungUp:
            return
        finally:
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader
            self.streams.pop(stream.stream_id, None)
            stream.close()
            log.info(
                "stream %s closed after %d batches", stream.stream_id, stream.counters.batches_sent
            )

    # -- stats -----------------------------------------------------------------------------
    def stats(self) -> DaemonStats:
        """A consistent snapshot (call on the event-loop thread)."""
        import hashlib

        from beton_serve.daemon._messages import DecodeGroupRow
        from beton_serve.fields.decode_cache import default_decode_cache

        now = time.monotonic()
        streams = tuple(
            StreamStats(
                stream_id=s.stream_id,
                dataset=s.dataset.name,
                client_name=s.client_name,
                client_pid=s.client_pid,
                transport=s.ring.kind,
                batches_sent=s.counters.batches_sent,
                samples_sent=s.counters.samples_sent,
                slots_leased=s.ring.leased(),
                slot_count=s.ring.slot_count,
                client_wait_us=s.counters.client_wait_us,
                age_s=now - s.created,
            )
            for s in self.streams.values()
        )
        return DaemonStats(
            pid=os.getpid(),
            uptime_s=now - self.started,
            workers=self.workers,
            streams=streams,
            datasets=tuple(
                (d.name, d.samples_decoded, d.batches_decoded) for d in self.all_datasets()
            ),
            shm_bytes=sum(s.ring.nbytes() for s in self.streams.values()),
            compiled_plans=sum(1 for f in self._plans.values() if f.done() and not f.exception()),
            streams_opened=self.streams_opened,
            queue_depth=0 if self.engine is None else int(self.engine.queue_depth),
            worker_utilisation=self._utilisation(now),
            workers_replaced=0 if self.engine is None else int(self.engine.workers_replaced),
            bad_samples=tuple((d.name, d.bad_samples) for d in self.all_datasets()),
            op_seconds=self._op_seconds(),
            decode_groups=tuple(
                DecodeGroupRow(
                    dataset=g.label or g.dataset[:12],
                    field=g.field,
                    order=hashlib.sha256(g.order.encode()).hexdigest()[:12],
                    members=g.members,
                    detached=g.detached,
                    delivered=g.delivered,
                    decoded=g.decoded,
                    hits=g.hits,
                    evicted=g.evicted,
                    live_bytes=g.bytes,
                )
                for g in default_decode_cache().stats()
            ),
        )

    def _utilisation(self, now: float) -> float:
        """Busy share of the pool since the previous call (kept for 0.5 s between calls)."""
        busy = 0.0 if self.engine is None else float(self.engine.busy_s)
        t0, b0 = self._util_prev
        if now - t0 >= 0.5:
            if t0 > 0:
                self._util_last = min(1.0, max(0.0, (busy - b0) / ((now - t0) * self.workers)))
            self._util_prev = (now, busy)
        return self._util_last

    def _op_seconds(self) -> tuple[tuple[str, float, int], ...]:
        total: dict[str, list[float]] = {}
        for f in self._plans.values():
            if not f.done() or f.cancelled() or f.exception() is not None:
                continue
            for op, (sec, n) in f.result().plan.op_times().items():
                acc = total.setdefault(op, [0.0, 0])
                acc[0] += sec
                acc[1] += n
        return tuple((op, s, int(n)) for op, (s, n) in sorted(total.items()))
