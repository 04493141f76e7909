"""The one Loader front end: FFCV's ``Loader`` over a backend that feeds it raw batches.

``beton_client.Loader`` (served: shm, cuda_ipc, grpc) and ``beton_serve.loader.Loader`` (the
in-process engine) are this class with different backends. Everything a user can observe is
implemented here, once (issue 12 §1):

* argument validation (:func:`check_args`): the same rules and words on every backend;
* the pipeline split (``_ops.split_pipelines``): the ops up to ``ToTensor`` go to the backend,
  the rest is the tail;
* the tail (``_tail.OutputTail``): ``ToTensor``, ``ToDevice``, ``ToTorchImage``, ``Convert``,
  torch modules, callables and FFCV Operations after the boundary, seeded by their position in
  the in-process graph;
* ``state_dict`` / ``load_state_dict`` (``beton_wire.loader_state``) and ``last_sample_ids``;
* epochs, abandoned epochs and reconnection (:class:`EpochIterator`).

A backend implements the small typed protocol below: :meth:`Backend.open` opens a
:class:`Feed` for the split pipelines; :meth:`Feed.epoch` starts an epoch at a batch and returns
an :class:`EpochFeed`, whose :meth:`~EpochFeed.next` yields each batch's arrays (one per output,
in the daemon-side layout) with its sample ids, :meth:`~EpochFeed.release` hands the previous
batch's buffers back, and :meth:`~EpochFeed.close` stops early. A backend's errors are its own
error classes (:class:`ErrorKinds`): the in-process Loader raises ``beton_serve.errors``, the
served one ``beton_client.errors``; the messages are the same.

This module imports numpy and ``beton_wire`` only (no grpc, numba, cv2 or torch), so the
in-process Loader can use it without the served client's dependencies.

Threading: a Loader is used from one thread at a time.
"""

from __future__ import annotations

import contextlib
import logging
import numbers
import os
import signal
import sys
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from beton_wire.limits import (
    MAX_BATCH_SIZE,
    MAX_BATCHES_AHEAD,
    MAX_EPOCH,
    MAX_WORLD_SIZE,
    cap_message,
    short_repr,
    workers_out_of_range,
)
from beton_wire.loader_state import (
    StateError,
    StateIdentity,
    check_state,
    indices_digest,
    make_state,
)

from beton_client import _forks
from beton_client import errors as client_errors
from beton_client._gcpause import gc_paused
from beton_client._ops import PipelinePlan, split_pipelines
from beton_client._tail import OutputInfo, OutputTail, build_output_tails

__all__ = [
    "ORDER_NAMES",
    "Backend",
    "EpochFeed",
    "EpochIterator",
    "ErrorKinds",
    "Feed",
    "FrontEnd",
    "LoaderArgs",
    "OutputInfo",
    "PipelinePlan",
    "RawBatch",
    "check_args",
    "gc_paused",
    "pipelines_key",
]

log = logging.getLogger("beton_client")

#: The built-in orders, by FFCV's names (any enum with these names is accepted).
ORDER_NAMES = ("SEQUENTIAL", "RANDOM", "QUASI_RANDOM")
_ORDER_VALUES = {1: "SEQUENTIAL", 2: "RANDOM", 3: "QUASI_RANDOM"}


def is_int(value: object) -> bool:
    """True for Python and numpy integers (not bools)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class ErrorKinds:
    """The error classes a backend's Loader raises (its users catch those)."""

    #: Invalid arguments or pipelines (a ``ValueError``).
    spec: type[Exception]
    #: A batch failed (an op raised).
    pipeline: type[Exception]
    #: The Loader is used after ``close()``.
    closed: type[Exception]


CLIENT_ERRORS = ErrorKinds(
    spec=client_errors.SpecError,
    pipeline=client_errors.PipelineError,
    closed=client_errors.BetonClientError,
)


@dataclass(frozen=True, slots=True)
class RawBatch:
    """One batch as a backend delivers it, before the tail.

    Attributes:
        arrays: one array per output (numpy arrays, or tensors from cuda_ipc), in
            :attr:`Feed.outputs` order; valid until :meth:`EpochFeed.release`.
        ids: the batch's sample ids (dataset ids, ``uint64``, in batch order).
    """

    arrays: Sequence[Any]
    ids: np.ndarray


class EpochFeed(Protocol):
    """The batches of one epoch from one start position, in order."""

    def next(self) -> RawBatch | None:
        """The next batch, or ``None`` after the epoch's last one.

        Raises:
            the backend's errors (a daemon that went away: ``ServerUnavailable``, which the front
            end may answer by reconnecting, see :meth:`Backend.reconnect`).
        """
        ...

    def release(self) -> None:
        """The batch last returned is no longer used: its buffers may be reused (idempotent)."""
        ...

    def close(self) -> None:
        """Stop early: cancel what was requested ahead (idempotent)."""
        ...


class Feed(Protocol):
    """An open stream on a backend: one pipeline set, order and batch size."""

    #: Batches per epoch.
    num_batches: int
    #: Samples this rank visits per epoch (for ``state_dict``).
    num_samples: int
    #: The dataset's files by content (``beton_wire.file_identity.dataset_digest``; ``""`` when
    #: unknown): a state names its dataset by it.
    dataset_digest: str
    #: The most samples one batch holds (``beton_wire.loader_state.batch_rows``): what batch
    #: buffers are sized for.
    batch_rows: int

    @property
    def outputs(self) -> Sequence[OutputInfo]:
        """The outputs before the tail, in tuple order (the same object until they change)."""
        ...

    def accepts(self, plans: Sequence[PipelinePlan]) -> bool:
        """Whether the next epoch of ``plans`` can run on this feed (else it is re-opened)."""
        ...

    def epoch(self, epoch: int, start: int) -> EpochFeed:
        """Start ``epoch`` at batch ``start``."""
        ...

    def close(self) -> None:
        """Free the feed's resources (idempotent)."""
        ...


