"""The in-process ``Loader``: FFCV's signature and semantics on the shared engine.

Per epoch, an :class:`EpochIterator` submits up to ``batches_ahead`` batches of a
:class:`~beton_serve.engine.BatchSource` to the worker pool, each into one of
``batches_ahead + 2`` preallocated slots, and runs the client tail (``ToTensor`` onwards) in the
consumer's thread when a batch is taken.

**Lifetime of outputs.** A yielded batch is made of views into a reused slot and into the
client tail's reused buffers: it is valid until the next batch is requested (as in FFCV). Clone
what you keep.

**Threads.** The worker threads (``beton-worker-N``) live as long as an epoch iterator does,
unless an ``engine`` is passed (then they are the caller's). An iterator that is exhausted,
closed, replaced by a new ``iter(loader)``, or garbage-collected mid-epoch cancels its queued
batches, waits for running ones and stops its workers: nothing leaks (FFCV #345, #393).

**Resumption.** ``state_dict()`` is ``{"epoch", "batch", ...}`` (``beton_wire.loader_state``):
the epoch being iterated and the number of batches already yielded from it. ``load_state_dict``
makes the next ``iter`` continue there, exactly, because orders and augmentations are pure
functions of (seed, epoch, sample id, op position).
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
from beton_wire.limits import MAX_BATCH_SIZE, short_repr
from beton_wire.loader_state import (
    StateError,
    StateIdentity,
    check_state,
    indices_digest,
    make_state,
    samples_per_rank,
)

from beton_serve.engine import (
    BatchSource,
    Engine,
    OrderOption,
    TraversalOrder,
    delivered_ids,
    distributed_rank_world,
)
from beton_serve.errors import PipelineError, SpecError
from beton_serve.pipeline import PlanCache, compile_pipelines
from beton_serve.pipeline.pipeline_spec import PipelineSpec

__all__ = ["EpochIterator", "Loader"]

_log = logging.getLogger(__name__)


def _default_workers() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class Loader:
    """FFCV's ``Loader`` (``ffcv.loader.Loader``), running in this process.

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
        engine: a shared :class:`Engine` to run on instead of private workers.
        plan_cache: share compiled pipelines with other Loaders.
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
        engine: Engine | None = None,
        plan_cache: PlanCache | None = None,
        bad_sample_budget: int = 0,
        slices: int | None = None,
        batch_timeout: float | None = 600.0,
        verify_checksums: bool = False,
    ) -> None:
        if isinstance(fname, str | os.PathLike):
            from beton_serve.format import BetonReader

            self.reader = BetonReader(fname, custom_fields=dict(custom_fields or {}) or None)
            self._owns_reader = True
        else:
            self.reader = fname
            self._owns_reader = False
        if isinstance(order, int) and not isinstance(order, OrderOption):
            order = OrderOption(order)
        self._order_arg = order
        self._order_kwargs = dict(order_kwargs or {})
        self._custom_fields = dict(custom_fields or {})
        self.fname = getattr(self.reader, "path", None)
        if (
            not isinstance(batch_size, int | np.integer)
            or isinstance(batch_size, bool)
            or not 1 <= int(batch_size) <= MAX_BATCH_SIZE
        ):
            # the served Loader's rule and words (beton_wire.limits), refused the same way here
            raise SpecError(
                f"batch_size {short_repr(batch_size)} is out of range: use an int in "
                f"1..{MAX_BATCH_SIZE} (the daemon also refuses batches larger than its slot "
                "memory allows)"
            )
        self.batch_size = int(batch_size)
        self.num_workers = int(num_workers) if num_workers >= 1 else _default_workers()
        self.os_cache = os_cache
        self.distributed = bool(distributed)
        self.drop_last = bool(drop_last)
        self.batches_ahead = int(batches_ahead)
        self.recompile = bool(recompile)
        self.batch_timeout = batch_timeout
        if seed is None:
            if self.distributed and order is OrderOption.RANDOM:
                _log.warning("distributed RANDOM order without a seed: using seed=0 on every rank")
                seed = 0
            else:
                seed = int(np.random.randint(0, 2**31 - 1))
        if not isinstance(seed, int | np.integer) or not 0 <= int(seed) < 2**64:
            # the served Loader's range (a uint64 on the wire), refused the same way here
            raise SpecError(f"seed must be an int in [0, 2**64), not {short_repr(seed)}")
        self.seed = int(seed)
        self.rank, self.world_size = distributed_rank_world() if self.distributed else (0, 1)
        n = self.reader.num_samples
        if indices is not None:
            raw = np.asarray(indices).reshape(-1)
            if raw.size and (
                raw.dtype.kind not in "iu" or int(raw.min()) < 0 or int(raw.max()) >= n
            ):
                # Checked before the uint64 cast, which would turn -1 into 2**64-1.
                raise SpecError(
                    f"indices must be integer sample ids in [0, {n}); got values from "
                    f"{short_repr(raw.min())} to {short_repr(raw.max())}"
                )
        self.indices = np.arange(n, dtype=np.uint64) if indices is None else raw.astype(np.uint64)
        if indices is not None and self.indices.size == 0:
            # as the daemon does: an empty subset is almost always a filter that matched nothing
            raise SpecError("indices=[] selects no samples; pass indices=None for every sample")
        if isinstance(order, type) and issubclass(order, TraversalOrder):
            order = order(self, **dict(order_kwargs or {}))
        if not isinstance(order, OrderOption | TraversalOrder):
            raise SpecError(f"order must be an OrderOption or a TraversalOrder, not {order!r}")
        self.order = order
        self.pipelines = dict(pipelines or {})
        self.verify_checksums = bool(verify_checksums)
        #: ``--verify-checksums`` in process: the sidecar checker every plan runs before decoding.
        self._sample_check: Callable[[np.ndarray], None] | None = None
        if self.verify_checksums:
            from beton_serve.format import ChecksumVerifier

            readers = getattr(self.reader, "readers", [self.reader])
            self._sample_check = ChecksumVerifier(readers).check
        self.plan = compile_pipelines(
            self.reader,
            self.pipelines,
            batch_size=self.batch_size,
            custom_fields=custom_fields,
            cache=plan_cache,
            sample_check=self._sample_check,
        )
        self._engine = engine
        self._source = BatchSource(
            engine=engine,  # type: ignore[arg-type]  # set per epoch when the Loader owns workers
            plan=self.plan,
            order=order,
            batch_size=self.batch_size,
            seed=self.seed,
            indices=self.indices,
            drop_last=self.drop_last,
            distributed=self.distributed,
            rank=self.rank,
            world_size=self.world_size,
            batches_ahead=self.batches_ahead,
            bad_sample_budget=bad_sample_budget,
            slices=self.num_workers if slices is None else slices,
        )
        self.next_epoch = 0
        self._resume_batch = 0
        self._slots: list[list[np.ndarray]] | None = None
        self._first_epoch_planned = False
        self._current: weakref.ref[EpochIterator] | None = None
        #: (epoch, batches yielded) of the latest iterator, even once closed or collected.
        self._position: tuple[int, int] | None = None
        #: The ``indices`` argument as ids (``None`` for every sample), for the state's digest.
        self._subset = None if indices is None else self.indices
        self._identity: StateIdentity | None = None
        #: The sample ids of the batch last yielded (dataset ids, in batch order), as in FFCV's
        #: served counterpart; empty before the first batch.
        self.last_sample_ids: np.ndarray = np.empty(0, np.uint64)

    # -- FFCV surface --------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._source)

    def sample_order(self, epoch: int) -> np.ndarray:
        """The sample ids this rank visits in ``epoch`` (before batching)."""
        return self._source.sample_order(epoch)

    @property
    def bad_samples(self) -> list[Any]:
        """``(epoch, sample_id, op)`` of every sample skipped under the bad-sample budget."""
        return list(self._source.bad_samples)

    def __iter__(self) -> EpochIterator:
        prev = self._current() if self._current is not None else None
        if prev is not None:
            prev.close()
        epoch, start = self.next_epoch, self._resume_batch
        self.next_epoch += 1
        self._resume_batch = 0
        changed = self.plan.refresh(epoch, recompile=self.recompile and self._first_epoch_planned)
        self._first_epoch_planned = True
        if changed or self._slots is None:
            slots = self.batches_ahead + 2
            try:
                self._slots = [
                    [np.empty((self.batch_size, *o.shape), o.dtype) for o in self.plan.outputs]
                    for _ in range(slots)
                ]
            except MemoryError:
                sizes = {o.name: (self.batch_size, *o.shape) for o in self.plan.outputs}
                raise SpecError(
                    f"{slots} batches of {sizes} cannot be allocated in this process; use a "
                    "smaller batch_size or a crop decoder (or check the file's image sizes: "
                    "beton-serve inspect FILE)"
                ) from None
        it = EpochIterator(self, epoch, start)
        self._current = weakref.ref(it)
        self._position = (epoch, start)
        return it

    def state_dict(self) -> dict[str, Any]:
        """Where iteration stands: resume with :meth:`load_state_dict` on an equal Loader.

        ``epoch`` and ``batch`` count what the latest iterator has *yielded*, also after it was
        closed or abandoned mid-epoch (its remaining batches were never seen); once an epoch is
        exhausted they point at the start of the next one. The format is
        ``beton_wire.loader_state`` (shared with ``beton_client.Loader``: a state from either
        resumes the other).
        """
        pos = self._position
        if pos is not None and pos[1] < len(self):
            epoch, batch = pos
        else:
            epoch, batch = self.next_epoch, self._resume_batch
        return make_state(epoch=epoch, batch=batch, identity=self._state_identity())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` at the next ``iter(loader)``.

        Accepts the states of both Loaders (``beton_wire.loader_state``: version 2, version 1
        and version-less dicts).

        Raises:
            SpecError: an unknown version, or the state comes from a Loader with other
                arguments (the message names the one that differs).
        """
        try:
            epoch, batch = check_state(state, self._state_identity())
        except StateError as exc:
            raise SpecError(str(exc)) from None
        self.next_epoch, self._resume_batch = epoch, batch
        self._position = None

    def _state_identity(self) -> StateIdentity:
        """What a state must match (cached: the indices digest hashes every id once)."""
        if self._identity is None:
            order = self.order
            name = (
                order.name
                if isinstance(order, OrderOption)
                else f"{type(order).__module__}.{type(order).__qualname__}"
            )
            self._identity = StateIdentity(
                seed=self.seed,
                order=name,
                batch_size=self.batch_size,
                drop_last=self.drop_last,
                distributed=self.distributed,
                rank=self.rank,
                world_size=self.world_size,
                num_samples=samples_per_rank(
                    len(self.indices), distributed=self.distributed, world_size=self.world_size
                ),
                indices=indices_digest(self._subset),
                len=len(self),
            )
        return self._identity

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
            self.reader, only, batch_size=self.batch_size, sample_check=self._sample_check
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
            self._custom_fields,
            self.drop_last,
            self.batches_ahead,
            self.recompile,
            order_kwargs=self._order_kwargs,
            engine=self._engine,
            bad_sample_budget=self._source.bad_sample_budget,
            verify_checksums=self.verify_checksums,
        )

    def close(self) -> None:
        """Stop the current iterator and close the file (if the Loader opened it)."""
        it = self._current() if self._current is not None else None
        if it is not None:
            it.close()
        if self._owns_reader:
            self.reader.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Running:
    """What an iterator must release; held by its finalizer, so it never references the iterator."""

    def __init__(self, engine: Engine, owns_engine: bool) -> None:
        self.engine = engine
        self.owns_engine = owns_engine
        self.futures: collections.deque[Future[Any]] = collections.deque()

    def release(self) -> None:
        for fut in self.futures:
            for task in getattr(fut, "tasks", ()):
                task.future.cancel()
        for fut in self.futures:
            try:
                fut.exception(timeout=self.engine.join_timeout)
            except (FutureTimeout, Exception):  # only waiting for completion; errors were raised
                pass
        self.futures.clear()
        if self.owns_engine:
            self.engine.close()


class EpochIterator:
    """Iterates one epoch of a :class:`Loader` (see the module docstring for lifetimes)."""

    def __init__(self, loader: Loader, epoch: int, start: int) -> None:
        self.loader = loader
        self.epoch = epoch
        self.batch = start
        self.finished = False
        self._end = len(loader)
        # Everything that may raise comes before the engine, whose worker threads only
        # ``_Running.release`` stops (a tail that cannot be built leaked them, issue 12 §3).
        self._tail = loader.plan.make_tail()
        self._source = loader._source
        self._slots: list[list[np.ndarray]] = loader._slots or []
        self._keys = self._source.seed_keys(epoch)
        owns = loader._engine is None
        engine = loader._engine if loader._engine is not None else Engine(loader.num_workers)
        loader._source.engine = engine
        self._running = _Running(engine, owns)
        self._finalizer = weakref.finalize(self, self._running.release)
        self._next_submit = start
        for _ in range(loader.batches_ahead):
            self._submit_one()

    def _submit_one(self) -> None:
        b = self._next_submit
        if b >= self._end:
            return
        slot = self._slots[b % len(self._slots)]
        waited = b == self.batch  # the consumer needs this one next: split it across workers
        fut = self._source.submit(
            self.epoch, b, slot, priority=0 if waited else 1, slices=None if waited else 1
        )
        self._running.futures.append(fut)
        self._next_submit += 1

    def __iter__(self) -> EpochIterator:
        return self

    def __len__(self) -> int:
        return self._end

    def __next__(self) -> tuple[Any, ...]:
        if self.finished or self.batch >= self._end:
            self.close()
            raise StopIteration
        fut = self._running.futures.popleft()
        BatchSource.promote(fut)
        try:
            arrays = fut.result(timeout=self.loader.batch_timeout)
        except FutureTimeout:
            self.close()
            raise PipelineError(
                f"batch {self.batch} of epoch {self.epoch} did not arrive within "
                f"{self.loader.batch_timeout} s; a worker may be stuck in an op "
                "(raise batch_timeout if batches are legitimately this slow)"
            ) from None
        except BaseException:
            self.close()
            raise
        b = self.batch
        self._submit_one()
        ids = delivered_ids(fut, self._source.batch_ids(self.epoch, b))
        out = self._tail(arrays, ids, self._keys)
        self.loader.last_sample_ids = ids
        self.batch = b + 1
        self.loader._position = (self.epoch, self.batch)
        return out

    def close(self) -> None:
        """Cancel queued batches, wait for running ones, stop owned workers (idempotent)."""
        self.finished = True
        self._finalizer()
