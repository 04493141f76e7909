"""The in-process ``Loader``: the one Loader front end over the engine in this process.

``beton_serve.loader.Loader`` is ``beton_client``'s front end (``beton_client.frontend``: the
argument rules, the pipeline split, the tail after ``ToTensor``, ``state_dict`` and epochs, all
shared with the served Loader) with :class:`EngineBackend`: the daemon-side part of each pipeline
(the ops up to the boundary, the tail's ops as placeholders that keep their graph positions) is
compiled here and run by the engine's workers, exactly as the daemon runs it.

Per epoch, an :class:`EngineEpochFeed` submits up to ``batches_ahead`` batches of a
:class:`~beton_serve.engine.BatchSource` to the worker pool, each into one of
``batches_ahead + 2`` preallocated slots; the front end runs the tail in the consumer's thread
when a batch is taken.

**Lifetime of outputs.** A yielded batch is made of views into a reused slot and into the
tail's reused buffers: it is valid until the next batch is requested (as in FFCV). Clone what
you keep, or pass ``copy=True``.

**Threads.** Unless an ``engine`` is passed (then they are the caller's), the worker threads
(``beton-worker-N``) start with the first epoch and live until the Loader is closed or
garbage-collected; starting and joining them for every epoch cost ~0.6 ms of each epoch's start,
while the workers idled (RESULTS.md, session 20). An epoch iterator that is exhausted, closed,
replaced by a new ``iter(loader)``, or garbage-collected mid-epoch cancels its queued batches
and waits for running ones (FFCV #345, #393). An epoch that fails (a batch's error, a
``batch_timeout``) stops the workers as well, so that a worker stuck in an op is not handed the
next epoch: the next ``iter()`` starts new ones. A process forked from one with a Loader starts
new workers for its own epochs (the engine module's "Fork").

**Resumption.** ``state_dict()`` is ``beton_wire.loader_state``, the same as the served Loader's:
orders and augmentations are pure functions of (seed, epoch, sample id, op position), so a state
taken on any backend resumes on any other exactly.
"""

from __future__ import annotations

import collections
import logging
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np
from beton_client.frontend import (
    EpochIterator,
    ErrorKinds,
    FrontEnd,
    LoaderArgs,
    OutputInfo,
    PipelinePlan,
    RawBatch,
    check_args,
    gc_paused,
    pipelines_key,
)
from beton_wire.limits import indices_outside, usable_cpus
from beton_wire.loader_state import batch_rows, samples_per_rank

from beton_serve._batchmem import batch_empty
from beton_serve.engine import (
    BatchFuture,
    BatchSource,
    Engine,
    OrderOption,
    TraversalOrder,
)
from beton_serve.errors import BetonError, PipelineError, SpecError
from beton_serve.pipeline import Plan, PlanCache, compile_pipelines
from beton_serve.pipeline.pipeline_spec import PipelineSpec
from beton_serve.pipeline.registry import ClientOp

__all__ = ["EngineBackend", "EngineEpochFeed", "EngineFeed", "EpochIterator", "Loader"]

_log = logging.getLogger(__name__)

#: The in-process Loader's error classes (``beton_serve.errors``).
ENGINE_ERRORS = ErrorKinds(spec=SpecError, pipeline=PipelineError, closed=BetonError)


def engine_pipelines(plans: Sequence[PipelinePlan]) -> dict[str, Any]:
    """The pipelines the engine compiles: each one's ops up to the boundary (the user's objects),
    then one :class:`ClientOp` placeholder per tail op, so that every node keeps the position
    its random draws derive from (the daemon's graph is built the same way from the wire)."""
    out: dict[str, Any] = {}
    for p in plans:
        if p.skip:
            out[p.name] = None
            continue
        ops = [*p.user_ops[: p.boundary], *(ClientOp() for _ in p.tail)]
        spec = p.spec
        if spec is None:
            out[p.name] = ops
        elif p.branch is not None or spec.decoder is None:
            out[p.name] = PipelineSpec(spec.source, transforms=ops)
        else:
            out[p.name] = PipelineSpec(spec.source, decoder=ops[0], transforms=ops[1:])
    return out