class Backend(Protocol):
    """What runs the daemon-side pipelines: the in-process engine, or a daemon."""

    #: The Loader's error classes.
    errors: ErrorKinds
    #: Whether a process forked from the one that built the backend may use it (the in-process
    #: engine starts its own workers there; a daemon's stream belongs to one process).
    fork_safe: bool

    def open(self, args: LoaderArgs, plans: Sequence[PipelinePlan]) -> Feed:
        """Open a feed for ``plans`` (the split pipelines) with ``args``.

        Raises:
            the backend's errors (``errors.spec`` for a request it refuses).
        """
        ...

    def retriable(self, err: BaseException) -> bool:
        """Whether ``err`` (raised by a feed, or by :meth:`open`) is worth a :meth:`reconnect`."""
        ...

    def reconnect(
        self,
        err: BaseException,
        args: LoaderArgs,
        plans: Sequence[PipelinePlan],
        num_batches: int | None,
    ) -> Feed:
        """A new feed after ``err`` (retriable) broke the current one, which is closed.

        Raises:
            the backend's errors: the reconnection budget ran out (``err``'s kind), or the new
            feed has another length than ``num_batches`` (the dataset changed).
        """
        ...

    def close(self) -> None:
        """Free what the backend holds beyond its feeds (idempotent)."""
        ...


@dataclass(frozen=True, slots=True)
class LoaderArgs:
    """FFCV's Loader arguments, validated (:func:`check_args`).

    Attributes:
        order: the built-in order's name, or a backend's own order object (in-process custom
            ``TraversalOrder``), unchanged.
        order_name: what a state records: the built-in name, or ``module.qualname``.
        indices: ``None`` (every sample) or the ids as ``uint64``.
    """

    batch_size: int
    num_workers: int
    order: Any
    order_name: str
    distributed: bool
    rank: int
    world_size: int
    seed: int
    indices: np.ndarray | None
    custom_fields: Mapping[str, type]
    drop_last: bool
    batches_ahead: int
    recompile: bool
    copy: bool


def _order(order: Any, spec: type[Exception], custom: type | None) -> tuple[Any, str]:
    """``(order, its state name)``: a built-in by name (any enum of FFCV's names, or its int
    value), or an instance/subclass of the backend's ``custom`` order base class."""
    if is_int(order) and not hasattr(order, "name"):
        name = _ORDER_VALUES.get(int(order))  # type: ignore[call-overload]
        if name is None:
            raise spec(f"order {short_repr(order)} is not an OrderOption value (1, 2 or 3)")
        return name, name
    name = getattr(order, "name", None)
    if isinstance(name, str) and name in ORDER_NAMES and not _is_custom(order, custom):
        return name, name
    if _is_custom(order, custom):
        cls = order if isinstance(order, type) else type(order)
        return order, f"{cls.__module__}.{cls.__qualname__}"
    if custom is None:
        raise spec(
            f"order must be OrderOption.SEQUENTIAL, RANDOM or QUASI_RANDOM, not {order!r} "
            "(custom TraversalOrder classes cannot travel to a daemon)"
        )
    raise spec(f"order must be an OrderOption or a TraversalOrder, not {order!r}")


def _is_custom(order: Any, custom: type | None) -> bool:
    if custom is None:
        return False
    return isinstance(order, custom) or (isinstance(order, type) and issubclass(order, custom))


