"""The shared worker pool: nogil threads fed by one priority queue.

Data structure: a heap of ``(priority, sequence, task)`` (:class:`_Scheduler`). Lower
priorities run first; ``sequence`` keeps FIFO order within a priority. Priority 0 means a
consumer is blocked on this task right now; prefetch work uses 1. A queued task can be promoted
to 0 (:meth:`Task.promote`): a second entry is queued and whichever entry a worker pops first
runs the task, the other is skipped.

Fair share between owners: a task may name its *owner* (a batch source: one Loader or one
daemon stream). While several owners have work queued or running, an owner already running
``ceil(num_workers / owners)`` tasks is passed over for another owner's task, whatever the
priorities. Without it, a stream whose batches are slow (a custom op of a second per sample)
held every worker, and each batch of a fast client waited for one of its batches to end (a
running Numba kernel cannot be interrupted): a plain client took 15-97 s for 8 tiny batches.
The pool stays work-conserving: when every queued task belongs to an owner at its share, the
best of them runs anyway, so a single Loader or stream still gets every worker.

Why threads, not processes (DESIGN.md §5.1, measured in ``benchmarks/bench_engine_scaling.py``
and recorded in ``benchmarks/RESULTS.md``): every op runs either as Numba ``nogil`` code or as a
decoder call that releases the GIL (simplejpeg, cv2), so threads scale like processes while
writing straight into the destination buffers, with no pickling and no second copy.

Lifecycle: workers are named ``beton-worker-N``. A task that raises an ``Exception`` fails its
future only. A task that raises a ``BaseException`` (``SystemExit``, ``KeyboardInterrupt``, a
simulated worker crash) ends its worker thread; the pool logs it, starts a replacement and
**re-queues the task** at priority 0 so that its batch is redone, not lost (tasks are pure
functions of their arguments, so a re-run writes the same result). A task that kills
``max_task_retries + 1`` workers is a poison task: its future fails with ``PipelineError``. :meth:`Engine.close` cancels
queued tasks, wakes every worker, joins each with a timeout and logs any that did not stop.

Fork: a child process has none of its parent's threads. After a fork every engine the child
inherited is marked closed there (:func:`_after_fork_in_child`), with fresh locks and queue
(a parent thread may have held them at the fork), so that using one raises "the engine is
closed" instead of queueing work no thread will run; the in-process Loader then makes itself a
new one.

Exit: the workers are daemon threads, so a process that leaves a Loader mid-epoch still exits.
At exit every engine still open is closed (:func:`_close_all_at_exit`) *before* the
interpreter's exit finalizers (``weakref.finalize``) run: those free TurboJPEG handles and
unmap dataset files, and a worker still decoding into them crashed the process (SIGSEGV or
``free(): invalid pointer`` at exit, about one exit in two mid-epoch).

Memory: a task's arguments are often views of a stream's shared-memory ring. Once its future is
resolved the task drops them, a worker keeps no reference to the last task it ran, and a failed
task's traceback keeps no frame locals, so that a ring is unmapped as soon as its stream and the
batch's consumer let go, by reference counting rather than at the next garbage collection
(issue 11).

Prefetch width: a consumer (a Loader's epoch, a daemon stream) keeps a few batches in flight and
registers that count as its *demand* (:meth:`Engine.hold_demand`). A prefetched batch runs as
:meth:`Engine.prefetch_slices` units of work, ``ceil(num_workers / total demand)``, so that the
in-flight batches of the consumers present fill every worker: a single Loader with 4 batches
in flight (``batches_ahead=3``) on 16 workers splits each prefetched batch into 4, while 2
workers keep whole batches (cheaper per image). The registry is a ``deque`` of ints: ``append``, ``remove`` and ``sum``
over it run in C without releasing the GIL, so it needs no lock, and a consumer's finalizer may
drop its demand while another thread is inside :meth:`Engine.submit` holding ``_lock``.
The end of an epoch: the in-process Loader starts nothing of the next epoch before its
consumer does, so the last batches run in more parts (:meth:`Engine.tail_slices`) and the
workers finish the epoch together instead of one ending it alone.
"""

from __future__ import annotations

import atexit
import contextlib
import heapq
import itertools
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import InvalidStateError
from typing import Any

from beton_wire.limits import usable_cpus, workers_out_of_range

from beton_serve.engine._future import BatchFuture
from beton_serve.errors import (
    BetonError,
    PipelineError,
    ResourceExhausted,
    SpecError,
    drop_frame_locals,
)

__all__ = ["Demand", "Engine", "Task"]

_log = logging.getLogger(__name__)