class EngineBackend:
    """The in-process backend (``beton_client.frontend.Backend``): this process's engine.

    Args:
        reader: the open ``BetonReader`` (closed by :meth:`close` when ``owns_reader``).
        loader: the Loader, given to a custom ``TraversalOrder`` class as FFCV does.
        engine, plan_cache, bad_sample_budget, slices, batch_timeout, verify_checksums,
        order_kwargs: as :class:`Loader`'s.
    """

    errors = ENGINE_ERRORS
    #: A forked child runs its epochs on workers of its own (``Engine``).
    fork_safe = True

    def __init__(
        self,
        reader: Any,
        owns_reader: bool,
        *,
        loader: Any,
        engine: Engine | None,
        plan_cache: PlanCache | None,
        bad_sample_budget: int,
        slices: int | None,
        batch_timeout: float | None,
        verify_checksums: bool,
        order_kwargs: Mapping[str, Any],
    ) -> None:
        self.reader = reader
        self._owns_reader = owns_reader
        self._loader = weakref.ref(loader)
        self.engine = engine
        self.plan_cache = plan_cache
        self.bad_sample_budget = int(bad_sample_budget)
        self.slices = slices
        self.batch_timeout = batch_timeout
        self.order_kwargs = dict(order_kwargs)
        #: ``--verify-checksums`` in process: the sidecar checker every plan runs before decoding.
        self.sample_check: Callable[[np.ndarray], None] | None = None
        if verify_checksums:
            from beton_serve.format import ChecksumVerifier

            readers = getattr(self.reader, "readers", [self.reader])
            self.sample_check = ChecksumVerifier(readers).check
        self.order: OrderOption | TraversalOrder | None = None
        self.indices: np.ndarray | None = None
        #: The file by content, as a daemon names it (``beton_wire.file_identity``).
        from beton_serve.format import readers_digest

        self.dataset_digest = readers_digest(getattr(reader, "readers", [reader]))

    def _order(self, args: LoaderArgs) -> OrderOption | TraversalOrder:
        if self.order is not None:
            return self.order
        order = args.order
        if isinstance(order, str):
            order = OrderOption[order]
        elif isinstance(order, type):
            order = order(self._loader(), **self.order_kwargs)
        self.order = order
        return order

    def _indices(self, args: LoaderArgs) -> np.ndarray:
        if self.indices is not None:
            return self.indices
        n = self.reader.num_samples
        if args.indices is None:
            self.indices = np.arange(n, dtype=np.uint64)
        else:
            if int(args.indices.max()) >= n:
                raise SpecError(
                    indices_outside(n, int(args.indices.min()), int(args.indices.max()))
                )
            self.indices = args.indices
        return self.indices

    def open(self, args: LoaderArgs, plans: Sequence[PipelinePlan]) -> EngineFeed:
        indices = self._indices(args)
        order = self._order(args)
        num_samples = samples_per_rank(
            len(indices), distributed=args.distributed, world_size=args.world_size
        )
        # Buffers for the largest batch the epoch has (a custom order's length is its own).
        rows = (
            batch_rows(args.batch_size, num_samples)
            if isinstance(order, OrderOption)
            else args.batch_size
        )
        plan = compile_pipelines(
            self.reader,
            engine_pipelines(plans),
            batch_size=rows,
            custom_fields=args.custom_fields,
            cache=self.plan_cache,
            sample_check=self.sample_check,
        )
        workers = args.num_workers if args.num_workers >= 1 else usable_cpus()
        source = BatchSource(
            engine=self.engine,  # type: ignore[arg-type]  # set per epoch when the Loader owns workers
            plan=plan,
            order=order,
            batch_size=args.batch_size,
            seed=args.seed,
            indices=indices,
            drop_last=args.drop_last,
            distributed=args.distributed,
            rank=args.rank,
            world_size=args.world_size,
            # in flight: the batch the consumer waits for and batches_ahead more (next() submits
            # b + batches_ahead before it waits for b); the ring's batches_ahead + 2 slots hold
            # them and the batch the consumer still holds
            batches_ahead=args.batches_ahead + 1,
            bad_sample_budget=self.bad_sample_budget,
            slices=workers if self.slices is None else self.slices,
        )
        return EngineFeed(self, args, plans, plan, source, workers, num_samples)

    def retriable(self, err: BaseException) -> bool:
        return False  # nothing went away: every error is final

    def reconnect(
        self,
        err: BaseException,
        args: LoaderArgs,
        plans: Sequence[PipelinePlan],
        num_batches: int | None,
    ) -> EngineFeed:
        raise err

    def close(self) -> None:
        if self._owns_reader:
            self._owns_reader = False
            self.reader.close()