def rank_world(environ: Mapping[str, str], spec: type[Exception]) -> tuple[int, int]:
    """``(rank, world_size)`` from ``torch.distributed`` when it is initialised (never imported
    here), else ``RANK``/``WORLD_SIZE``."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None:
        try:
            if dist.is_available() and dist.is_initialized():
                return int(dist.get_rank()), int(dist.get_world_size())
        except Exception:
            pass
    if "WORLD_SIZE" not in environ:
        # FFCV raises here (no process group); we go on, but a job whose ranks all forgot
        # init_process_group would read every sample once per rank: say so.
        log.warning(
            "distributed=True, but torch.distributed is not initialised and WORLD_SIZE is not "
            "set: this process reads the whole dataset as rank 0 of 1"
        )
    try:
        return int(environ.get("RANK", "0")), int(environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise spec("RANK and WORLD_SIZE must be integers") from None


def _indices(indices: Any, spec: type[Exception]) -> np.ndarray | None:
    if indices is None:
        return None
    if isinstance(indices, set | frozenset | Mapping):
        raise spec(
            f"indices must be an ordered sequence of sample ids (a list, range or 1-D array), "
            f"not a {type(indices).__name__}: the order of the ids is the order of the epoch"
        )
    if isinstance(indices, Iterator):
        indices = list(indices)  # a generator: read once, here
    arr = np.asarray(indices)
    if arr.ndim > 1:
        raise spec(f"indices must be 1-D, not an array of shape {arr.shape}")
    arr = arr.reshape(-1)
    if arr.dtype.kind == "f" and not isinstance(indices, np.ndarray):
        # [np.uint64(1), 2]: numpy makes float64 of that mix; judge the values themselves
        arr = np.array(list(indices), dtype=object)
    if arr.size == 0:
        raise spec("indices=[] selects no samples; pass indices=None for every sample")
    if arr.dtype.kind not in "iu":
        if arr.dtype.kind != "O":
            raise spec(f"indices must be integer sample ids, not {arr.dtype} values")
        bad = next((i for i in arr.tolist() if not is_int(i)), None)
        if bad is not None:
            raise spec(
                f"indices must be integer sample ids; got {short_repr(bad)} ({type(bad).__name__})"
            )
        if min(arr.tolist()) < 0 or max(arr.tolist()) >= 2**64:
            raise spec("indices must be integer sample ids in [0, 2**64)")
        out = np.array(arr.tolist(), dtype=np.uint64)
    else:
        # Checked before the uint64 cast, which would turn -1 into 2**64-1.
        if arr.dtype.kind == "i" and int(arr.min()) < 0:
            raise spec(f"indices must be integer sample ids >= 0; got {short_repr(int(arr.min()))}")
        out = arr.astype(np.uint64)  # a copy: the caller's array may change later
    out.flags.writeable = False  # the Loader's own ids: ``loader.indices[0] = 7`` raises
    return out


def check_args(
    *,
    batch_size: Any,
    num_workers: Any,
    order: Any,
    distributed: Any,
    seed: Any,
    indices: Any,
    custom_fields: Mapping[str, Any] | None,
    drop_last: Any,
    batches_ahead: Any,
    recompile: Any,
    copy: Any,
    errors: ErrorKinds,
    environ: Mapping[str, str],
    custom_order: type | None = None,
) -> LoaderArgs:
    """Validate FFCV's Loader arguments, with the same rules and messages on every backend.

    Args:
        custom_order: the backend's base class of custom orders (``TraversalOrder`` in
            process); ``None`` when only the built-in orders can run (a daemon).

    Raises:
        errors.spec: an argument is out of range or of the wrong type.
    """
    spec = errors.spec
    for name, value in (("batch_size", batch_size), ("batches_ahead", batches_ahead)):
        if not is_int(value):
            raise spec(f"{name} must be an int, not {short_repr(value)} ({type(value).__name__})")
    if not 1 <= batch_size <= MAX_BATCH_SIZE:
        raise spec(
            f"batch_size {short_repr(batch_size)} is out of range: use an int in "
            f"1..{MAX_BATCH_SIZE} (the daemon also refuses batches larger than its slot "
            "memory allows)"
        )
    if not 1 <= batches_ahead <= MAX_BATCHES_AHEAD:
        raise spec(
            f"batches_ahead {short_repr(batches_ahead)} is out of range: use an int in "
            f"1..{MAX_BATCHES_AHEAD}"
        )
    if seed is not None and (not is_int(seed) or not 0 <= seed < 2**64):
        raise spec(f"seed must be an int in [0, 2**64), not {short_repr(seed)}")
    if not is_int(num_workers):
        raise spec(f"num_workers must be an int, not {short_repr(num_workers)}")
    if message := workers_out_of_range(num_workers, "one per CPU this process may use"):
        raise spec(message)
    order, order_name = _order(order, spec, custom_order)
    distributed = bool(distributed)
    if seed is None:
        # FFCV's rule: a fresh seed, except for distributed RANDOM, where every rank must draw
        # the same permutation. Our distributed QUASI_RANDOM (FFCV has none) needs it too.
        shuffled = order_name in ("RANDOM", "QUASI_RANDOM")
        seed = 0 if (distributed and shuffled) else int(np.random.randint(0, 2**31 - 1))
    rank, world = rank_world(environ, spec) if distributed else (0, 1)
    if not 1 <= world <= MAX_WORLD_SIZE or not 0 <= rank < world:
        raise spec(
            f"rank {rank} / world_size {world} (from torch.distributed or RANK/WORLD_SIZE): need "
            f"1 <= world_size <= {MAX_WORLD_SIZE} and 0 <= rank < world_size"
        )
    fields = dict(custom_fields or {})
    for name, cls in fields.items():
        if not isinstance(cls, type):
            raise spec(
                f"custom_fields[{short_repr(name)}] must be a Field class (FFCV passes the class, "
                f"not an instance), not {short_repr(cls)}"
            )
        if not callable(getattr(cls, "from_binary", None)):  # int, str...: not a Field at all
            raise spec(
                f"custom_fields[{short_repr(name)}] must be a Field class (a subclass of "
                f"beton_serve.fields.Field, with from_binary), not {cls.__qualname__}"
            )
    return LoaderArgs(
        batch_size=int(batch_size),
        num_workers=int(num_workers),
        order=order,
        order_name=order_name,
        distributed=distributed,
        rank=int(rank),
        world_size=int(world),
        seed=int(seed),
        indices=_indices(indices, spec),
        custom_fields=fields,
        drop_last=bool(drop_last),
        batches_ahead=int(batches_ahead),
        recompile=bool(recompile),
        copy=bool(copy),
    )


def pipelines_key(plans: Sequence[PipelinePlan]) -> bytes:
    """What decides whether a daemon's stream can serve the next epoch: every pipeline's
    daemon-side spec and the device (cheap: computed at each ``iter``)."""
    from beton_client._ops import device_of

    spec = [(p.name, p.field, p.skip, p.ops, p.branch_of, p.branch_op) for p in plans]
    return repr((spec, device_of(plans))).encode()


#: Arguments the stream, the plans and ``state_dict()`` were built from. FFCV lets a script
#: assign them and then ignores the new value (so did we): ``loader.indices = subset`` kept
#: training on every sample. Assigning one after construction raises instead.
FIXED_ATTRIBUTES = frozenset(
    {
        "batch_size",
        "num_workers",
        "order",
        "distributed",
        "rank",
        "world_size",
        "seed",
        "drop_last",
        "batches_ahead",
        "recompile",
        "copy",
        "indices",
        "custom_fields",
    }
)


class FrontEnd:
    """FFCV's ``Loader`` over a :class:`Backend` (see the module docstring).

    Subclasses (``beton_client.Loader``, ``beton_serve.loader.Loader``) validate with
    :func:`check_args`, build their backend and call :meth:`_start`.

    Attributes:
        batch_size, num_workers, distributed, rank, world_size, seed, drop_last, batches_ahead,
        recompile, copy: the validated arguments. Read-only once the Loader is built (see
        :data:`FIXED_ATTRIBUTES`): build a new Loader to change one.
        order: the order as given (an ``OrderOption``, or a custom order in process).
        pipelines: FFCV's ``{name: [ops] | PipelineSpec | None}``; changing an op's parameters
            between epochs (``decoder.output_size``) takes effect at the next ``iter``.
        last_sample_ids: the sample ids of the batch last yielded (``uint64``).
        next_epoch: the epoch the next ``iter`` starts.
    """

    _backend: Backend
    _args: LoaderArgs
    #: Set by :meth:`_freeze` at the end of a subclass's ``__init__``.
    _frozen = False

    def __setattr__(self, name: str, value: Any) -> None:
        if name in FIXED_ATTRIBUTES and self._frozen:
            raise AttributeError(
                f"Loader.{name} is fixed when the Loader is built: the stream, the compiled plans "
                f"and state_dict() use the value given then, and a new one would be ignored. "
                f"Build a new Loader with {name}=... instead"
            )
        object.__setattr__(self, name, value)

    def _freeze(self) -> None:
        """Make :data:`FIXED_ATTRIBUTES` read-only (the last step of a subclass's ``__init__``)."""
        self._frozen = True

    def _start(
        self,
        backend: Backend,
        args: LoaderArgs,
        order: Any,
        pipelines: Mapping[str, Any] | None,
    ) -> None:
        """Adopt ``args`` and open the first feed (closing the backend if that fails)."""
        self._backend = backend
        self._errors = backend.errors
        #: The process that built it, and its fork generation (``_forks``).
        self._pid, self._generation = os.getpid(), _forks.generation()
        self._args = args
        self.batch_size = args.batch_size
        self.num_workers = args.num_workers
        self.order = order
        self.distributed = args.distributed
        self.rank, self.world_size = args.rank, args.world_size
        self.seed = args.seed
        self.drop_last = args.drop_last
        self.batches_ahead = args.batches_ahead
        self.recompile = args.recompile
        self.copy = args.copy
        self.custom_fields = dict(args.custom_fields)
        self.pipelines: dict[str, Any] = dict(pipelines or {})
        self.next_epoch = 0
        #: Where ``load_state_dict`` put the next ``iter``: batch ``_resume_batch`` of epoch
        #: ``_resume_epoch``, as long as ``next_epoch`` is still that epoch (a user who sets
        #: ``next_epoch`` to another one starts that epoch from its first batch).
        self._resume_epoch = 0
        self._resume_batch = 0
        #: (epoch, batches yielded) of the latest iterator, even once closed or collected.
        self._position: tuple[int, int] | None = None
        self._indices_digest = indices_digest(args.indices)  # once: it hashes every id
        self._identity: StateIdentity | None = None
        self.last_sample_ids: np.ndarray = np.empty(0, np.uint64)
        self._current: weakref.ref[EpochIterator] | None = None
        #: Held while ``iter()`` or an iterator's ``next()`` runs: a Loader serves one thread
        #: at a time (:data:`_IN_USE`). Re-entrant, so that a hold a Ctrl-C left behind (it can
        #: land between the acquire and the ``try`` that releases it) never locks out the thread
        #: that was interrupted.
        self._busy = threading.RLock()
        self._busy_generation = self._generation
        self._feed: Feed | None = None
        #: Set by :meth:`close`. Without it, no feed means an error lost the last one (a failed
        #: reconnect, a refused re-open): the next ``iter()`` opens one again.
        self._closed = False
        self._len: int | None = None
        self._tails: list[OutputTail] = []
        self._tails_for: Sequence[OutputInfo] | None = None
        try:
            plans = self._split()
            with _sigint_deferred():  # Ctrl-C comes after the stream is open (see there)
                self._feed = backend.open(args, plans)
            self._plans = plans
            self._build_tails(self._feed)
        except BaseException:
            self.close()
            raise

    # -- the split and the tails ---------------------------------------------------------------
    def _split(self) -> list[PipelinePlan]:
        try:
            return split_pipelines(self.pipelines)
        except client_errors.SpecError as exc:
            raise self._as(exc) from None

    def _as(self, exc: client_errors.BetonClientError) -> Exception:
        """``exc`` as this backend's error class (the same message)."""
        kind = (
            self._errors.spec if isinstance(exc, client_errors.SpecError) else self._errors.pipeline
        )
        if isinstance(exc, kind):
            return exc
        return kind(str(exc))

    def _build_tails(self, feed: Feed) -> None:
        outputs = feed.outputs
        if outputs is self._tails_for:
            return
        try:
            self._tails = build_output_tails(outputs, self._plans, feed.batch_rows)
        except client_errors.SpecError as exc:
            raise self._as(exc) from None
        self._tails_for = outputs

    def _feed_or_raise(self) -> Feed:
        if self._feed is None:
            raise self._errors.closed("the Loader is closed")
        return self._feed

    def _usable_feed(self) -> Feed | None:
        """The open feed, or ``None`` when an error lost it (:meth:`_feed_accepting` opens one
        again: the error, if it stands, is raised again rather than "closed")."""
        if self._feed is None and self._closed:
            raise self._errors.closed("the Loader is closed")
        return self._feed

    # -- FFCV surface ----------------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches per epoch (also after :meth:`close`: the last stream's)."""
        feed = self._feed
        if feed is not None:
            self._len = feed.num_batches
        elif self._len is None:
            raise self._errors.closed("the Loader is closed")
        return self._len

    @property
    def reader_outputs(self) -> list[str]:
        """The output names, in the order of the yielded tuples."""
        return [o.name for o in self._feed.outputs] if self._feed is not None else []

    def __iter__(self) -> EpochIterator:
        """Start the next epoch (on a re-opened feed if an op's parameters changed, or the last
        epoch was left early on a feed that cannot drop it).

        The previous epoch's iterator stops: asking it for another batch raises
        ``RuntimeError`` if its epoch was not finished. A Loader yields one epoch at a time, from
        one thread at a time: ``iter()`` while another thread is inside ``next()`` raises
        ``RuntimeError`` too.
        """
        busy = self._take_busy()
        try:
            return self._iter_locked()
        finally:
            busy.release()

    def _take_busy(self) -> Any:
        """Acquire :attr:`_busy` (``RuntimeError`` if another thread holds it). In a forked
        child, a lock that a thread of the parent held when it forked is replaced: that thread
        does not exist here."""
        busy = self._busy
        if busy.acquire(blocking=False):
            return busy
        if self._busy_generation != _forks.generation():
            busy = self._busy = threading.RLock()
            self._busy_generation = _forks.generation()
            busy.acquire()
            return busy
        raise RuntimeError(_IN_USE)

    def _parents(self) -> bool:
        """Whether this is a process forked from the one that built this Loader, and its
        backend's resources stay with that process (``_forks``)."""
        return self._generation != _forks.generation() and not self._backend.fork_safe

    def _check_process(self) -> None:
        """Raise ``RuntimeError`` where the backend is the parent's (:meth:`_parents`)."""
        if self._parents():
            raise RuntimeError(_forked_message(self._pid))

    def _iter_locked(self) -> EpochIterator:
        self._check_process()
        feed = self._usable_feed()
        epoch = self._next_epoch()
        self._stop_current(
            f"when iter() on its Loader started epoch {int(epoch)}: a Loader yields one "
            "epoch at a time (finish or leave an epoch before starting the next, or use "
            "one Loader per consumer)"
        )
        plans = self._split()
        feed = self._feed_accepting(feed, plans)
        self._plans = plans
        start = self._resume_start(epoch)
        it = EpochIterator(self, feed, epoch, start)  # opens nothing yet: see EpochIterator
        ref = weakref.ref(it)
        # The epoch is taken only here, by plain stores that no signal handler can run between
        # (Python runs them at calls and loops): a Ctrl-C anywhere in ``iter()`` leaves the
        # Loader where it was, and the user's next ``iter()`` starts the same epoch, at the same
        # resume position. Opening the epoch's stream (the slow, interruptible part) is the
        # first ``next()``'s, which re-opens it if interrupted.
        self.next_epoch, self._resume_batch = epoch + 1, 0
        self._position = (epoch, start)
        self._current = ref
        return it

    def _stop_current(self, why: str) -> None:
        """Close the latest epoch's iterator; if its epoch was not finished, its next ``next()``
        raises ``RuntimeError`` saying it stopped ``why``."""
        prev = self._current() if self._current is not None else None
        if prev is not None:
            if not prev.done:
                prev.cut_short = (RuntimeError, why)
            prev.close()

    def _feed_accepting(self, feed: Feed | None, plans: Sequence[PipelinePlan]) -> Feed:
        """``feed``, or a re-opened one when it cannot run ``plans`` (an op's parameters
        changed, or its last epoch was left early on a backend that cannot drop it), or when an
        error lost it (``None``)."""
        if feed is not None and feed.accepts(plans):
            return feed
        with _sigint_deferred():  # Ctrl-C comes after the stream is open (see there)
            if feed is not None:
                feed.close()
            self._feed = None
            try:
                feed = self._backend.open(self._args, plans)
            except BaseException as err:
                feed = self._reconnected(err, plans)
            self._feed = feed
        return feed

    def _reconnected(self, err: BaseException, plans: Sequence[PipelinePlan]) -> Feed:
        """The backend's new feed after ``err``; re-raises ``err`` when it is final."""
        if not self._backend.retriable(err):
            try:
                raise err
            finally:
                # The traceback keeps this frame: were ``err`` still one of its locals, the
                # error would hold itself, and through ``self`` the whole Loader (its stream,
                # its buffers), until a full garbage collection.
                del err
        old = self._feed
        want = None
        if old is not None:
            want = old.num_batches
            old.close()
        self._feed = None
        feed = self._backend.reconnect(err, self._args, plans, want)
        self._feed = feed
        self._build_tails(feed)
        return feed

    def state_dict(self) -> dict[str, Any]:
        """Where iteration stands: the epoch and the batches of it already yielded.

        The format is ``beton_wire.loader_state`` (documented there and in docs/migrating-from-ffcv.md), the same on every
        backend: ``{"version", "epoch", "batch"}`` plus what must match for an exact resume
        (seed, order, batch_size, drop_last, distributed settings, samples, an indices digest,
        ``len``). ``epoch`` and ``batch`` count what the latest iterator has *yielded*, also
        after it was closed or abandoned mid-epoch; once an epoch is exhausted they point at the
        start of the next one. Restore it with :meth:`load_state_dict` on a Loader of either
        kind, over any transport, built with the same arguments: the next ``iter`` yields
        exactly the batches that were not yet yielded.
        """
        pos = self._position
        next_epoch = self._next_epoch()
        if pos is not None and pos[1] < len(self) and next_epoch == pos[0] + 1:
            epoch, batch = pos  # the latest epoch, part-way (next_epoch as its iter() left it)
        else:  # what the next iter() starts: also after the user set next_epoch
            epoch = next_epoch
            batch = self._resume_batch if epoch == self._resume_epoch else 0
        return make_state(epoch=epoch, batch=batch, identity=self._state_identity())

    def _next_epoch(self) -> int:
        """``next_epoch``, an attribute a user may set (FFCV's way to resume an epoch), checked."""
        epoch = self.next_epoch
        if not is_int(epoch) or not 0 <= epoch <= MAX_EPOCH:
            raise self._errors.spec(
                f"next_epoch must be an int in 0..{MAX_EPOCH}, not {short_repr(epoch)}"
            )
        return int(epoch)

    def _resume_start(self, epoch: int) -> int:
        """The first batch ``iter()`` yields of ``epoch``: the loaded state's position, when the
        state's epoch is the one starting."""
        start = self._resume_batch
        if start and epoch != self._resume_epoch:
            log.warning(
                "next_epoch was set to %d after load_state_dict() restored epoch %d at batch "
                "%d: epoch %d starts from its first batch",
                epoch,
                self._resume_epoch,
                start,
                epoch,
            )
            start = 0
        return start

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Make the next ``iter(loader)`` continue from ``state`` (see :meth:`state_dict`).

        Accepts version 2, version 1 and version-less states, from any backend.

        An epoch being iterated stops, as at ``iter()``: asking its iterator for another batch
        raises ``RuntimeError`` if its epoch was not finished. (It went on yielding batches of
        the old position, which the resumed epoch then yielded again.)

        Raises:
            SpecError: an unknown version, or the state comes from a Loader with other
                arguments (the message names the one that differs).
            RuntimeError: another thread is inside ``iter()`` or ``next()`` of this Loader.
        """
        try:
            epoch, batch = check_state(state, self._state_identity())
        except StateError as exc:
            raise self._errors.spec(str(exc)) from None
        busy = self._take_busy()
        try:
            self._stop_current(
                f"when load_state_dict() moved its Loader to epoch {epoch}, batch {batch}: "
                "iter(loader) goes on from there"
            )
            self._current = None
            self.next_epoch, self._resume_epoch, self._resume_batch = epoch, epoch, batch
            self._position = None
        finally:
            busy.release()

    def _state_identity(self) -> StateIdentity:
        """What a state must match; ``num_samples`` is the backend's count for this rank."""
        ident = self._identity
        if self._feed is None and ident is not None:
            return ident  # closed: the last stream's
        feed = self._feed_or_raise()
        dataset = feed.dataset_digest or None
        if (
            ident is None
            or ident.num_samples != feed.num_samples
            or ident.len != feed.num_batches
            or ident.dataset != dataset
        ):
            a = self._args
            ident = self._identity = StateIdentity(
                seed=a.seed,
                order=a.order_name,
                batch_size=a.batch_size,
                drop_last=a.drop_last,
                distributed=a.distributed,
                rank=a.rank,
                world_size=a.world_size,
                num_samples=feed.num_samples,
                indices=self._indices_digest,
                len=feed.num_batches,
                dataset=dataset,
            )
        return ident

    def close(self) -> None:
        """Stop the current epoch, close the feed and the backend (idempotent).

        An epoch left part-way is not ended silently: its iterator's next ``next()`` raises the
        Loader's closed error (``BetonClientError`` served, ``BetonError`` in process), naming
        how many of its batches it yielded. An iterator that finished its epoch just stops.

        Ctrl-C is held back until it is done (:func:`_sigint_deferred`): closing is short
        (cancelling calls, unmapping, waiting for the batches running in process), and one cut
        short left a stream half closed that nothing closed again, or, on gRPC, a lock of the
        channel held, on which the channel's own close then hung.
        """
        if self._parents():
            # A forked child: the streams, channels and mappings are its parent's. Forget them;
            # their finalizers do nothing here (``_forks.owner_only``).
            self._closed = True
            if self._feed is not None:
                self._state_identity()  # kept for state_dict() after close
            feed, self._feed, self._current = self._feed, None, None
            if feed is not None:
                self._len = feed.num_batches
            return
        with _sigint_deferred():
            ref = self._current
            cur = ref() if ref is not None else None
            if cur is not None:
                if not cur.done:
                    cur.cut_short = (self._errors.closed, "when its Loader was closed")
                cur.close()
            self._closed = True
            if self._feed is not None:
                self._state_identity()  # kept for state_dict() after close
            feed, self._feed = self._feed, None
            if feed is not None:
                self._len = feed.num_batches
                feed.close()
            self._backend.close()

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Refuse ``pickle``, ``copy.copy`` and ``copy.deepcopy`` (``TypeError``): a Loader owns
        worker threads or a daemon's stream, which belong to one object in one process (a copy
        sharing them would close them under the original)."""
        raise TypeError(_NOT_COPYABLE)

    def __enter__(self) -> FrontEnd:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: Raised by ``pickle`` and ``copy`` of a Loader.
_NOT_COPYABLE = (
    "a Loader cannot be pickled or copied: it owns worker threads (in process) or a stream of a "
    "daemon (served), which belong to it alone, in the process that built it. Build a Loader "
    "in each process from the same arguments (served Loaders with identical arguments share "
    "one decode), and carry an epoch's position with state_dict() / load_state_dict()"
)
#: Raised by ``pickle`` and ``copy`` of an epoch iterator.
_ITERATOR_NOT_COPYABLE = (
    "an epoch iterator cannot be pickled or copied: it reads from its Loader's worker threads "
    "or daemon stream, which stay with that Loader in this process. Build a Loader in each "
    "process from the same arguments, and carry an epoch's position with state_dict() / "
    "load_state_dict()"
)

#: Raised by ``iter()`` and ``next()`` while another thread runs one of them on the same Loader.
_IN_USE = (
    "this Loader is already in use by another thread (inside iter() or next()): a Loader "
    "yields one epoch at a time, from one thread at a time; use one Loader per consumer "
    "thread (identical Loaders of one daemon share their decoding)"
)


def _forked_message(pid: int) -> str:
    return (
        f"this served Loader belongs to process {pid}, and this is a process forked from it "
        f"({os.getpid()}): its stream, channel and shared memory are the parent's, and batches "
        "read here would be taken from the parent. Build a new Loader in the child (identical "
        "Loaders of one daemon share their decoding)"
    )


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Hold back Ctrl-C (SIGINT) while a stream is opened, started or closed, and deliver it
    after.

    A ``KeyboardInterrupt`` raised inside gRPC's blocking calls can leave a lock of the
    channel held (it may land between a lock's acquire and the block that releases it), and
    every later call on the channel then hangs; one raised half-way through building a stream
    leaks its call. Only the main thread receives SIGINT, and only a Python-level handler can be
    swapped: elsewhere this does nothing. The previous handler is restored, then called once if
    a SIGINT came meanwhile (the default one raises ``KeyboardInterrupt`` there, with the stream
    opened and consistent).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):
        yield
        return
    pending: list[tuple[int, Any]] = []
    signal.signal(signal.SIGINT, lambda signum, frame: pending.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if pending:
            previous(*pending[0])


class EpochIterator:
    """Yields one epoch of a :class:`FrontEnd`: each raw batch through the tails.

    Batch lifetime: with ``copy=False`` a batch's arrays are views of the backend's buffers and
    of the tails' reused buffers, valid until the next batch is requested (as in FFCV).
    """

    def __init__(self, loader: FrontEnd, feed: Feed, epoch: int, start: int) -> None:
        self.loader = loader
        self.feed = feed
        self.epoch = epoch
        self.batch = start
        self.done = False
        #: A ``next()`` began and did not return (see :meth:`__next__`).
        self._unfinished = False
        #: The epoch's feed: opened by the first ``next()`` (:meth:`_reopen`), so that
        #: ``FrontEnd.__iter__`` does nothing a Ctrl-C could leave half done.
        self._epoch_feed: EpochFeed | None = None
        #: What stopped this epoch before its end (the next ``iter()``, or ``close()`` on the
        #: Loader): the error to raise and why; ``None`` while it runs or once it is whole.
        self.cut_short: tuple[type[Exception], str] | None = None

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Refuse ``pickle`` and ``copy`` (``TypeError``), as the Loader does."""
        raise TypeError(_ITERATOR_NOT_COPYABLE)

    @property
    def index(self) -> int:
        """The batch the next ``next()`` yields."""
        return self.batch

    def __iter__(self) -> EpochIterator:
        return self

    def __len__(self) -> int:
        """Batches per epoch."""
        return self.feed.num_batches

    def _next_raw(self) -> RawBatch | None:
        """The next raw batch; a feed broken by a lost daemon is re-opened and the epoch resumed
        at this batch (under the backend's reconnection policy)."""
        while True:
            ef = self._epoch_feed
            assert ef is not None
            try:
                return ef.next()
            except KeyboardInterrupt:
                self._interrupted()
                raise
            except BaseException as err:
                loader = self.loader
                ef.close()
                self._epoch_feed = None
                try:
                    feed = loader._reconnected(err, loader._plans)
                except BaseException:
                    self.done = True
                    raise
                if feed.num_batches != self.feed.num_batches:  # the backend checks; be sure
                    self.done = True
                    raise loader._errors.spec(
                        f"the re-opened stream has {feed.num_batches} batches per epoch instead "
                        f"of {self.feed.num_batches}"
                    ) from None
                self.feed = feed
                self._epoch_feed = feed.epoch(self.epoch, self.batch)

    def _interrupted(self) -> None:
        """A ``KeyboardInterrupt`` (Ctrl-C) stopped ``next()`` before it yielded: drop the
        epoch's feed, whose position may have moved past the batch not yielded. The next
        ``next()`` re-opens the epoch at that batch (:meth:`_reopen`), so that a training loop
        interrupted in a notebook and resumed goes on with exactly the batches it has not seen,
        as FFCV's iterator does.

        The feed is forgotten only once it is closed: an interrupt landing here before the
        deferral starts leaves it in place, and the next ``next()`` closes it (it sees the
        unfinished call)."""
        ef = self._epoch_feed
        if ef is not None:
            # Held back too: in process, closing waits for the batches still running, whose
            # buffers the re-opened epoch reuses.
            with _sigint_deferred():
                ef.close()
                self._epoch_feed = None

    def _reopen(self) -> EpochFeed:
        """The epoch's feed, from the first batch not yet yielded: opened for the first
        ``next()``, or again after :meth:`_interrupted` (what the backend had prepared ahead
        is prepared again)."""
        loader = self.loader
        try:
            with _sigint_deferred():
                feed = loader._feed_accepting(loader._usable_feed(), loader._plans)
                if feed.num_batches != self.feed.num_batches:
                    raise loader._errors.spec(
                        f"the re-opened stream has {feed.num_batches} batches per epoch "
                        f"instead of {self.feed.num_batches}"
                    )
                self.feed = feed
                ef = self._epoch_feed = feed.epoch(self.epoch, self.batch)
                # After ``epoch``: it may change the outputs (progressive resizing).
                loader._build_tails(feed)
                self._unfinished = False  # a consistent feed at the batch not yet yielded
        except KeyboardInterrupt:
            raise  # delivered once the epoch is re-opened: the next call goes on from it
        except BaseException:
            self.done = True
            raise
        return ef

    def __next__(self) -> tuple[Any, ...]:
        busy = self.loader._take_busy()
        try:
            return self._next_locked()
        finally:
            busy.release()

    def _next_locked(self) -> tuple[Any, ...]:
        loader = self.loader
        if loader._generation != _forks.generation():
            loader._check_process()
        if self.done:
            if self.cut_short is not None:
                kind, why = self.cut_short
                raise kind(
                    f"this iterator of epoch {self.epoch} stopped after {self.batch} of its "
                    f"{len(self)} batches, {why}"
                )
            # Asking past the end releases the last batch (as asking for a next batch does).
            self.close()
            raise StopIteration
        ef = self._epoch_feed
        if ef is None or self._unfinished:
            # The epoch's first call (its feed is opened here), or the last call did not return
            # (Ctrl-C, perhaps twice: a second interrupt can land in the first one's handling
            # below): its feed may have moved past this batch.
            self._interrupted()
            ef = self._reopen()
        self._unfinished = True
        ef.release()
        try:
            out = self._yield(self._next_raw())
        except KeyboardInterrupt:
            if not self.done:
                self._interrupted()  # nothing was yielded: the next call makes this batch again
            raise
        except StopIteration:
            raise
        except BaseException as err:
            self._failed(err)
            raise
        # The batch counts as yielded only here, with no call between these steps and the
        # return (Python runs signal handlers at calls and loops, not between plain stores).
        # An interrupt before this point leaves the batch to be made again by the next call.
        b, last = self.batch + 1, self.feed.num_batches
        self.batch = b
        self._unfinished = False
        self.loader._position = (self.epoch, b)
        if b >= last:
            self.done = True  # the buffers stay valid until the next epoch or close
        return out

    def _failed(self, err: BaseException) -> None:
        """An error ended the epoch: later ``next()`` calls raise again, naming it, instead of
        a ``StopIteration`` that a loop catching the error would read as a whole epoch."""
        if not self.done or self.cut_short is not None:
            return  # the backend may retry it, or something else already cut the epoch
        errors = self.loader._errors
        kind = errors.spec if isinstance(err, errors.spec) else errors.pipeline
        what = cap_message(str(err), 300)
        self.cut_short = (
            kind,
            f"when batch {self.batch} failed ({type(err).__name__}: {what}); iterate the "
            "Loader again for the next epoch",
        )

    def _yield(self, raw: RawBatch | None) -> tuple[Any, ...]:
        """The batch to yield from ``raw`` (through the tails); :meth:`__next__` counts it."""
        ef = self._epoch_feed
        assert ef is not None
        loader = self.loader
        if raw is None:
            self.close()
            if self.batch < self.feed.num_batches:  # never silently short (see _interrupted)
                raise loader._errors.pipeline(
                    f"epoch {self.epoch} ended after {self.batch} of {self.feed.num_batches} "
                    "batches"
                )
            raise StopIteration
        arrays = raw.arrays
        if loader.copy:
            arrays = [
                np.array(a, copy=True) if isinstance(a, np.ndarray) else a.clone() for a in arrays
            ]
            ef.release()
        ids = raw.ids
        loader.last_sample_ids = ids
        tails = loader._tails
        epoch, seed = self.epoch, loader.seed
        try:
            out = tuple(tail(a, ids, epoch, seed) for a, tail in zip(arrays, tails, strict=True))
        except client_errors.BetonClientError as exc:
            self.close()
            raise loader._as(exc) from exc.__cause__
        except KeyboardInterrupt:
            raise  # __next__ keeps the epoch resumable
        except BaseException:
            self.close()
            raise
        return out

    def close(self) -> None:
        """Stop early: the backend cancels what it prepared ahead (idempotent). The feed is
        forgotten only once closed, so a close cut short by Ctrl-C is finished by the next."""
        self.done = True
        ef = self._epoch_feed
        if ef is not None:
            ef.close()
            self._epoch_feed = None