#: The mean task time below which :meth:`Engine.tail_slices` keeps whole batches (seconds).
TAIL_MIN_TASK_S = 0.002

#: Sorts after every real priority; tells a worker to exit.
_STOP_PRIORITY = float("inf")


class Task:
    """One unit of work. ``future`` completes with the function's result or exception."""

    __slots__ = (
        "_claimed",
        "_engine",
        "_running",
        "args",
        "deaths",
        "fn",
        "future",
        "owner",
        "seq",
    )

    def __init__(
        self,
        engine: Engine,
        seq: int,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        owner: int | None = None,
    ) -> None:
        self._engine = engine
        self.seq = seq
        self.fn = fn
        self.args = args
        #: ``id()`` of the submitter whose share this task counts in (see the module docstring).
        self.owner = owner
        self.future = BatchFuture()
        self._claimed = False
        self._running = False
        #: Workers this task killed (each death re-queues it, see the module docstring).
        self.deaths = 0

    def claim(self) -> bool:
        """True exactly once per run, for the worker that runs the task (False if cancelled)."""
        with self._engine._lock:
            if self._claimed:
                return False
            self._claimed = True
            if self._running:  # a re-run after a worker died: the future already runs
                return not self.future.done()
            self._running = True
        return self.future.set_running_or_notify_cancel()

    def promote(self) -> None:
        """Run this task before prefetch work if it has not started (a consumer is waiting)."""
        with self._engine._lock:
            if self._claimed or self._engine._closed:
                return
        self._engine._queue.put((0, self.seq, self))

    def __lt__(self, other: Task) -> bool:  # only reached on equal (priority, seq): never
        return self.seq < other.seq


#: A queue entry: ``(priority, sequence, task)``; a ``None`` task (at :data:`_STOP_PRIORITY`)
#: tells a worker to exit.
_Entry = tuple[float, int, Any]