def _dtype_text(dtype: np.dtype) -> str:
    """``dtype``'s name when numpy parses it back (``"float32"``), else its full text
    (``"|S4"``: numpy cannot parse the name ``"bytes32"``, and a name drops the byte order)."""
    try:
        if np.dtype(dtype.name) == dtype:
            return dtype.name
    except TypeError:
        pass
    return dtype.str


class EngineFeed:
    """One compiled plan and its batch source (``beton_client.frontend.Feed``)."""

    def __init__(
        self,
        backend: EngineBackend,
        args: LoaderArgs,
        plans: Sequence[PipelinePlan],
        plan: Plan,
        source: BatchSource,
        workers: int,
        num_samples: int,
    ) -> None:
        self.backend = backend
        self.args = args
        self.plan = plan
        self.source = source
        self.workers = workers
        self.num_batches = len(source)
        self.num_samples = num_samples
        self.dataset_digest = backend.dataset_digest
        self.batch_rows = plan.batch_size
        #: The ops compiled, by identity, and their parameters as compiled: the user changing
        #: an op's parameters between epochs (``flip_prob``, ``output_size``) makes the next
        #: ``iter`` build a new plan, as a daemon opens a new stream (``pipelines_key``): the
        #: generated code reads parameters when it is generated (FFCV's ``recompile=False``).
        self._ops = _identity(plans)
        self._params = pipelines_key(plans)
        self._slots: list[list[np.ndarray]] | None = None
        self._planned = False
        self._outputs: tuple[OutputInfo, ...] = ()
        self._outputs_generation = -1
        self._update_outputs()
        #: The pool this feed owns when the backend has none (module docstring, "Threads").
        self._owned: Engine | None = None
        self._owned_stop: weakref.finalize[Any, Any] | None = None
        #: The last epoch's release (its finalizer): run before the next epoch starts.
        self._last_epoch: weakref.finalize[Any, Any] | None = None

    def engine(self) -> tuple[Engine, bool]:
        """The engine the next epoch runs on, and whether this feed owns it: the backend's, or
        this feed's own, started now if it has none or its last one was closed (a failed epoch,
        a fork)."""
        shared = self.backend.engine
        if shared is not None:
            return shared, False
        engine = self._owned
        if engine is None or engine.closed:
            self._stop_owned()
            engine = Engine(self.workers)
            try:
                self._owned = engine
                # The finalizer holds the engine, not the feed: a dropped Loader stops its
                # workers.
                self._owned_stop = weakref.finalize(self, _stop_engine, engine)
            except BaseException:  # Ctrl-C before the finalizer held it: nobody else will
                if self._owned_stop is None:
                    self._owned = None
                    engine.close(join=False)
                raise
        return engine, True

    def _stop_owned(self) -> None:
        stop, self._owned_stop = self._owned_stop, None
        self._owned = None
        if stop is not None:
            stop()

    def _update_outputs(self) -> None:
        plan = self.plan
        if plan.generation == self._outputs_generation:
            return
        outputs = []
        jit = {nd.position for nd in plan.jit_nodes}
        for path, spec in zip(plan.paths, plan.outputs, strict=True):
            tail = [nd for nd in path.nodes if nd.position not in jit]
            outputs.append(
                OutputInfo(
                    spec.name,
                    tuple(spec.shape),
                    _dtype_text(spec.dtype),
                    tuple(nd.op for nd in tail if not isinstance(nd.op, ClientOp)),
                    tuple(nd.position for nd in tail),
                )
            )
        self._outputs = tuple(outputs)
        self._outputs_generation = plan.generation

    @property
    def outputs(self) -> Sequence[OutputInfo]:
        return self._outputs

    def accepts(self, plans: Sequence[PipelinePlan]) -> bool:
        return _identity(plans) == self._ops and pipelines_key(plans) == self._params

    def epoch(self, epoch: int, start: int) -> EngineEpochFeed:
        """Epoch ``epoch`` from batch ``start``.

        The previous epoch of this feed is released first (queued batches cancelled, running
        ones waited for) even if nobody closed it: the two epochs' batches share
        :attr:`_slots`, and a batch of the old epoch still running would write into a slot the
        new epoch hands out. The front end closes an epoch before it starts another; this makes
        that an invariant of the feed rather than of every caller (a Ctrl-C can land between
        the two).
        """
        last, self._last_epoch = self._last_epoch, None
        if last is not None:
            last()  # idempotent: nothing left to do when the epoch was closed
        plan = self.plan
        changed = plan.refresh(epoch, recompile=self.args.recompile and self._planned)
        self._planned = True
        if changed or self._slots is None:
            slots = self.args.batches_ahead + 2
            batch = plan.batch_size  # the largest batch of the epoch (batch_rows)
            try:
                self._slots = [
                    [batch_empty((batch, *o.shape), o.dtype) for o in plan.outputs]
                    for _ in range(slots)
                ]
            except MemoryError:
                sizes = {o.name: (batch, *o.shape) for o in plan.outputs}
                raise SpecError(
                    f"{slots} batches of {sizes} cannot be allocated in this process; use a "
                    "smaller batch_size or a crop decoder (or check the file's image sizes: "
                    "beton-serve inspect FILE)"
                ) from None
        self._update_outputs()
        ef = EngineEpochFeed(self, epoch, start)
        self._last_epoch = ef._finalizer
        return ef

    def close(self) -> None:
        self._slots = None
        self._stop_owned()


