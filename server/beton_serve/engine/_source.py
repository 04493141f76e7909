"""``BatchSource``: one stream's batches as units of work on the shared :class:`Engine`.

A source knows its order (sample ids of batch ``b`` of epoch ``e`` are a pure function of its
configuration, see :mod:`beton_serve.engine.orders`), its plan, and how many batches it may have
in flight (its credit, ``batches_ahead``). ``submit(epoch, b, out)`` runs the plan's jit prefix
for that batch on a worker and writes the outputs into ``out``.

Units of work: a whole batch, or, when ``slices > 1`` and every op works per sample
(``plan.sliceable``), that many contiguous slices run by different workers. Every random draw is
a function of (seed, epoch, sample id, op position), so results do not depend on the split.

Bad samples. When a batch fails, each of its samples is re-run alone to find the culprits. With
``bad_sample_budget = 0`` (default) the first one raises :class:`PipelineError` naming the sample
id and the op. Otherwise failing samples are *skipped*: each is replaced, in place, by the next
good sample of the same batch (cyclically, searched over the whole batch even when it runs as
slices, so the result does not depend on the split), so the batch keeps its size and layout; it is
then re-run, and its future carries what it skipped (``BatchFuture.bad``).

The budget is charged in batch order, not in the order batches finish: the worker that skips a
sample only records it on the batch's future, and the batch's in-order consumer (the in-process
Loader's feed, the daemon's ``Stream.finish``) charges it with :meth:`BatchSource.charge` when it
delivers the batch, which records the ids in :attr:`BatchSource.bad_samples` or raises. So the
batch that exhausts the budget, and the sample its error names, are the same in every run and in
every Loader, however many batches were decoded at once and whichever finished first; and a
batch decoded ahead and never delivered (a discarded look-ahead) charges nothing.

The ids always match the data: the future ``submit`` returns carries ``sample_ids``, the ids the
batch *holds* (the replacement's id where a sample was skipped, so that id appears twice in the
batch), and every consumer publishes those (read them with :func:`delivered_ids`), never the
order's ids. The budget is per epoch: once more than ``bad_sample_budget`` distinct samples of
one epoch have failed, or when every sample of a batch fails, the error is raised. A sample that
fails again in the same epoch (its batch decoded twice, e.g. a look-ahead discarded and redone)
counts once.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, NamedTuple

import numpy as np
from beton_wire.loader_state import batch_rows
from numpy.typing import NDArray

from beton_serve.engine._decode_groups import bind_decode_groups, unbind
from beton_serve.engine._future import BatchFuture, SourceCaps, ids_or
from beton_serve.engine._pool import Engine
from beton_serve.engine.orders import (
    OrderConfig,
    OrderOption,
    TraversalOrder,
    epoch_length,
    make_order,
)
from beton_serve.errors import PipelineError, SpecError, without_traceback
from beton_serve.fields.decode_cache import decode_scope
from beton_serve.pipeline import OpFailure, Plan

__all__ = ["BatchSource", "BadSample", "FoundBad", "delivered_ids"]


def delivered_ids(fut: Future[Any], order_ids: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """The sample ids the completed batch ``fut`` holds (see the module docstring): its
    ``sample_ids`` when the source set them (a skipped sample replaced), else ``order_ids``."""
    return ids_or(fut, order_ids)


def _forget_tasks(fut: Future[Any]) -> None:
    """Empty a finished future's ``tasks`` (only :meth:`BatchSource.promote` reads them): a task
    refers to its future, so the pair would be a reference cycle that keeps the batch's
    arrays, often views of a stream's shared-memory ring, alive until the garbage collector
    runs (issue 11). The list is emptied in place: copies of the future (sharing) hold it too."""
    if isinstance(fut, BatchFuture):
        fut.tasks.clear()


class BadSample(NamedTuple):
    """A sample skipped under the bad-sample budget."""

    epoch: int
    sample_id: int
    op: str


class FoundBad(NamedTuple):
    """A failing sample a batch skipped, not yet charged (``BatchFuture.bad``)."""

    sample_id: int
    op: str
    #: What the op raised, without its tracebacks, its causes' included (the worker's frames
    #: hold batch buffers).
    cause: BaseException


class BatchSource:
    """One stream: order + plan + credit over a shared engine (see the module docstring).

    Args:
        engine: the worker pool.
        plan: from ``compile_pipelines``; its ``batch_size`` must hold the largest batch,
            ``batch_rows(batch_size, samples in epoch 0)``.
        order: an :class:`OrderOption` or a :class:`TraversalOrder` instance.
        batch_size, seed, indices, drop_last, distributed, rank, world_size: as in FFCV's Loader
            (``indices=None`` means every sample of the plan's reader).
        batches_ahead: the credit; :meth:`submit` blocks while this many batches are in flight.
        bad_sample_budget: how many distinct failing samples each epoch may skip, charged in
            batch order as batches are delivered (:meth:`charge`; module docstring).
        slices: split each batch into this many units of work when the plan allows it.
    """

    def __init__(
        self,
        *,
        engine: Engine,
        plan: Plan,
        order: OrderOption | TraversalOrder = OrderOption.SEQUENTIAL,
        batch_size: int,
        seed: int = 0,
        indices: Sequence[int] | NDArray[Any] | None = None,
        drop_last: bool = True,
        distributed: bool = False,
        rank: int = 0,
        world_size: int = 1,
        batches_ahead: int = 3,
        bad_sample_budget: int = 0,
        slices: int = 1,
    ) -> None:
        if batches_ahead < 1:
            raise SpecError(f"batches_ahead must be >= 1, got {batches_ahead}")
        if bad_sample_budget < 0 or slices < 1:
            raise SpecError("bad_sample_budget must be >= 0 and slices >= 1")
        reader = plan.reader
        if indices is None:
            idx = np.arange(reader.num_samples, dtype=np.uint64)
        else:
            idx = np.asarray(indices)
            if idx.ndim != 1 or (idx.size and (idx.min() < 0 or idx.max() >= reader.num_samples)):
                raise SpecError(
                    f"indices must be a 1-D list of sample ids in [0, {reader.num_samples})"
                )
            idx = idx.astype(np.uint64)
        if order is OrderOption.QUASI_RANDOM and not len(idx):
            raise SpecError("QUASI_RANDOM needs at least one sample")
        self.engine = engine
        self.plan = plan
        self.order = order
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.batches_ahead = int(batches_ahead)
        self.bad_sample_budget = int(bad_sample_budget)
        self.slices = int(slices)
        self.config = OrderConfig(
            indices=idx,
            seed=self.seed,
            batch_size=self.batch_size,
            distributed=distributed,
            rank=rank,
            world_size=world_size,
            sample_pages=getattr(reader, "sample_pages", None)
            if order is OrderOption.QUASI_RANDOM
            else None,
        )
        self.bad_samples: list[BadSample] = []
        #: Called on the worker before each unit of work; may raise to fail the batch (the
        #: daemon checks that the dataset's files did not shrink under the mmap, see
        #: ``beton_serve.daemon._health``).
        self.pre_run: Callable[[], None] | None = None
        #: The reader's ``check_mapping`` (real readers guard their mapping against SIGBUS).
        self._mapping_check: Callable[[], None] | None = getattr(reader, "check_mapping", None)
        self._lock = threading.Lock()
        self._credit = threading.BoundedSemaphore(self.batches_ahead)
        self._orders: OrderedDict[int, NDArray[np.uint64]] = OrderedDict()
        self._keys: OrderedDict[int, NDArray[np.uint64]] = OrderedDict()
        ordered = len(self.sample_order(0))
        self._len = epoch_length(ordered, self.batch_size, self.drop_last)
        rows = batch_rows(self.batch_size, ordered)
        if rows > plan.batch_size:
            raise SpecError(
                f"batches of {rows} samples (batch_size {self.batch_size}) exceed the plan's "
                f"batch_size {plan.batch_size}"
            )
        #: Issue 16: the decode groups of its ``share_decode`` decoders (None: decodes alone).
        self.decode_binding = bind_decode_groups(self)
        # The plan keeps its batch workspaces while a source runs it: until close(), or until
        # the source is collected (the in-process Loader never closes its sources). Last, so
        # that a source whose construction failed holds nothing.
        self._unhold: weakref.finalize[Any, Any] | None = None
        hold, unhold = getattr(plan, "hold", None), getattr(plan, "unhold", None)
        if hold is not None and unhold is not None:
            hold()
            self._unhold = weakref.finalize(self, unhold)
            self._unhold.atexit = False

    def close(self) -> None:
        """Leave its decode groups now instead of when collected (issue 16), and let the plan
        free its batch workspaces if no other open source runs it (``Plan.unhold``).
        Idempotent; the source stays usable and decodes alone from then on (allocating its
        workspaces per batch if the plan is no longer held)."""
        unbind(self.decode_binding)
        if self._unhold is not None:
            self._unhold()  # a finalizer: runs once

    # -- order ---------------------------------------------------------------------------
    def sample_order(self, epoch: int) -> NDArray[np.uint64]:
        """The sample ids this rank visits in ``epoch`` (cached for the two latest epochs)."""
        with self._lock:
            hit = self._orders.get(epoch)
        if hit is not None:
            return hit
        ids = make_order(self.order, self.config, epoch)
        with self._lock:
            self._orders[epoch] = ids
            while len(self._orders) > 2:
                self._orders.popitem(last=False)
        return ids

    def __len__(self) -> int:
        """Batches per epoch (FFCV: computed from epoch 0's order)."""
        return self._len

    def batch_ids(self, epoch: int, b: int) -> NDArray[np.uint64]:
        """Sample ids of batch ``b`` of ``epoch`` (``uint64``, C-contiguous)."""
        if not 0 <= b < self._len:
            raise IndexError(f"batch {b} out of range: the epoch has {self._len} batches")
        order = self.sample_order(epoch)
        return np.ascontiguousarray(order[b * self.batch_size : (b + 1) * self.batch_size])

    def seed_keys(self, epoch: int) -> NDArray[np.uint64]:
        with self._lock:
            hit = self._keys.get(epoch)
        if hit is not None:
            return hit
        keys = self.plan.seed_keys(self.seed, epoch)
        with self._lock:
            self._keys[epoch] = keys
            while len(self._keys) > 2:
                self._keys.popitem(last=False)
        return keys

    # -- running -------------------------------------------------------------------------
    def submit(
        self,
        epoch: int,
        b: int,
        out: list[np.ndarray] | None = None,
        priority: int = 1,
        *,
        timeout: float | None = None,
        slices: int | None = None,
        by_reference: bool = False,
    ) -> BatchFuture:
        """Run batch ``b`` of ``epoch`` on the engine.

        Blocks while ``batches_ahead`` batches of this source are in flight (the credit comes
        back when a batch completes); ``timeout`` bounds the wait (``TimeoutError``).

        Args:
            out: one destination per plan output, each ``(>= n, *shape)`` of the output's dtype;
                the caller owns them and must not touch them until the future completes.
                ``None`` allocates new arrays.
            priority: 0 when a consumer is waiting for this batch, else 1.
            slices: units of work for this batch (default: the source's ``slices``). Slicing
                lowers one batch's latency; whole batches cost less per image, so prefetch work
                is best left whole.
            by_reference: accepted for the source protocol; a plain source always writes
                into ``out`` (its :attr:`caps` say so).

        Returns:
            A future of ``[out[i][:n] for each output]``; its exception is a
            :class:`PipelineError` (with ``sample_index`` and ``op`` when known), or
            ``CancelledError`` if the engine was closed before the batch ran.
        """
        fut = self._submit(epoch, b, out, priority, timeout, slices)
        if b == self._len - 1:
            self._prepare_epoch(epoch + 1)
        return fut

    def _prepare_epoch(self, epoch: int) -> None:
        """Compute ``epoch``'s order and seed keys now, once the current epoch's last batch is
        queued, so that they are ready (cached) when it starts: on 50,000 samples they took
        ~0.6 ms of a new epoch's start, while the workers were idle (issue 15 §3). Only for the
        built-in orders, pure functions of the epoch: a custom ``TraversalOrder`` may read state
        its user sets between epochs. Nothing it raises may reach ``submit``'s caller, whose
        batch is already queued: an error is left for the epoch's own start to raise."""
        if not isinstance(self.order, OrderOption):
            return
        try:
            self.sample_order(epoch)
            self.seed_keys(epoch)
        except Exception:  # an optimisation only; computed (and raised) again at its start
            pass

    def _submit(
        self,
        epoch: int,
        b: int,
        out: list[np.ndarray] | None,
        priority: int,
        timeout: float | None,
        slices: int | None,
    ) -> BatchFuture:
        ids = self.batch_ids(epoch, b)
        n = len(ids)
        if self.decode_binding is not None:  # issue 16: a stream that runs batches is held for
            self.decode_binding.activate()
        # What the batch will hold: the order's ids, patched by _run where a sample is skipped.
        held = ids.copy()
        found: list[FoundBad] = []  # what the batch skips (BatchFuture.bad), filled by _run
        if out is None:
            out = [np.empty((n, *o.shape), o.dtype) for o in self.plan.outputs]
        if not self._credit.acquire(timeout=timeout):
            raise TimeoutError(
                f"no credit within {timeout} s: {self.batches_ahead} batches in flight"
            )
        keys = self.seed_keys(epoch)
        want = self.slices if slices is None else int(slices)
        parts = want if (want > 1 and self.plan.sliceable and n >= 2 * want) else 1
        if parts == 1:  # the common case: the task's own future is the batch's future
            task = self.engine.submit(
                self._run, epoch, ids, 0, n, out, keys, held, found, priority=priority, owner=self
            )
            task.future.tasks.append(task)
            task.future.add_done_callback(_forget_tasks)
            task.future.sample_ids = held
            task.future.bad = found
            task.future.add_done_callback(lambda _f: self._credit.release())
            return task.future
        result = BatchFuture()
        result.set_running_or_notify_cancel()
        result.add_done_callback(lambda _f: self._credit.release())
        result.sample_ids = held
        result.bad = found
        bounds = np.linspace(0, n, parts + 1).astype(int)
        pending = [parts]
        errors: list[tuple[int, BaseException]] = []
        tasks = []

        def done(f: Future[Any], part: int) -> None:
            exc = f.exception() if not f.cancelled() else PipelineError("batch cancelled")
            with self._lock:
                if exc is not None:
                    errors.append((part, exc))
                pending[0] -= 1
                last = pending[0] == 0
            if last:
                if errors:
                    # The first part's error, not the first to finish: a batch with bad samples
                    # in two parts names the first of them, as the same batch run whole does,
                    # whichever worker got there first (found by the corrupt-JPEG fuzz).
                    result.set_exception(min(errors, key=lambda e: e[0])[1])
                else:
                    result.set_result([o[:n] for o in out])

        for s in range(parts):
            lo, hi = int(bounds[s]), int(bounds[s + 1])
            task = self.engine.submit(
                self._run,
                epoch,
                ids,
                lo,
                hi,
                [o[lo:hi] for o in out],
                keys,
                held,
                found,
                priority=priority,
                owner=self,
            )
            tasks.append(task)
            task.future.add_done_callback(functools.partial(done, part=s))
        result.tasks = tasks
        result.add_done_callback(_forget_tasks)
        return result

    @property
    def caps(self) -> SourceCaps:
        """Never by reference; looks ahead (the budget is charged at delivery, so a batch
        decoded ahead charges nothing until it is delivered)."""
        return SourceCaps(by_reference=False, look_ahead=True)

    def skipped(self) -> list[BadSample]:
        """The samples skipped and charged to the bad-sample budget so far, oldest first."""
        return self.bad_samples

    def charge(self, epoch: int, fut: Future[Any]) -> None:
        """Charge the samples that batch ``fut`` of ``epoch`` skipped to the budget; its
        in-order consumer calls this as it delivers the batch, after it completed (module
        docstring). A sample already charged in this epoch counts once.

        Raises:
            PipelineError: the epoch's distinct bad samples now exceed the budget; it names the
                batch's first bad sample, and nothing is recorded.
        """
        found = fut.bad if isinstance(fut, BatchFuture) else None
        if not found:
            return
        with self._lock:
            seen = {x.sample_id for x in self.bad_samples if x.epoch == epoch}
            new: dict[int, str] = {}
            for f in found:
                if f.sample_id not in seen:
                    new.setdefault(f.sample_id, f.op)
            over = len(seen) + len(new) > self.bad_sample_budget
            if not over:
                self.bad_samples.extend(BadSample(epoch, i, op) for i, op in new.items())
        if over:
            first = found[0]
            raise PipelineError(
                f"{type(first.cause).__name__}: {first.cause} "
                f"(bad-sample budget {self.bad_sample_budget} exhausted)",
                sample_index=first.sample_id,
                op=first.op,
            ) from first.cause

    @staticmethod
    def promote(fut: Future[Any]) -> None:
        """Move a submitted batch ahead of prefetch work (its consumer is now waiting)."""
        if isinstance(fut, BatchFuture):
            for task in fut.tasks:
                task.promote()

    def _run(
        self,
        epoch: int,
        batch: NDArray[np.uint64],
        lo: int,
        hi: int,
        outs: list[np.ndarray],
        keys: NDArray[np.uint64],
        held: NDArray[np.uint64] | None = None,
        found: list[FoundBad] | None = None,
    ) -> list[np.ndarray]:
        binding = self.decode_binding
        try:
            if binding is None:
                out = self._run_plan(batch, lo, hi, outs, keys, held, found)
            else:
                with decode_scope(binding, epoch):  # issue 16: its decode groups
                    out = self._run_plan(batch, lo, hi, outs, keys, held, found)
        except BaseException:
            # Zeros read from a file truncated under its mapping can make a decode fail: then
            # the file is at fault, not a sample (no bad-sample skip can make that batch good).
            self._check_mapping()
            raise
        self._check_mapping()
        return out

    def _check_mapping(self) -> None:
        """Raise ``FormatError`` if the batch read pages past the end of a file truncated while
        mapped: they read as zeros instead of killing the process (``format._guard``)."""
        check = self._mapping_check
        if check is not None:
            check()

    def _run_plan(
        self,
        batch: NDArray[np.uint64],
        lo: int,
        hi: int,
        outs: list[np.ndarray],
        keys: NDArray[np.uint64],
        held: NDArray[np.uint64] | None,
        found: list[FoundBad] | None,
    ) -> list[np.ndarray]:
        plan = self.plan
        ids = batch[lo:hi]
        if self.pre_run is not None:
            self.pre_run()
        ws = plan.acquire_workspace()
        try:
            try:
                return plan.run(ws, ids, keys, outs)
            except OpFailure as failure:
                if type(failure.cause).__module__.startswith("numba"):
                    # A compile (typing) error, not a bad sample: every sample would fail alike.
                    first = str(failure.cause).strip().splitlines()[0]
                    raise PipelineError(
                        f"numba could not compile this op ({type(failure.cause).__name__}: "
                        f"{first}); ops before ToTensor() run as Numba nopython code: move an op "
                        "that uses torch or Python objects after ToTensor(), or mark its "
                        "function python = True",
                        op=failure.node.name,
                    ) from failure.cause
                fixed = self._skip_bad(ws, batch, lo, hi, keys, failure, found)
                if held is not None:  # the ids the consumer publishes (module docstring)
                    held[lo:hi] = fixed
                try:
                    return plan.run(ws, fixed, keys, outs)
                except OpFailure as again:
                    raise PipelineError(
                        f"batch failed after skipping bad samples: {again.cause!r}",
                        op=again.node.name,
                    ) from again.cause
        finally:
            plan.release_workspace(ws)

    def _skip_bad(
        self,
        ws: Any,
        batch: NDArray[np.uint64],
        lo: int,
        hi: int,
        keys: NDArray[np.uint64],
        failure: OpFailure,
        found: list[FoundBad] | None,
    ) -> NDArray[np.uint64]:
        """Sample ids for ``batch[lo:hi]`` with failing samples replaced (module docstring), the
        batch's failing samples appended to ``found`` for its consumer to charge.

        The failing samples are looked for in the whole batch, not only in the slice, and every
        slice of a split batch finds the same ones (recorded once), so neither the
        replacements, nor what is charged, nor the sample an error names depends on how the
        batch was split or on which part failed first.

        Raises:
            PipelineError: without a budget, naming the batch's first failing sample; or every
                sample of the batch fails; or only this slice fails as a whole.
        """
        # Each sample's failure is kept in ``failed`` only, emptied at the end: its traceback
        # reaches this call's frame (its frames' callers: ``check``, then this one), so a
        # failure held by a local here would make a reference cycle that keeps the batch's
        # buffers until a collection.
        failed: dict[int, OpFailure] = {}
        passed: set[int] = set()

        def check(pos: int) -> bool:
            """Whether sample ``pos`` of the batch fails on its own (run once per sample)."""
            if pos not in failed and pos not in passed:
                try:
                    self.plan.run(ws, batch[pos : pos + 1], keys, None)
                    passed.add(pos)
                except OpFailure as f:
                    failed[pos] = f
            return pos in failed

        try:
            n = len(batch)
            bad = [i for i in range(n) if check(i)]
            if not any(lo <= i < hi for i in bad):  # only the slice fails: not a sample's fault
                raise PipelineError(f"{failure.cause!r}", op=failure.node.name) from failure.cause
            all_bad = len(bad) == n
            if all_bad or not self.bad_sample_budget:
                why = (
                    "every sample of the batch failed"
                    if all_bad
                    else "raise bad_sample_budget to skip failing samples"
                )
                raise PipelineError(
                    f"{type(failed[bad[0]].cause).__name__}: {failed[bad[0]].cause} ({why})",
                    sample_index=int(batch[bad[0]]),
                    op=failed[bad[0]].node.name,
                ) from failed[bad[0]].cause
            fixed = batch[lo:hi].copy()
            for i in bad:
                if lo <= i < hi:
                    repl = next(j % n for j in range(i + 1, i + n) if not check(j % n))
                    fixed[i - lo] = batch[repl]
            if found is not None:
                with self._lock:
                    if not found:  # the first slice of a split batch to get here records them
                        # Causes kept with the batch lose their chains' tracebacks: those
                        # frames' callers include this call, which holds the batch's buffers.
                        found.extend(
                            FoundBad(
                                int(batch[i]),
                                failed[i].node.name,
                                without_traceback(failed[i].cause),
                            )
                            for i in bad
                        )
            return fixed
        finally:
            failed.clear()