class _Scheduler:
    """The pool's queue: a heap of entries under one lock, popped by the workers with the fair
    share between owners of the module docstring.

    Counts per owner (keyed by ``id``, so that the scheduler keeps no submitter alive): entries
    queued and tasks taken by a worker and not yet :meth:`finished`. An owner with neither is
    dropped, and the owners listed are the ones that share the workers. A promoted task has two
    entries; the one popped second is skipped by its worker, which still calls
    :meth:`finished`, so the counts stay exact.
    """

    __slots__ = ("_heap", "_lock", "_owners", "_ready", "workers")

    def __init__(self, workers: int) -> None:
        self.workers = max(1, int(workers))
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._heap: list[_Entry] = []
        self._owners: dict[int, list[int]] = {}  # id -> [entries queued, tasks running]

    def put(self, entry: _Entry) -> None:
        """Queue ``entry`` and wake one worker."""
        with self._lock:
            heapq.heappush(self._heap, entry)
            owner = None if entry[2] is None else entry[2].owner
            if owner is not None:
                counts = self._owners.get(owner)
                if counts is None:
                    self._owners[owner] = [1, 0]
                else:
                    counts[0] += 1
            self._ready.notify()

    def get(self) -> _Entry:
        """The next entry to run (blocks while the queue is empty)."""
        with self._lock:
            while not self._heap:
                self._ready.wait()
            return self._take()

    def take_all(self) -> list[_Entry]:
        """Every queued entry, in priority order; the queue is left empty."""
        with self._lock:
            entries = sorted(self._heap)
            self._heap = []
            for counts in self._owners.values():
                counts[0] = 0
            self._owners = {k: c for k, c in self._owners.items() if c[1]}
            return entries

    def finished(self, task: Task, busy_s: float, engine: Engine) -> None:
        """``task``, taken by :meth:`get`, is over (run, or skipped); count ``busy_s`` of work
        on ``engine`` (under this lock: one lock per task for both)."""
        with self._lock:
            if busy_s >= 0.0:
                engine.tasks_done += 1
                engine.busy_s += busy_s
            owner = task.owner
            if owner is not None:
                counts = self._owners.get(owner)
                if counts is not None:
                    counts[1] -= 1
                    if counts[1] <= 0 and counts[0] <= 0:
                        del self._owners[owner]

    def qsize(self) -> int:
        """Queued entries (a promoted task counts twice until it runs)."""
        with self._lock:
            return len(self._heap)

    def _take(self) -> _Entry:
        heap = self._heap
        owners = self._owners
        task = heap[0][2]
        index = 0
        if task is not None and task.owner is not None and len(owners) > 1:
            share = -(-self.workers // len(owners))
            if owners[task.owner][1] >= share:
                index = _best_within(heap, owners, share)
        if index == 0:
            entry = heapq.heappop(heap)
        else:
            entry = heap[index]
            last = heap.pop()
            if index < len(heap):
                heap[index] = last
                heapq.heapify(heap)
        task = entry[2]
        if task is not None and task.owner is not None:
            counts = owners[task.owner]
            counts[0] -= 1
            counts[1] += 1
        return entry


def _best_within(heap: list[_Entry], owners: dict[int, list[int]], share: int) -> int:
    """The index of the first entry (priority, then sequence) whose task has no owner or an
    owner running fewer than ``share`` tasks; 0 (the heap's top) when there is none."""
    best = 0
    found: _Entry | None = None
    for i, entry in enumerate(heap):
        task = entry[2]
        if task is not None and task.owner is not None and owners[task.owner][1] >= share:
            continue
        if found is None or entry[:2] < found[:2]:
            best, found = i, entry
    return best


class Demand:
    """A consumer's registered in-flight batches (:meth:`Engine.hold_demand`)."""

    __slots__ = ("_n", "_registry")

    def __init__(self, registry: deque[int], batches: int) -> None:
        self._registry = registry
        self._n: int | None = max(0, int(batches))
        registry.append(self._n)

    def update(self, batches: int) -> None:
        """Change the count (no effect once :meth:`release` ran)."""
        old = self._n
        if old is None:
            return
        new = max(0, int(batches))
        if new != old:
            self._n = new
            self._registry.append(new)
            with contextlib.suppress(ValueError):
                self._registry.remove(old)

    def release(self) -> None:
        """Drop the demand (idempotent)."""
        old, self._n = self._n, None
        if old is not None:
            with contextlib.suppress(ValueError):  # two racing releases: the count is a hint
                self._registry.remove(old)


class Engine:
    """One pool of worker threads shared by every stream (and by Loaders given it).

    Args:
        num_workers: number of threads; ``None`` or ``< 1`` means the CPUs this process may use.
            At most :data:`~beton_wire.limits.MAX_WORKERS`.
        join_timeout: seconds :meth:`close` waits for each worker.
        max_task_retries: re-runs of a task whose worker died before it is failed.

    Raises:
        SpecError: ``num_workers`` is over :data:`~beton_wire.limits.MAX_WORKERS`.
        ResourceExhausted: the system refused a thread (its thread or memory limit); the
            workers already started are stopped first.

    Thread safety: every method may be called from any thread.
    """

    def __init__(
        self,
        num_workers: int | None = None,
        *,
        join_timeout: float = 10.0,
        max_task_retries: int = 1,
    ) -> None:
        if num_workers is None or num_workers < 1:
            num_workers = usable_cpus()
        if message := workers_out_of_range(num_workers, "one per CPU this process may use"):
            raise SpecError(message)
        self.num_workers = int(num_workers)
        self.join_timeout = float(join_timeout)
        self.max_task_retries = max(0, int(max_task_retries))
        self._queue = _Scheduler(self.num_workers)
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._names = itertools.count()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self.tasks_done = 0
        self.workers_replaced = 0
        self.tasks_retried = 0
        #: Seconds workers spent running tasks (utilisation = busy / (wall * num_workers)).
        self.busy_s = 0.0
        #: Batches each consumer keeps in flight (:meth:`hold_demand`); see the module docstring.
        self._demand: deque[int] = deque()
        _live.add(self)
        try:
            for _ in range(self.num_workers):
                self._start_worker()
        except RuntimeError as exc:  # "can't start new thread"
            started = len(self._threads)
            self.close()
            raise ResourceExhausted(
                f"could not start worker thread {started + 1} of {self.num_workers}: {exc} "
                "(the process's thread or memory limit); use fewer workers"
            ) from None
        except BaseException:
            # Ctrl-C: ``Thread.start`` waits for the new thread, and a KeyboardInterrupt breaks
            # that wait with the thread running. Nobody would hold this engine, and its workers
            # (which hold it) would run for ever: tell them to stop.
            self.close(join=False)
            raise

    def _start_worker(self) -> None:
        """Start one worker (listed first, so that it knows itself from its first task on).

        Raises:
            RuntimeError: the system refused the thread (it is not listed then).
        """
        t = threading.Thread(
            target=self._work, name=f"beton-worker-{next(self._names)}", daemon=True
        )
        self._threads.append(t)
        try:
            t.start()
        except RuntimeError:
            self._threads.remove(t)
            raise

    def _work(self) -> None:
        while True:
            priority, _, task = self._queue.get()
            if priority == _STOP_PRIORITY:
                return
            # The task runs in a helper so that nothing of it (arguments, result, traceback)
            # stays referenced from this frame while the worker waits for the next one.
            alive = self._run_task(task)
            del task
            if not alive:
                return

    def _run_task(self, task: Task) -> bool:
        """Run ``task`` if this worker claims it; ``False`` when the worker must exit."""
        if not task.claim():
            self._queue.finished(task, -1.0, self)
            return True
        t0 = time.perf_counter()
        try:
            result = task.fn(*task.args)
        except Exception as exc:
            drop_frame_locals(exc)  # they would keep the task's buffers alive with the error
            task.args = ()
            task.future.set_exception(exc)
        except BaseException as exc:
            # The worker dies with the task; the pool keeps its size and redoes the task.
            self._worker_died(task, exc)
            return False
        else:
            task.args = ()
            task.future.set_result(result)
            del result
        finally:
            self._queue.finished(task, time.perf_counter() - t0, self)
            # A failed task's error keeps this frame (its traceback's first), and the task's
            # future keeps the error: without the task here, that is no reference cycle, and
            # the future is freed as soon as its consumer lets go of it.
            del task
        return True

    def _worker_died(self, task: Task, exc: BaseException) -> None:
        """Replace the current worker; re-queue ``task`` unless it is a poison task.

        When the system refuses the replacement thread, the pool runs on with one worker less;
        when that leaves no worker at all, the engine closes and fails every queued task with
        :class:`ResourceExhausted` (nobody would ever run them).
        """
        name = threading.current_thread().name
        refused: RuntimeError | None = None
        with self._lock:
            closed = self._closed
            task.deaths += 1
            retry = not closed and task.deaths <= self.max_task_retries
            if retry:
                task._claimed = False
                self.tasks_retried += 1
            if not closed:
                self._threads = [t for t in self._threads if t is not threading.current_thread()]
                try:
                    self._start_worker()
                    self.workers_replaced += 1
                except RuntimeError as start_exc:
                    refused = start_exc
                    if not self._threads:
                        self._closed = closed = True
                        retry = False
        if refused is not None:
            _log.error("worker %s died (%r) and could not be replaced: %s", name, exc, refused)
            if closed:  # no worker left: nothing queued will ever run
                err = ResourceExhausted(
                    f"the engine's last worker died ({exc!r}) and the system refused a new "
                    f"thread ({refused}); the engine is closed"
                )
                self._fail_queued(err)
                _fail_future(task.future, err)
                return
        if retry:
            if refused is None:
                _log.error("worker %s died (%r); replaced, and its task re-queued", name, exc)
            self._queue.put((0, task.seq, task))
            return
        if refused is None:
            _log.error("worker %s died (%r); replaced", name, exc)
        if not task.future.done():
            task.future.set_exception(
                PipelineError(
                    f"the task killed {task.deaths} worker(s) ({exc!r}); it is not retried again"
                )
                if not closed
                else exc
            )

    def _fail_queued(self, exc: BaseException | None) -> None:
        """Empty the queue: cancel each queued task's future, or fail it with ``exc`` (a
        re-queued task's future already runs and can no longer be cancelled; ``None``: with a
        ``PipelineError`` saying the engine closed)."""
        for priority, _, task in self._queue.take_all():
            if priority == _STOP_PRIORITY:
                continue
            with self._lock:
                claimed = task._claimed
            if claimed:  # a promoted task's second entry, while a worker runs it: it finishes
                continue
            if exc is None:
                if not task.future.cancel():
                    _fail_future(
                        task.future, PipelineError("the engine closed before the task re-ran")
                    )
            else:
                _fail_future(task.future, exc)

    def submit(
        self, fn: Callable[..., Any], *args: Any, priority: int = 1, owner: object = None
    ) -> Task:
        """Queue ``fn(*args)``; returns the :class:`Task` (its ``future`` holds the result).

        ``owner`` (a batch source, say) is whose share of the workers the task counts in
        (module docstring); ``None``: no one's, the task is never passed over.

        Raises:
            BetonError: the engine is closed.
        """
        key = None if owner is None else id(owner)
        with self._lock:
            if self._closed:
                raise BetonError("the engine is closed; create a new Engine")
            task = Task(self, next(self._seq), fn, args, key)
        self._queue.put((int(priority), task.seq, task))
        return task

    def hold_demand(self, batches: int) -> Demand:
        """Register a consumer that keeps ``batches`` batches in flight; the returned
        :class:`Demand` updates or drops it (idempotent, safe from a finalizer)."""
        return Demand(self._demand, batches)

    def prefetch_slices(self) -> int:
        """Units of work for one prefetched batch: ``ceil(num_workers / total demand)``, at
        least 1 (1 when no consumer registered its demand)."""
        total = sum(self._demand)
        return max(1, -(-self.num_workers // total)) if total > 0 else 1

    def tail_slices(self, left: int) -> int:
        """Units of work for a prefetched batch near the end of its consumer's epoch, where
        ``left`` is how many batches that epoch has left from this one on (this one included).

        With whole batches, the last ones of an epoch run on some workers while the others
        idle, because the in-process Loader starts nothing of the next epoch before its
        consumer does: half a batch per epoch on average, 2-7 % of a 7-batch RandomResizedCrop
        epoch at 2 workers (``benchmarks/RESULTS.md``, session 61). So the last batches run in
        ``ceil(4 * num_workers / left)`` parts, at most ``4 * num_workers``, and the workers
        finish within a small part of a batch of each other.

        Returns 1 (whole batches, as before) on one worker, while other consumers have work for
        the workers, or while the engine's tasks are short (a mean under
        :data:`TAIL_MIN_TASK_S`), where a part's fixed cost outweighs the idle it saves.
        """
        most = 4 * self.num_workers
        # left >= most first: it is every batch but an epoch's last few, and it gives 1 anyway
        if left >= most or left < 1 or self.num_workers < 2 or len(self._demand) > 1:
            return 1
        if self.tasks_done == 0 or self.busy_s < TAIL_MIN_TASK_S * self.tasks_done:
            return 1
        return min(most, -(-most // left))

    @property
    def queue_depth(self) -> int:
        """Queued entries (approximate: a promoted task is counted twice until it runs)."""
        return self._queue.qsize()

    @property
    def alive_workers(self) -> int:
        with self._lock:
            return sum(t.is_alive() for t in self._threads)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (or this process is a fork's child: module docstring)."""
        return self._closed

    def on_worker_thread(self) -> bool:
        """Whether the calling thread is one of this engine's workers (a finalizer that the
        garbage collector runs inside a task, for one, must not wait for tasks)."""
        return threading.current_thread() in self._threads

    def close(self, timeout: float | None = None, *, join: bool = True) -> None:
        """Cancel queued tasks, stop and join every worker (idempotent).

        Tasks already running finish first; each join waits at most ``timeout`` seconds
        (default ``join_timeout``), and a worker still alive after it is logged (it is a daemon
        thread and cannot block interpreter exit). With ``join=False``, or for the calling
        thread when it is a worker, the workers are told to stop and not waited for.
        """
        wait = self.join_timeout if timeout is None else float(timeout)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads = list(self._threads)
        self._fail_queued(None)
        for _ in threads:
            self._queue.put((_STOP_PRIORITY, next(self._seq), None))
        if not join:
            return
        for t in threads:
            if t is threading.current_thread():
                continue
            t.join(wait)
            if t.is_alive():
                _log.warning("worker %s did not stop within %.1f s", t.name, wait)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fail_future(fut: BatchFuture, exc: BaseException) -> None:
    """Complete ``fut`` with ``exc`` unless it is done or cancelled (pending or running)."""
    if fut.done():
        return
    try:
        if not fut.set_running_or_notify_cancel():
            return  # cancelled meanwhile
    except RuntimeError:
        pass  # already running: a task re-queued after its worker died
    with contextlib.suppress(InvalidStateError):  # completed by another thread meanwhile
        fut.set_exception(exc)


#: Every engine not yet closed (closed at exit, see the module docstring).
_live: weakref.WeakSet[Engine] = weakref.WeakSet()
#: Seconds each worker may take to finish its running task at exit.
_EXIT_JOIN_S = 5.0


def _close_all_at_exit() -> None:
    for engine in list(_live):
        engine.close(timeout=_EXIT_JOIN_S)


def _after_fork_in_child() -> None:
    """Mark every inherited engine closed, touching none of its parent-side locks (one of the
    parent's threads may have held them at the fork; they are replaced, not acquired)."""
    for engine in list(_live):
        engine._lock = threading.Lock()
        engine._queue = _Scheduler(engine.num_workers)
        engine._threads = []
        engine._closed = True
    _live.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# atexit runs its handlers last-registered first. weakref.finalize registers its own exit hook
# when the first finalizer of the process is made: making one now, before registering ours,
# puts ours first, whatever was imported before this module.
weakref.finalize(_close_all_at_exit, lambda: None)
atexit.register(_close_all_at_exit)