def _stop_engine(engine: Engine) -> None:
    """Stop an owned engine; not waiting when called on one of its workers (a finalizer run by
    the garbage collector inside a task: a worker cannot join itself)."""
    engine.close(join=not engine.on_worker_thread())


def _identity(plans: Sequence[PipelinePlan]) -> list[tuple[Any, ...]]:
    return [(p.name, p.field, p.skip, p.boundary, tuple(map(id, p.user_ops))) for p in plans]


class _Running:
    """What an epoch must release; held by its finalizer, so it never references the feed."""

    def __init__(self, engine: Engine, owns_engine: bool, batches_ahead: int) -> None:
        self.engine = engine
        self.owns_engine = owns_engine
        #: Set when a batch failed or timed out: an owned engine is then stopped with the epoch.
        self.failed = False
        self.futures: collections.deque[Future[Any]] = collections.deque()
        #: The epoch's in-flight batches, which size the prefetch slices (``Engine``).
        self.demand = engine.hold_demand(batches_ahead)

    def release(self) -> None:
        """Cancel the epoch's queued tasks, wait for its running ones; close an owned engine
        if the epoch failed (the feed starts a new one for the next epoch).

        As a finalizer it may run on one of the engine's own workers, inside a task (the
        garbage collector runs wherever an allocation triggers it). There it waits for nothing:
        the running tasks may include the one it interrupted, and a worker cannot join itself.
        Their buffers stay alive through the tasks' own references until they finish.
        """
        self.demand.release()
        on_worker = self.engine.on_worker_thread()
        for fut in self.futures:
            for task in getattr(fut, "tasks", ()):
                task.future.cancel()
        if not on_worker:
            for fut in self.futures:
                try:
                    fut.exception(timeout=self.engine.join_timeout)
                except (
                    FutureTimeout,
                    Exception,
                ):  # only waiting for completion; errors were raised
                    pass
        self.futures.clear()
        if self.owns_engine and self.failed:
            self.engine.close(join=not on_worker)


