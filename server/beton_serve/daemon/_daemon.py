"""The daemon: datasets, one shared engine, a compiled-plan cache, streams and their leases.

:class:`Daemon` is a facade over parts that each own one concern:

* ``DatasetTable`` (``_datasets``) and ``DatasetOpener`` (``_opener``): the served datasets,
  files opened on demand and closed when idle;
* ``PlanRegistry`` (``_plans``): compiled plans by request, and the compile thread;
* ``StreamTable`` (``_streams``): the open streams, how each ends, the liveness monitor;
* ``StatsBook`` (``_stats``): the stats snapshot;
* ``validate_request`` and ``batch_layout`` (``_validate``): what is refused before any work;
* ``source_params``, ``shared`` and ``ArenaBook`` (``_sources``): a stream's source, its sharing
  group and the sharing arenas;
* the serving paths: the ``Batches`` call (``_call``, with ``Stream.run_epoch`` or the
  ``NoticePump`` of ``_pump``) and the grpc batch method (``_grpc_batches``), each publishing
  through its ``Publisher`` (``_publish``).

The daemon itself negotiates transports and runs :meth:`Daemon.open_stream` as a sequence of
those parts' steps. Everything here runs on the event-loop thread of the
control plane, except compilation and dataset opening (on the compile thread, ``beton-compile``)
and the engine's workers. Protobuf is never touched here: ``beton_serve.rpc`` converts messages
to the dataclasses of this package.

Liveness: a monitor task checks, every :attr:`Daemon.liveness_interval` seconds, that the
process of every local client is alive (``kill(pid, 0)``), and cancels the serving task of a
stream whose client is gone. With the stream closing on disconnect, a killed client loses its
leases within a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import secrets
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from beton_wire.limits import MAX_BATCH_SIZE, human_bytes, usable_cpus
from beton_wire.loader_state import batch_rows
from beton_wire.slots import SlotLayout

from beton_serve.daemon._backend import Backend, BatchSourceLike, EngineBackend, EngineLike
from beton_serve.daemon._call import serve_call
from beton_serve.daemon._datasets import Dataset, DatasetTable
from beton_serve.daemon._events import ClientEvent
from beton_serve.daemon._messages import (
    DaemonStats,
    OpRequest,
    PipelineRequest,
    StreamOpened,
    StreamRequest,
    StreamStats,
)
from beton_serve.daemon._on_demand import FilePolicy, OpImportPolicy
from beton_serve.daemon._opener import DatasetOpener
from beton_serve.daemon._plans import PlanEntry, PlanRegistry
from beton_serve.daemon._publish import BatchOut, EpochEnd
from beton_serve.daemon._sources import ArenaBook, shared, sharing_registry, source_params
from beton_serve.daemon._stats import StatsBook
from beton_serve.daemon._stream import Stream
from beton_serve.daemon._streams import (
    ARENA_EXTRA,
    UNATTACHED_TIMEOUT_S,
    StreamTable,
    ring_size,
)
from beton_serve.daemon._transports import default_factories, with_cuda_facts
from beton_serve.daemon._validate import batch_layout, validate_request
from beton_serve.errors import ResourceExhausted, ShuttingDown, TransportError
from beton_serve.transport.base import SlotTransport, TransportFactory, TransportSetup
from beton_serve.transport.grpc_ring import GrpcFactory
from beton_serve.transport.negotiate import (
    ClientOffer,
    DaemonFacts,
    HostIdentity,
    Negotiation,
    negotiate,
)
from beton_serve.transport.shm import SHM_DIR, ShmFactory, StaleSweeper, daemon_namer

if TYPE_CHECKING:
    from beton_serve.engine.shared_source import Produced
    from beton_serve.engine.sharing import SharingRegistry
    from beton_serve.transport.notice import NoticeHub

__all__ = [
    "MAX_BATCH_SIZE",
    "Daemon",
    "DaemonStats",
    "OpRequest",
    "PipelineRequest",
    "ShuttingDown",
    "StreamOpened",
    "StreamRequest",
    "StreamStats",
    "local_identity",
    "ring_budget",
]

log = logging.getLogger("beton_serve.daemon")
_T = TypeVar("_T")


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
        factories: transport factories by kind (``shm``, ``grpc``, ``cuda_ipc``).
        plans: compiled plans and the compile thread.
        opener: finds (and opens on demand) the dataset a request names.
        streams: the open streams.
    """

    datasets: DatasetTable
    backend: Backend
    engine: EngineLike | None
    workers: int
    facts: DaemonFacts
    factories: dict[str, TransportFactory]
    plans: PlanRegistry
    opener: DatasetOpener
    streams: StreamTable = field(default_factory=StreamTable)
    stats_book: StatsBook
    liveness_interval: float = 0.25
    draining: bool = False
    #: Why it drains, set by :meth:`drain` and named in every stream's ``ShuttingDown``
    #: (``SIGINT``, ``SIGTERM``, ``idle for 300 s``).
    drain_cause: str = ""
    #: Identical streams share decoding (``beton_serve.engine.sharing``); ``None`` turns it off.
    sharing: SharingRegistry[Produced] | None = None
    #: Failing samples each stream may skip (``--bad-sample-budget``; 0: fail the stream).
    bad_sample_budget: int = 0
    #: Bytes of ring buffers all open streams may hold together (``--max-ring-bytes``, resolved
    #: by :func:`ring_budget`); 0: no bound (a daemon built without ``create``).
    max_ring_bytes: int = 0
    #: Called on SIGHUP, on the event loop, by ``beton-serve serve``
    #: (``cli._reload.ConfigReloader.on_signal``), if set.
    reloader: Callable[[], object] | None = None
    #: CUDA facts not gathered yet: done by the first stream that wants CUDA (``_transports``).
    cuda_pending: bool = False
    #: The shm notice channel (``beton_serve.transport.notice``), listening once :meth:`start`
    #: ran; ``None`` before, or where it cannot listen (shm clients then use the Batches call).
    notices: NoticeHub | None = None
    #: Zero-copy sharing arenas (``transport.arena``) not yet unlinked.
    arenas: ArenaBook = field(default_factory=ArenaBook)
    #: Sweeps stale segments at creation, and again shortly after :meth:`start` while a killed
    #: daemon's group is still locked (``transport.shm.StaleSweeper``); ``None``: no sweep.
    sweeper: StaleSweeper | None = None
    _monitor: asyncio.Task[None] | None = None
    #: Resolved by :meth:`drain`: an ``open_stream`` waiting (for a compile, a file) ends at
    #: once (futures, not an Event: one bound to no event loop).
    _drain_waiters: set[asyncio.Future[None]] = field(default_factory=set)

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
        max_ring_bytes: int = 0,
        verify_checksums: bool = False,
        open_on_demand: bool = True,
        data_roots: Sequence[str] = (),
        idle_close_s: float = 300.0,
        allow_op_imports: bool = False,
        unattached_timeout_s: float = UNATTACHED_TIMEOUT_S,
    ) -> Daemon:
        """Sweep stale segments, open every dataset and start the engine.

        ``verify_checksums``: every dataset file must have a current CRC32C sidecar
        (``beton-serve checksum FILE``); each sample is checked against it before decoding.
        ``open_on_demand``, ``data_roots``, ``idle_close_s``: which files a client may name that
        were not given here, and when they are closed again (``_on_demand``).
        ``allow_op_imports``: any peer, not only the daemon's user, may make it import a user
        op's module from its own disk (``_on_demand.OpImportPolicy``; docs/custom-ops.md).
        ``max_ring_bytes``: the bound on every open stream's ring together (:func:`ring_budget`:
        0 means half of ``/dev/shm``); a stream that would exceed it is refused.
        ``unattached_timeout_s``: how long a stream no call took up is kept while no client
        holds its notice channel (``StreamTable.sweep``).

        Raises:
            FormatError: a file is invalid (the reader's error), or ``verify_checksums`` and a
                sidecar is missing, stale or damaged.
            ConfigError: bad dataset arguments or shards with different schemas.
        """
        sweeper = StaleSweeper() if sweep else None
        if sweeper is not None:
            sweeper.sweep()
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
            workers = num_workers or usable_cpus()
            engine = backend.make_engine(workers)
        except BaseException:
            table.close()
            raise
        cuda_pending = facts is None  # gathered when a client first asks for CUDA (issue 5)
        facts = facts or DaemonFacts(identity=local_identity())
        fac: dict[str, TransportFactory] = {**default_factories(), **(factories or {})}
        if "shm" not in fac:
            fac["shm"] = ShmFactory(daemon_namer())
        shm = fac["shm"]
        if sweeper is not None and isinstance(shm, ShmFactory):
            sweeper.keep = shm.namer.prefix
        plans = PlanRegistry(backend, OpImportPolicy(allow_any_peer=allow_op_imports))
        files = FilePolicy.build(
            enabled=open_on_demand, data_roots=data_roots, idle_close_s=idle_close_s
        )
        streams = StreamTable(unattached_timeout_s=unattached_timeout_s)
        return cls(
            datasets=table,
            backend=backend,
            engine=engine,
            workers=workers,
            facts=facts,
            factories=fac,
            plans=plans,
            opener=DatasetOpener(
                table,
                backend,
                files,
                plans,
                verify_checksums=verify_checksums,
                busy=lambda: {id(s.dataset) for s in streams},
            ),
            stats_book=StatsBook(workers=workers),
            sharing=sharing_registry(share_max_lag, share_retain) if share else None,
            bad_sample_budget=max(0, int(bad_sample_budget)),
            max_ring_bytes=ring_budget(max_ring_bytes),
            cuda_pending=cuda_pending,
            streams=streams,
            sweeper=sweeper,
        )

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the liveness monitor, the notice channel and the sweeps still due (call on
        the event-loop thread)."""
        loop = asyncio.get_running_loop()
        if self._monitor is None:
            self._monitor = loop.create_task(
                self.streams.watch(self.liveness_interval, self.close_idle)
            )
        if self.sweeper is not None:
            self.sweeper.start(loop)
        shm = self.factories.get("shm")
        if self.notices is None and isinstance(shm, ShmFactory):
            from beton_serve.transport.notice import NoticeHub

            try:
                self.notices = NoticeHub(shm.namer, loop)
            except OSError as exc:
                log.warning("no shm notice channel (%s); shm batches go over gRPC", exc)

    async def drain(self, timeout: float = 3.0, *, cause: str = "stop requested") -> None:
        """Refuse new streams, end every open one with ``ShuttingDown`` and free its slots.

        Streams being served get the error as their final status (``UNAVAILABLE``); tasks that
        have not ended after ``timeout`` seconds are cancelled. ``cause`` (the signal's name,
        ``idle for N s``) is what the error says the daemon is shutting down for: it said
        "SIGTERM" whatever the cause, SIGINT (Ctrl-C) included.
        """
        if not self.draining:
            self.drain_cause = cause
        self.draining = True
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self.plans.stopping.set()  # pre-compiling stops meanwhile (daemon._precompile)
        await self.streams.drain(self._shutting_down, timeout)

    def close(self) -> None:
        """Free every stream, stop the engine and close the datasets (idempotent)."""
        if self._monitor is not None:
            self._monitor.cancel()
            self._monitor = None
        if self.sweeper is not None:
            self.sweeper.close()
        self.streams.close()
        if self.notices is not None:
            self.notices.close()
            self.notices = None
        self.arenas.close()  # every stream is gone: nothing may still read them
        shm = self.factories.get("shm")
        if isinstance(shm, ShmFactory):  # after the rings, the arenas and the notice socket
            shm.namer.close()
        try:
            if self.engine is not None:
                self.backend.close_engine(self.engine)
                self.engine = None
        finally:
            self.plans.close()
            self.datasets.close()

    # -- datasets --------------------------------------------------------------------------
    def dataset(self, name: str) -> Dataset:
        """The dataset called ``name`` (``SpecError`` otherwise)."""
        return self.datasets.get(name)

    def all_datasets(self) -> list[Dataset]:
        """Every dataset, in start-up order."""
        return list(self.datasets)  # type: ignore[call-overload]

    def close_idle(self, now: float) -> None:
        """Close datasets opened on demand that had no stream for ``files.idle_close_s``."""
        self.opener.close_idle(now, {id(s.dataset) for s in self.streams})

    # -- transports ------------------------------------------------------------------------
    @property
    def grpc_factory(self) -> GrpcFactory | None:
        """The grpc transport's factory (its codecs, chunk size), if this daemon offers it."""
        factory = self.factories.get("grpc")
        return factory if isinstance(factory, GrpcFactory) else None

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

    # -- opening streams -------------------------------------------------------------------
    async def open_stream(self, req: StreamRequest) -> StreamOpened:
        """Validate ``req``, compile (or reuse) its plan, negotiate a transport, create its ring.

        Raises:
            SpecError: the request is invalid (unknown dataset, field or op, bad parameters,
                absurd sizes); the message says what to change.
            TransportError: the forced transport cannot work, or no transport can.
            PipelineError: the pipeline failed to compile.
        """
        self._refuse_if_draining()
        ident = req.offer.identity
        same_host = bool(ident.boot_id) and ident.boot_id == self.facts.identity.boot_id
        ds = await self._unless_drained(self.opener.dataset_for(req, same_host))
        validate_request(req, ds)
        neg, factory = self._negotiate(req.offer)
        # Plan and ring hold the largest batch of the epoch, not a batch_size far above it.
        rows = batch_rows(req.batch_size, _samples_per_epoch(req, ds))
        entry, cached = await self._unless_drained(self.plans.get(req, ds, rows))
        # No await from here on: a drain cannot come between this check and streams.add.
        layout = batch_layout(entry.outputs, rows)
        stream = self._new_stream(req, ds, entry, layout, neg, factory, same_host)
        setup = self._offer_notices(stream, stream.ring.setup())
        self.streams.add(stream)
        _log_opened(stream, req, neg, cached)
        return StreamOpened(
            stream_id=stream.stream_id,
            outputs=entry.outputs,
            setup=setup,
            rejected=neg.rejected,
            num_batches=stream.num_batches,
            batch_size=rows,
            num_samples=_samples_per_epoch(req, ds),
            plan_cached=cached,
            max_credits=stream.ring.slot_count,
            bad_sample_budget=self.bad_sample_budget,  # what _new_stream gave the source
            dataset_digest=ds.digest,
        )

    def _shutting_down(self) -> ShuttingDown:
        """The error of a stream ended, or refused, by :meth:`drain`; it names the cause."""
        return ShuttingDown(
            f"the daemon is shutting down ({self.drain_cause or 'stop requested'}); "
            "reconnect to a new one"
        )

    def _refuse_if_draining(self) -> None:
        if self.draining:
            raise self._shutting_down()

    async def _unless_drained(self, step: Awaitable[_T]) -> _T:
        """Await ``step`` (opening a file, compiling a plan) unless the daemon drains first:
        then ``ShuttingDown`` at once. A stream that opened after :meth:`drain` was never
        drained, and its client, with no such error, retried its whole budget against a
        daemon that was gone; a compile that outlived the server's grace ended the call
        without a status the client knows."""
        if self.draining:
            if asyncio.iscoroutine(step):
                step.close()  # never started: no "was never awaited" warning
            self._refuse_if_draining()
        task = asyncio.ensure_future(step)
        drained = asyncio.get_running_loop().create_future()
        self._drain_waiters.add(drained)
        try:
            await asyncio.wait((task, drained), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this call was cancelled: so is its step
            task.cancel()
            raise
        finally:
            self._drain_waiters.discard(drained)
            drained.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        self._refuse_if_draining()  # a step that ended with the drain is not used either
        return task.result()

    def _new_stream(
        self,
        req: StreamRequest,
        ds: Dataset,
        entry: PlanEntry,
        layout: SlotLayout,
        neg: Negotiation,
        factory: TransportFactory,
        same_host: bool,
    ) -> Stream:
        """The stream's source (in its sharing group) and ring, made into a :class:`Stream`."""
        slots = self._ring_slots(req, layout.slot_bytes)
        shm = factory if neg.transport == "shm" and isinstance(factory, ShmFactory) else None
        source = self._make_source(req, ds, entry, layout, slots, shm)
        try:
            ring: SlotTransport = factory.create(layout, slots, device_index=neg.device_index)
        except BaseException:
            source.close()  # it may have joined a sharing group
            raise
        return Stream(
            stream_id=secrets.token_hex(8),
            dataset=ds,
            source=source,
            ring=ring,
            layout=layout,
            outputs=entry.outputs,
            client_pid=req.offer.identity.pid if same_host else 0,
            client_name=req.client_name,
            engine=self.engine,
        )

    def _ring_slots(self, req: StreamRequest, slot_bytes: int) -> int:
        """Slots for a new stream's ring (event loop, no await before the ring is made): the
        batch the client holds plus its ``batches_ahead``, which must fit the budget
        (:meth:`_check_ring_budget`), and the deeper ring small slots get (``ring_size``) only
        while the open rings stay within half of :attr:`max_ring_bytes`. The extra depth used to
        count as required: on a small ``/dev/shm`` (Docker's default is 64 MiB) one CIFAR-sized
        stream took 16 slots and the next rank's stream was refused though its own 4 fitted.

        Raises:
            ResourceExhausted: the required slots do not fit.
        """
        base = req.batches_ahead + 1
        held = self._check_ring_budget(req, base, slot_bytes)
        budget = self.max_ring_bytes
        room = None if budget <= 0 else budget // 2 - held - base * slot_bytes
        return ring_size(req.batches_ahead, slot_bytes, room)

    def _check_ring_budget(self, req: StreamRequest, slots: int, slot_bytes: int) -> int:
        """Refuse a stream whose ring would take the open streams' rings past
        :attr:`max_ring_bytes` (checked and added on the event loop, with no await between).
        A ring counts as its batch slots (``slots * slot_bytes``): a transport's bookkeeping
        beside them (the shm ring's sample ids and release words) is a few bytes per sample.
        The zero-copy arenas of sharing groups count too, once made (a group makes its arena
        when it first decodes, after its streams were admitted: :meth:`_admit_arena` refuses
        one that does not fit, and the group then shares by copying).

        Returns:
            What the open rings and arenas hold (:meth:`ring_bytes`; 0 without a budget).

        Raises:
            ResourceExhausted: it does not fit (the message says what it needs and what is held).
        """
        budget = self.max_ring_bytes
        need = slots * slot_bytes
        if budget <= 0:
            return 0
        held = self.ring_bytes()
        if held + need <= budget:
            return held
        what = (
            f"this stream needs {human_bytes(need)} ({slots} slots of {human_bytes(slot_bytes)}: "
            f"batch_size {req.batch_size}, batches_ahead {req.batches_ahead})"
        )
        if need > budget:
            raise ResourceExhausted(
                f"{what}, more than the daemon's whole stream memory budget of {human_bytes(budget)} "
                "(max_ring_bytes): use a smaller batch_size or batches_ahead, or start the "
                "daemon with a larger --max-ring-bytes"
            )
        raise ResourceExhausted(
            f"{what}, and the {len(self.streams)} open streams hold {human_bytes(held)} of the "
            f"daemon's {human_bytes(budget)} stream memory budget (max_ring_bytes): retry once "
            "streams close, ask for less, or raise the daemon's --max-ring-bytes"
        )

    def _admit_arena(self, nbytes: int) -> None:
        """Refuse a sharing group's arena that would take the rings past :attr:`max_ring_bytes`
        (the group is made after its first stream was admitted; event-loop thread). Refused,
        the group shares by copying into each member's own ring, which the budget already
        counts.

        Raises:
            ResourceExhausted: it does not fit.
        """
        budget = self.max_ring_bytes
        held = self.ring_bytes()
        if budget > 0 and held + nbytes > budget:
            raise ResourceExhausted(
                f"a sharing arena of {human_bytes(nbytes)} would take the streams' "
                f"{human_bytes(held)} past the daemon's {human_bytes(budget)} stream memory "
                "budget (max_ring_bytes): this group shares by copying"
            )

    def _make_source(
        self,
        req: StreamRequest,
        ds: Dataset,
        entry: PlanEntry,
        layout: SlotLayout,
        slots: int,
        shm: ShmFactory | None,
    ) -> BatchSourceLike:
        """The stream's batches on the shared engine, in its sharing group when sharing is on
        (zero-copy, through an arena, when the stream is shm)."""
        params = source_params(
            req, ds, slots=slots, workers=self.workers, bad_sample_budget=self.bad_sample_budget
        )
        source = self.backend.make_source(self.engine, entry.plan, params)
        if self.sharing is None:
            return source
        arena = (
            None
            if shm is None
            else self.arenas.maker(shm.namer, layout, slots + ARENA_EXTRA, self._admit_arena)
        )
        return shared(
            source,
            self.sharing,
            self.plans.spec_key(req, ds, layout.batch_size),
            req,
            ds.key,
            arena,
            bad_sample_budget=params.bad_sample_budget,
        )

    def _offer_notices(self, stream: Stream, setup: TransportSetup) -> TransportSetup:
        """Register an shm stream with the notice channel; ``setup`` then names it."""
        if setup.kind != "shm" or self.notices is None:
            return setup
        stream.notice_token, stream.notice_future = self.notices.register()
        stream.notice_future.add_done_callback(stream.adopt_peer_pid)
        stream.notice_unregister = self.notices.unregister
        return dataclasses.replace(
            setup, notice_socket=self.notices.name, notice_token=stream.notice_token
        )

    # -- serving a stream ------------------------------------------------------------------
    def run_stream(self, events: AsyncIterator[ClientEvent]) -> AsyncIterator[BatchOut | EpochEnd]:
        """Serve one Batches call (``daemon._call``): the first event must be a
        :class:`StartEpoch`.

        Ends (and frees the stream) when the client stops sending, or raises ``SpecError`` for
        a protocol misuse, ``PipelineError`` for a failed batch.
        """
        return serve_call(self.streams, events)

    # -- stats -----------------------------------------------------------------------------
    @property
    def streams_opened(self) -> int:
        """Streams accepted over the daemon's life."""
        return self.streams.opened

    def stats(self, *, owner_peer: bool = True, public_ids: bool | None = None) -> DaemonStats:
        """A consistent snapshot (call on the event-loop thread). For a peer other than the
        daemon's own user (``owner_peer=False``: a TCP client), only the datasets it may open
        are listed, with their streams and decode groups: a file the daemon's user opened on
        demand is not named to other peers. Its stream rows carry public names instead of the
        stream ids, which are the streams' credentials (``public_ids``, default: not
        ``owner_peer``; ``daemon._stats``)."""
        return self.stats_book.snapshot(
            public_ids=not owner_peer if public_ids is None else public_ids,
            visible=self.opener.visible_to(owner_peer),
            streams=self.streams,
            datasets=self.all_datasets(),
            plans=self.plans.compiled(),
            engine=self.engine,
            max_ring_bytes=self.max_ring_bytes,
            ring_bytes=self.ring_bytes(),
        )

    def ring_bytes(self) -> int:
        """What counts against :attr:`max_ring_bytes`: the open streams' batch slots and the
        sharing groups' arenas."""
        slots = sum(s.ring.slot_count * s.layout.slot_bytes for s in self.streams)
        return slots + self.arenas.nbytes()


def _log_opened(stream: Stream, req: StreamRequest, neg: Negotiation, cached: bool) -> None:
    # A Unix-socket call carries no pid (transport.peer): the stream learns it from the notice
    # channel's SO_PEERCRED moments later (Stream.adopt_peer_pid, logged there).
    log.info(
        "stream %s opened: dataset=%s client=%s pid=%s batch_size=%d batches=%d %s%s",
        stream.stream_id,
        stream.dataset.name,
        req.client_name or "-",
        req.offer.identity.pid or "-",
        req.batch_size,
        stream.num_batches,
        neg.summary(),
        " (cached plan)" if cached else "",
    )


def _samples_per_epoch(req: StreamRequest, ds: Dataset) -> int:
    """Samples one epoch of ``req`` holds (its share of them when distributed)."""
    n = len(req.indices) if req.indices is not None else ds.num_samples
    return math.ceil(n / req.world_size) if req.distributed else n


def ring_budget(max_ring_bytes: int, shm_dir: str | os.PathLike[str] = SHM_DIR) -> int:
    """The bytes all open streams' rings may hold: ``max_ring_bytes`` if positive, else half
    the size of the ``shm_dir`` filesystem (0, no bound, where it cannot be read)."""
    if max_ring_bytes > 0:
        return int(max_ring_bytes)
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        return 0
    return st.f_blocks * st.f_frsize // 2