class EngineEpochFeed:
    """One epoch on the engine (``beton_client.frontend.EpochFeed``)."""

    def __init__(self, feed: EngineFeed, epoch: int, start: int) -> None:
        self.epoch = epoch
        self.batch = start
        self._end = feed.num_batches
        self._source = feed.source
        self._slots = feed._slots or []
        self._batches_ahead = feed.args.batches_ahead
        self._timeout = feed.backend.batch_timeout
        engine, owned = feed.engine()  # the feed's own (kept across epochs) or the backend's
        self._source.engine = engine
        # the source's credit: the awaited batch and batches_ahead more (EngineBackend.source)
        self._running = _Running(engine, owned, self._source.batches_ahead)
        self._finalizer = weakref.finalize(self, self._running.release)
        self._next_submit = start
        for _ in range(self._batches_ahead):
            self._submit_one()

    def _submit_one(self) -> None:
        b = self._next_submit
        if b >= self._end:
            return
        slot = self._slots[b % len(self._slots)]
        # The batch the consumer needs next is split across the workers; a prefetched one runs
        # in as many parts as keep every worker busy (whole when the batches ahead do), and the
        # last ones of the epoch in more, so that no worker idles while one ends the epoch.
        waited = b == self.batch
        source = self._source
        if waited:
            slices = None
        else:
            engine = self._running.engine
            slices = min(source.slices, engine.prefetch_slices())
            if source.slices > 1:  # slices=1: the user asked for whole batches
                slices = max(slices, engine.tail_slices(self._end - b))
        fut = source.submit(self.epoch, b, slot, priority=0 if waited else 1, slices=slices)
        self._running.futures.append(fut)
        self._next_submit += 1

    def next(self) -> RawBatch | None:
        if self.batch >= self._end:
            self.close()
            return None
        fut = self._running.futures.popleft()
        BatchSource.promote(fut)
        # The consumer is done with batch b - 2 (it may hold b - 1): its slot takes b + ahead
        # now, before waiting for b, so a worker that finishes b finds work queued instead of
        # idling until this thread wakes (~120 us per task at 2 workers, CIFAR-like).
        self._submit_one()
        try:
            arrays = fut.result(timeout=self._timeout)
            self._source.charge(self.epoch, fut)  # its bad samples, in batch order
        except FutureTimeout:
            self._running.failed = True
            self.close()
            raise PipelineError(
                f"batch {self.batch} of epoch {self.epoch} did not arrive within "
                f"{self._timeout} s; a worker may be stuck in an op "
                "(raise batch_timeout if batches are legitimately this slow)"
            ) from None
        except KeyboardInterrupt:
            raise  # not a failed batch: the front end re-opens the epoch at this batch
        except BaseException:
            self._running.failed = True
            self.close()
            # The error's traceback keeps this frame, and the future keeps the error: without
            # the future here, the two are no reference cycle (freed without a collection).
            del fut
            raise
        b = self.batch
        self.batch = b + 1
        # The ids the batch holds (a skipped sample replaced: engine._source.delivered_ids);
        # the order's are looked up only for a future without them (a test's fake source).
        ids = fut.sample_ids if isinstance(fut, BatchFuture) else None
        if ids is None:
            ids = self._source.batch_ids(self.epoch, b)
        return RawBatch(arrays, ids)

    def release(self) -> None:
        """Nothing to do: a slot is reused only ``batches_ahead + 2`` batches later."""

    def close(self) -> None:
        """Cancel queued batches, wait for running ones; after a failure, stop owned workers
        (idempotent)."""
        self._finalizer()


class Loader(FrontEnd):
    """FFCV's ``Loader`` (``ffcv.loader.Loader``), running in this process.

    The same front end as ``beton_client.Loader`` (one implementation of the arguments, the
    split, the tail, ``state_dict`` and epochs) over :class:`EngineBackend`.

    Args:
        fname: path of the ``.beton`` file (or an open reader, which the Loader does not close).
        batch_size: samples per batch.
        num_workers: worker threads; ``< 1`` means the CPUs this process may use.
        os_cache: accepted for FFCV compatibility. The file is always memory-mapped and the OS
            page cache is used (FFCV's ``os_cache=True``); ``False`` changes nothing.
        order: ``OrderOption`` or a ``TraversalOrder`` subclass (constructed as
            ``cls(loader, **order_kwargs)``) or instance.
        distributed: emulate ``DistributedSampler``; rank and world size come from
            ``torch.distributed`` if initialised, else ``RANK``/``WORLD_SIZE`` (read here).
        seed: order and augmentation seed. ``None``: 0 when ``distributed`` and RANDOM, else
            drawn from numpy's global RNG (FFCV's rule).
        indices: sample ids to visit (duplicates allowed); ``None`` means all.
        pipelines, custom_fields: FFCV's (see ``compile_pipelines``).
        drop_last: drop the final partial batch.
        batches_ahead: batches decoded ahead of the consumer.
        recompile: regenerate and recompile every op's code at each epoch.
        order_kwargs: extra arguments of a custom order class.
        copy: copy every batch out of its slot (then it stays valid after the next batch).
        engine: a shared :class:`Engine` to run on instead of private workers.
        plan_cache: share compiled pipelines with other Loaders over the same file (the
            file itself: another file at the same path, or the file rewritten, compiles anew).
        bad_sample_budget: failing samples that may be skipped (see ``BatchSource``).
        batch_timeout: seconds ``next()`` waits for one batch before raising
            ``PipelineError`` (``None``: forever). The first batch includes Numba compilation.
        slices: units of work for a batch the consumer is already waiting for (default:
            ``num_workers`` when the plan allows it); prefetched batches run whole, which costs
            less per image.
        verify_checksums: check every sample against the file's CRC32C sidecar
            (``FILE.crc32c``, written by ``beton-serve checksum FILE``) on the worker, right
            before it is decoded. A sample that does not match is a bad sample: a
            ``PipelineError`` naming its id (op ``checksum``), or skipped under
            ``bad_sample_budget``. A missing, stale or damaged sidecar is a ``FormatError``
            here, at construction.

    Raises:
        SpecError: invalid arguments or pipelines (the message says what to change).
        FormatError: the file is invalid.
    """

    _backend: EngineBackend
    _feed: EngineFeed | None  # type: ignore[assignment]

    @gc_paused()  # numba's import and the kernels' loads (beton_client._gcpause)
    def __init__(
        self,
        fname: str | os.PathLike[str] | Any,
        batch_size: int,
        num_workers: int = -1,
        os_cache: bool = True,
        order: OrderOption | type[TraversalOrder] | TraversalOrder = OrderOption.SEQUENTIAL,
        distributed: bool = False,
        seed: int | None = None,
        indices: Sequence[int] | np.ndarray | None = None,
        pipelines: Mapping[str, Sequence[Any] | PipelineSpec | None] | None = None,
        custom_fields: Mapping[str, type] | None = None,
        drop_last: bool = True,
        batches_ahead: int = 3,
        recompile: bool = False,
        *,
        order_kwargs: Mapping[str, Any] | None = None,
        copy: bool = False,
        engine: Engine | None = None,
        plan_cache: PlanCache | None = None,
        bad_sample_budget: int = 0,
        slices: int | None = None,
        batch_timeout: float | None = 600.0,
        verify_checksums: bool = False,
    ) -> None:
        args = check_args(
            batch_size=batch_size,
            num_workers=num_workers,
            order=order,
            distributed=distributed,
            seed=seed,
            indices=indices,
            custom_fields=custom_fields,
            drop_last=drop_last,
            batches_ahead=batches_ahead,
            recompile=recompile,
            copy=copy,
            errors=ENGINE_ERRORS,
            environ=os.environ,
            custom_order=TraversalOrder,
        )
        if isinstance(fname, str | os.PathLike):
            from beton_serve.format import BetonReader

            if pipelines and os.path.isfile(fname):
                from beton_serve.fields.decoders import start_prewarm_early

                start_prewarm_early(pipelines)  # a cold cache: the helper starts now
            reader = BetonReader(fname, custom_fields=dict(args.custom_fields) or None)
            owns = True
        else:
            reader, owns = fname, False
        self.reader = reader
        self.fname = getattr(reader, "path", None)
        self.os_cache = os_cache
        self._order_arg = order
        self._order_kwargs = dict(order_kwargs or {})
        self.verify_checksums = bool(verify_checksums)
        #: The sample ids visited (``uint64``; every sample when ``indices`` is ``None``).
        self.indices: np.ndarray = (
            np.arange(reader.num_samples, dtype=np.uint64) if args.indices is None else args.indices
        )
        self.indices.flags.writeable = False  # read-only, as ``args.indices`` is
        backend = EngineBackend(
            reader,
            owns,
            loader=self,
            engine=engine,
            plan_cache=plan_cache,
            bad_sample_budget=bad_sample_budget,
            slices=slices,
            batch_timeout=batch_timeout,
            verify_checksums=verify_checksums,
            order_kwargs=self._order_kwargs,
        )
        # Attributes a custom TraversalOrder reads from its loader, before the feed opens.
        self.seed, self.distributed = args.seed, args.distributed
        self.rank, self.world_size, self.batch_size = args.rank, args.world_size, args.batch_size
        self._start(backend, args, order, pipelines)
        self.num_workers = self._engine_feed().workers
        #: The order object (a custom order is constructed here, as FFCV does).
        self.order = backend.order  # type: ignore[assignment]
        self.batch_timeout = batch_timeout
        self._freeze()

    # -- in-process extras ---------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        """The compiled daemon-side plan (the ops up to the boundary, placeholders after)."""
        return self._engine_feed().plan

    @property
    def _source(self) -> BatchSource:
        return self._engine_feed().source

    def _engine_feed(self) -> EngineFeed:
        feed = self._feed_or_raise()
        assert isinstance(feed, EngineFeed)
        return feed

    def sample_order(self, epoch: int) -> np.ndarray:
        """The sample ids this rank visits in ``epoch`` (before batching)."""
        return self._source.sample_order(epoch)

    @property
    def bad_samples(self) -> list[Any]:
        """``(epoch, sample_id, op)`` of every sample skipped under the bad-sample budget."""
        return list(self._source.bad_samples)

    def filter(self, field_name: str, condition: Any) -> Loader:
        """A Loader over the samples of this one whose ``field_name`` satisfies ``condition``.

        Decodes ``field_name`` alone (its default decoder, no ``ToTensor``) over this Loader's
        ``indices`` in order, calls ``condition(value)`` per sample, and returns a new Loader with
        the same arguments and ``indices`` = the **sample ids** that passed (FFCV returns batch
        positions instead, which is wrong once ``indices`` is set).
        """
        if field_name not in self.reader.handlers:
            raise SpecError(
                f"filter: unknown field {field_name!r}; the file has {self.reader.field_names}"
            )
        only: dict[str, list[Any] | None] = dict.fromkeys(self.reader.field_names)
        only[field_name] = [self.reader.handlers[field_name].get_decoder_class()()]
        plan = compile_pipelines(
            self.reader,
            only,
            batch_size=batch_rows(self.batch_size, len(self.indices)),
            sample_check=self._backend.sample_check,
        )
        keep: list[int] = []
        with Engine(1) as eng:
            src = BatchSource(
                engine=eng,
                plan=plan,
                order=OrderOption.SEQUENTIAL,
                batch_size=self.batch_size,
                indices=self.indices,
                drop_last=False,
            )
            for b in range(len(src)):
                ids = src.batch_ids(0, b)
                (values,) = src.submit(0, b).result()
                keep.extend(int(i) for i, v in zip(ids, values, strict=True) if condition(v))
        backend = self._backend
        return Loader(
            self.reader,
            self.batch_size,
            self.num_workers,
            self.os_cache,
            self._order_arg,
            self.distributed,
            self.seed,
            np.array(keep, dtype=np.uint64),
            self.pipelines,
            self.custom_fields,
            self.drop_last,
            self.batches_ahead,
            self.recompile,
            order_kwargs=self._order_kwargs,
            copy=self.copy,
            engine=backend.engine,
            bad_sample_budget=backend.bad_sample_budget,
            verify_checksums=self.verify_checksums,
        )

    def __enter__(self) -> Loader:
        return self
