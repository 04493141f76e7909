"""Planning and compiling pipelines: states, buffers, compiled functions, the per-batch runner.

A :class:`Plan` is built once per (dataset, pipelines, batch size):

1. :func:`build_graph` turns FFCV's ``pipelines`` dict into a forest of op nodes.
2. Declaration walks every node depth-first: ``accept_field``/``accept_globals`` on decoders,
   then ``declare_state_and_memory``. An op whose output state has ``jit_mode=True`` belongs to the
   **jit prefix** (runs on numpy arrays in a worker thread, Numba-compiled unless its function
   has ``python = True``); the ops from the first non-jit one onwards (``ToTensor`` and after) are
   the **client tail**, run as Python on torch tensors by the consumer.
3. Each op's function is generated and compiled once; ``refresh(epoch)`` re-declares states
   between epochs (FFCV does this every epoch, so ``output_size`` changes take effect) and
   re-allocates only when a shape or dtype changed.

Buffers. Running a batch needs every op's scratch/output memory. Several workers may run
batches of one plan at once, so buffers live in a :class:`Workspace` (one per concurrently
running batch, recycled through the plan's free list); an op receives ``buffer[:n]`` for a batch
of ``n`` samples. Free workspaces are kept while a source that runs the plan is open
(:meth:`Plan.hold`, :meth:`Plan.unhold`): when the last one closes, they go, so an idle plan that
a daemon keeps for reuse holds no batch memory (an ImageNet-sized plan's decoder output alone is
~39 MB per worker; a served sweep of distinct specs grew the daemon by ~70 MB per job before, up
to its 64 cached plans). The free workspaces of held plans are kept by *layout* (the batch size,
and each op's class, states and buffers): plans with one layout share them. The jobs of a sweep
over an RRC scale, a flip probability or a brightness have one layout, and running at once on
W workers they need W sets in all, not W each (the free list of a plan grows to the most
batches it ever ran at once, which on a daemon's shared pool is every worker). A workspace's
contents are undefined when a batch starts, whichever plan ran in it before, as they are
between two batches of one plan. A plan that no source ever held (a precompile, a direct caller
of :meth:`Plan.run`) keeps a free list of its own.

The jit outputs are written into caller-owned destination arrays (a shm slot, a Loader slot),
copied there unless the last op could write there directly. An ``inplace`` op
(``Operation.inplace``) whose parent returned the buffer it was given, and is that parent's only
jit child, gets that buffer as its destination and works in place; when such a chain ends an
output, its first op (a decoder, say) is the one given the caller's destination.

Call signatures (see ``operation.py``): decoders ``f(batch_indices, dst, metadata,
storage_state[, seed_key])``; transforms ``f(inp, dst[, batch_indices][, seed_key][, shared])``.
``seed_key`` is ``derive_seed_key(seed, epoch, op.position)``; ``batch_indices`` is ``uint64``.

Shared state: ``declare_shared_memory(state)`` may return an ``AllocationQuery`` (its shape is
taken as is, without a batch dimension); ``generate_code_for_shared_state()`` returns
``init(shared[, batch_indices])``, called once per batch before the op; the buffer is passed to
the op as its last argument.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from beton_serve._batchmem import batch_empty, memory_limit_bytes
from beton_serve.errors import BetonError, PipelineError, SpecError
from beton_serve.pipeline._graph import Node, OutputPath, build_graph
from beton_serve.pipeline.allocation_query import AllocationQuery
from beton_serve.pipeline.compiler import Compiler
from beton_serve.pipeline.operation import same_array
from beton_serve.pipeline.pipeline_spec import PipelineSpec
from beton_serve.pipeline.state import State, is_torch_dtype

log = logging.getLogger("beton_serve.pipeline")

__all__ = [
    "IDLE_WORKSPACE_SHARE_OF_MEMORY",
    "OpFailure",
    "OutputSpec",
    "Plan",
    "PlanCache",
    "Workspace",
    "WorkspaceMemory",
    "compile_pipelines",
    "idle_workspace_limit",
    "set_idle_workspace_limit",
    "workspace_memory",
]

#: The default bound on the free workspaces a process keeps (:func:`idle_workspace_limit`): this
#: share of its memory (the host's, or its cgroup's limit when lower).
IDLE_WORKSPACE_SHARE_OF_MEMORY = 8


#: Set to ``0``, decoders never take the place of the flip after them
#: (:meth:`Plan._mirror_fusions`): for comparisons, the pixels are the same. Read when a plan is
#: made, not at import.
FUSE_MIRROR_ENV = "BETON_SERVE_FUSE_MIRROR"


def fuse_mirror_enabled() -> bool:
    """Whether plans made now may fuse a decoder and its flip (:data:`FUSE_MIRROR_ENV`)."""
    return os.environ.get(FUSE_MIRROR_ENV, "1").strip() != "0"


#: The step mark of a flip whose decoder wrote its result.
_ABSORBED = ("absorbed",)


@dataclass(frozen=True)
class OutputSpec:
    """One daemon-side (jit) output: per-sample ``shape`` and numpy ``dtype``."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]


@dataclass(frozen=True)
class _CheckStep:
    """Stands in for an op's :class:`Node` in :class:`OpFailure` when a step that is not an op
    fails: the sample check (:attr:`Plan.sample_check`). Only ``name`` is read."""

    name: str


#: The step name a checksum mismatch reports as its ``op``.
_SAMPLE_CHECK = _CheckStep("checksum")


class OpFailure(Exception):
    """Internal: the op of ``node`` raised ``cause`` while running a batch."""

    def __init__(self, node: Node | _CheckStep, cause: BaseException) -> None:
        super().__init__(f"{node.name}: {type(cause).__name__}: {cause}")
        self.node = node
        self.cause = cause


def _queries(alloc: Any, node: Node) -> list[AllocationQuery] | AllocationQuery | None:
    if not alloc:  # None, or a falsy non-query such as the 0 some FFCV user ops return
        return None
    if isinstance(alloc, AllocationQuery):
        return alloc
    if isinstance(alloc, tuple | list) and all(isinstance(q, AllocationQuery) for q in alloc):
        return list(alloc)
    raise SpecError(
        f"{node.name}: declare_state_and_memory returned {alloc!r} as its allocation; "
        "return an AllocationQuery, a tuple of them, or None"
    )


def _alloc_key(q: Any) -> Any:
    if q is None:
        return None
    if isinstance(q, list):
        return tuple(_alloc_key(x) for x in q)
    return (q.shape, str(q.dtype), str(q.device))


def _empty(q: AllocationQuery, batch: int | None) -> Any:
    shape = q.shape if batch is None else (batch, *q.shape)
    if is_torch_dtype(q.dtype):
        import torch

        return torch.empty(shape, dtype=q.dtype, device=q.device or "cpu")
    return batch_empty(shape, q.dtype)


def _zeros(q: Any) -> Any:
    """A one-sample batch of zeros for allocation ``q`` (``None``, a query or a list of them),
    shaped as :meth:`Workspace.buffer` and :func:`_slice` give it to an op."""
    if q is None:
        return None
    if isinstance(q, list):
        return tuple(_zeros(x) for x in q)
    return np.zeros((1, *q.shape), q.dtype)


def _slice(buf: Any, n: int) -> Any:
    if buf is None:
        return None
    if isinstance(buf, list):
        return tuple(_slice(b, n) for b in buf)
    return buf[:n]


class PlanCache:
    """Compiled op functions shared between plans of the same (file, schema, pipelines).

    The file is the reader's ``identity`` (device, inode, size, modification time), not its
    path: functions compiled for one file are never handed to a plan over another.

    Thread-safe. The daemon keeps one for its lifetime; a Loader may be given one so that a
    second Loader over the same file and pipelines starts without compiling. Only pipelines
    whose ops all have a wire description (``spec_params``) are cached.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fns: dict[Any, dict[int, Callable[..., Any]]] = {}

    def get(self, key: Any) -> dict[int, Callable[..., Any]] | None:
        with self._lock:
            return self._fns.get(key)

    def put(self, key: Any, fns: dict[int, Callable[..., Any]]) -> None:
        with self._lock:
            self._fns[key] = dict(fns)

    def __len__(self) -> int:
        with self._lock:
            return len(self._fns)


def _query_bytes(q: AllocationQuery, batch: int | None) -> int:
    """Bytes of the buffer :func:`_empty` makes for ``q`` (torch dtypes by their element size)."""
    if is_torch_dtype(q.dtype):
        item = int(getattr(q.dtype, "itemsize", 0) or 8)
    else:
        item = np.dtype(q.dtype).itemsize
    return math.prod(int(d) for d in q.shape) * (1 if batch is None else batch) * item


class _FreeSets:
    """The free workspaces of held plans, by layout, and how many holds each layout has (see
    the module docstring). One per process; its lock guards every plan's workspace bookkeeping.

    It also counts the bytes of every live workspace (:func:`workspace_memory`) and bounds the
    free ones together (:func:`set_idle_workspace_limit`): when keeping a released workspace
    would take the free bytes past the limit, free workspaces go, those of the layouts used
    longest ago first. What is running is never touched, so a process's workspace memory is at
    most the limit plus one set per batch running at once."""

    def __init__(self) -> None:
        # Reentrant: a source collected by the garbage collector releases its hold from a
        # finalizer (``BatchSource``), which may run inside any allocation, this lock held.
        # Such a nested release is deferred to the end of the outer section (``__exit__``):
        # run at once, it popped a layout's list in the middle of ``put``, and the bytes
        # counted no longer matched the lists.
        self.lock = threading.RLock()
        self._depth = 0
        self._deferred: list[str] = []
        #: Oldest-used layout first (``put`` and ``take`` move a layout to the end).
        self.free: dict[str, list[Workspace]] = {}
        self.holds: dict[str, int] = {}
        self.free_bytes = 0
        self.live_bytes = 0
        self.evicted = 0
        #: ``None``: not set yet (:func:`idle_workspace_limit` computes the default).
        self.limit: int | None = None

    def __enter__(self) -> _FreeSets:
        """Take :attr:`lock` for one section of workspace bookkeeping."""
        self.lock.acquire()
        self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        gone: list[list[Workspace] | None] = []  # freed after the lock is released
        try:
            while self._depth == 1 and self._deferred:
                gone.append(self._unhold_now(self._deferred.pop()))
        finally:
            self._depth -= 1
            self.lock.release()

    def hold(self, layout: str) -> None:
        self.holds[layout] = self.holds.get(layout, 0) + 1

    def unhold(self, layout: str) -> list[Workspace] | None:
        """Drop one hold; the last one takes the layout's free workspaces away (returned, to be
        freed by the caller outside :attr:`lock`: unmapping 40 MB takes milliseconds). Called
        inside a section of this thread's (a finalizer run by the garbage collector there), it
        is deferred to that section's end."""
        if self._depth > 1:
            self._deferred.append(layout)
            return None
        return self._unhold_now(layout)

    def _unhold_now(self, layout: str) -> list[Workspace] | None:
        n = self.holds.get(layout, 0) - 1
        if n > 0:
            self.holds[layout] = n
            return None
        self.holds.pop(layout, None)
        gone = self.free.pop(layout, None)
        if gone:
            self.free_bytes -= sum(ws.nbytes for ws in gone)
        return gone

    def take(self, layout: str) -> Workspace | None:
        """A free workspace of ``layout``, or ``None``."""
        free = self.free.get(layout)
        if not free:
            return None
        ws = free.pop()
        self.free_bytes -= ws.nbytes
        self.free[layout] = self.free.pop(layout)  # most recently used: last
        return ws

    def put(self, layout: str, spare: list[Workspace]) -> list[Workspace]:
        """Keep ``spare`` (free workspaces of ``layout``); returns those evicted to stay within
        :attr:`limit`, to be freed by the caller outside :attr:`lock`."""
        free = self.free.pop(layout, None)
        self.free[layout] = free = [] if free is None else free
        free.extend(spare)
        self.free_bytes += sum(ws.nbytes for ws in spare)
        return self.trim()

    def trim(self) -> list[Workspace]:
        """Evict free workspaces, those of the layouts used longest ago first, until they fit
        within :attr:`limit`; returns them, to be freed by the caller outside :attr:`lock`."""
        limit = idle_workspace_limit()
        gone: list[Workspace] = []
        if self.free_bytes <= limit:
            return gone
        for key in list(self.free):  # oldest-used first; the layout just used is last
            victims = self.free[key]
            while victims and self.free_bytes > limit:
                ws = victims.pop(0)  # the set released longest ago
                self.free_bytes -= ws.nbytes
                gone.append(ws)
            if self.free_bytes <= limit:
                break
        self.evicted += len(gone)
        return gone


_FREE_SETS = _FreeSets()


def idle_workspace_limit() -> int:
    """The bound on the bytes of free workspaces this process keeps for reuse
    (:func:`set_idle_workspace_limit`; by default an eighth of the memory, see
    :func:`beton_serve._batchmem.memory_limit_bytes`)."""
    limit = _FREE_SETS.limit
    if limit is None:
        limit = _FREE_SETS.limit = memory_limit_bytes() // IDLE_WORKSPACE_SHARE_OF_MEMORY
    return limit


def set_idle_workspace_limit(nbytes: int | None) -> int:
    """Bound the free workspaces this process keeps for reuse to ``nbytes`` (``None`` or 0: the
    default, an eighth of the memory); returns the bound now in force. Free workspaces past the
    new bound are freed at once. The daemon's ``max_idle_buffer_bytes``."""
    with _FREE_SETS:
        _FREE_SETS.limit = int(nbytes) if nbytes and nbytes > 0 else None
        gone = _FREE_SETS.trim()
        limit = idle_workspace_limit()
    del gone  # freed outside the lock (unmapping 40 MB takes milliseconds)
    return limit


@dataclass(frozen=True)
class WorkspaceMemory:
    """What the ops' buffers hold in this process (:func:`workspace_memory`).

    Attributes:
        live_bytes: every workspace allocated and not freed yet, running or free.
        idle_bytes: the free workspaces kept for reuse (at most ``limit_bytes``).
        limit_bytes: the bound on ``idle_bytes``.
        evicted: free workspaces freed to stay within the bound, over the process's life.
    """

    live_bytes: int
    idle_bytes: int
    limit_bytes: int
    evicted: int


def workspace_memory() -> WorkspaceMemory:
    """A snapshot of this process's workspace memory (for stats and tests)."""
    with _FREE_SETS:
        return WorkspaceMemory(
            live_bytes=_FREE_SETS.live_bytes,
            idle_bytes=_FREE_SETS.free_bytes,
            limit_bytes=idle_workspace_limit(),
            evicted=_FREE_SETS.evicted,
        )


def _forget_workspace(counted: list[int]) -> None:
    with _FREE_SETS:
        _FREE_SETS.live_bytes -= counted[0]


def _after_fork_in_child() -> None:
    """A lock another thread held at the fork would stay held in the child for ever (every
    plan's first batch there would hang): replace it, as ``engine._pool`` does its own."""
    _FREE_SETS.lock = threading.RLock()
    _FREE_SETS._depth = 0  # the thread that was inside a section is not in the child


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def shared_free_workspaces() -> dict[str, int]:
    """``{layout: free workspaces}`` of the held plans in this process (for tests)."""
    with _FREE_SETS:
        return {k: len(v) for k, v in _FREE_SETS.free.items() if v}


class Workspace:
    """The buffers one running batch needs (see the module docstring). Owned by one worker at a time.

    An op's batch buffer is allocated the first time a batch needs it (:meth:`buffer`): one the
    plan never passes to its op, because the op writes the caller's destination instead (a
    decoder whose output goes straight into the slot, an ``inplace`` op working on its parent's
    buffer), is never allocated, so it costs no memory and does not count against
    :func:`set_idle_workspace_limit`. Shared memory (``declare_shared_memory``) is allocated at
    once."""

    def __init__(self, plan: Plan) -> None:
        #: What the buffers are (``Plan._layout``): given back only to a plan of this layout.
        self.layout = plan._layout
        self.buffers: dict[int, Any] = {}
        self.shared: dict[int, Any] = {}
        #: What :meth:`buffer` allocates on demand: ``{position: (query or queries, op name)}``.
        self._queries: dict[int, tuple[Any, str]] = {}
        self._batch_size = plan.batch_size
        self._plan_bytes = plan.workspace_bytes
        #: Bytes allocated (counted in :func:`workspace_memory` while the workspace lives).
        self.nbytes = 0
        #: ``[nbytes]``, for the finalizer (which must not hold the workspace).
        self._counted = [0]
        weakref.finalize(self, _forget_workspace, self._counted).atexit = False
        for node in plan.jit_nodes:
            q = plan._alloc[node.position]
            if q is not None:
                self._queries[node.position] = (q, node.name)
            sq = plan._shared_alloc.get(node.position)
            if sq is not None:
                self.shared[node.position] = self._allocate(node.name, sq, None)

    def buffer(self, position: int) -> Any:
        """The batch buffer of the op at ``position`` (``None`` if it declared none), allocated
        on first use.

        Raises:
            SpecError: it cannot be allocated (the message names the op and the sizes).
        """
        buf = self.buffers.get(position)
        if buf is None and position in self._queries:
            q, name = self._queries[position]
            buf = self.buffers[position] = self._allocate(name, q, self._batch_size)
        return buf

    def _allocate(self, name: str, q: Any, batch: int | None) -> Any:
        """``q``'s buffer (a list for a list of queries), counted in :attr:`nbytes`."""
        queries = q if isinstance(q, list) else [q]
        try:
            made = [_empty(x, batch) for x in queries]
        except MemoryError as exc:
            raise SpecError(
                f"{name}: its buffers for a batch of {self._batch_size} cannot be "
                f"allocated ({exc}); the buffers of one batch of this plan take up to "
                f"{self._plan_bytes:,} bytes: use smaller sizes or a smaller batch_size"
            ) from None
        self._count(sum(_query_bytes(x, batch) for x in queries))
        return made if isinstance(q, list) else made[0]

    def _count(self, nbytes: int) -> None:
        with _FREE_SETS:
            self.nbytes += nbytes
            self._counted[0] += nbytes
            _FREE_SETS.live_bytes += nbytes


class Plan:
    """A planned and compiled set of pipelines over one reader (see the module docstring).

    Attributes:
        outputs: the jit outputs in FFCV output order.
        client_tail: ``{output name: [ops]}``, the ops from ``ToTensor`` onwards.
        batch_size: the largest batch the buffers hold.
        generation: bumped whenever ``refresh`` changes a state or an allocation.
        sliceable: ``True`` when every op works per sample, so a batch may be split into slices
            that run on different workers (ops that mix samples, such as mixup, prevent it).
        sample_check: ``None``, or ``check(batch_indices)``, called by :meth:`run` on the worker
            before any decoder reads the batch; it raises a ``BetonError`` naming the first bad
            sample (e.g. ``format.ChecksumVerifier.check``). Set by ``compile_pipelines``.
    """

    def __init__(
        self,
        reader: Any,
        paths: list[OutputPath],
        nodes: list[Node],
        *,
        batch_size: int,
        cache: PlanCache | None,
        cache_key: Any,
    ) -> None:
        if batch_size < 1:
            raise SpecError(f"batch_size must be >= 1, got {batch_size}")
        self.reader = reader
        self.batch_size = int(batch_size)
        self.paths = paths
        self.nodes = nodes
        self.generation = 0
        self._cache = cache
        self._cache_key = cache_key
        self._lock = threading.Lock()
        #: Free workspaces of a plan no source ever held (held plans: ``_FREE_SETS``).
        self._free: list[Workspace] = []
        #: Open sources that run this plan (:meth:`hold`); whether any ever did; the layout its
        #: workspaces are kept by (set by ``_declare``). Guarded by ``_FREE_SETS`` (its lock).
        self._holders = 0
        self._held = False
        self._layout = ""
        #: ``{op name: [seconds, runs]}`` accumulated by :meth:`run` (see :meth:`op_times`).
        self._op_time: dict[str, list[float]] = {}
        self._states: dict[int, State] = {}
        self._alloc: dict[int, Any] = {}
        self._shared_alloc: dict[int, AllocationQuery | None] = {}
        self._fns: dict[int, Callable[..., Any]] = {}
        self._shared_fns: dict[int, Callable[..., Any] | None] = {}
        self._jit: dict[int, bool] = {}
        self._signature: Any = None
        #: Per output: ``(leaf position, may write into the caller's destination, its shape,
        #: its dtype, the position of the op given the destination)``, fixed between two
        #: declarations (:meth:`_static_outputs`).
        self._outputs_static: list[tuple[int, bool, tuple[int, ...], np.dtype[Any], int]] = []
        #: Whether decoders may take the place of the flips after them
        #: (:func:`fuse_mirror_enabled` when the plan was made).
        self._fuse_mirror = fuse_mirror_enabled()
        #: The jit ops as :meth:`run` calls them (:meth:`_build_steps`).
        self._steps: list[tuple[Any, ...]] = []
        self.sample_check: Callable[[NDArray[np.uint64]], None] | None = None
        self._storage_state = reader.storage_state
        self._metadata = {n: reader.field_metadata(n) for n in {nd.field_name for nd in nodes}}
        self._declare()
        self._generate(use_cache=True)
        self._compile_ahead()

    # -- planning ------------------------------------------------------------------------
    def _declare(self) -> bool:
        memory_read: Callable[..., Any] | None = getattr(self.reader, "memory_read", None)
        if memory_read is None:
            from beton_serve.format import memory_read as _module_read

            memory_read = _module_read

        states: dict[int, State] = {}
        alloc: dict[int, Any] = {}
        shared: dict[int, AllocationQuery | None] = {}
        jit: dict[int, bool] = {}
        for node in self.nodes:  # positions are depth-first, so parents come first
            op = node.op
            if node.parent is None:
                prev = State(jit_mode=True, device="cpu", shape=None, dtype=np.dtype(np.uint8))
                op.accept_field(self.reader.handlers[node.field_name])
                op.accept_globals(self._metadata[node.field_name], memory_read)
                accept_storage = getattr(op, "accept_storage", None)
                if accept_storage is not None:  # a beton-serve extension (SimpleRGBImageDecoder)
                    accept_storage(self._storage_state)
            else:
                prev = states[node.parent.position]
            # A trait of the op class (Operation.torch_op), set by the torch-only transforms.
            if prev.jit_mode and op.torch_op:
                raise SpecError(
                    f"{node.name} runs on torch tensors but its input is a numpy array; "
                    "move it after ToTensor()"
                )
            try:
                state, query = op.declare_state_and_memory(prev)
                shared_q = op.declare_shared_memory(prev)
            except SpecError:
                raise
            except (ValueError, TypeError) as exc:
                hint = " (a torch op must come after ToTensor())" if prev.jit_mode else ""
                raise SpecError(f"{node.name} rejected its input {prev}: {exc}{hint}") from exc
            except BetonError:
                raise
            except Exception as exc:  # the op's own code failed: name it, not "internal error"
                raise SpecError(
                    f"{node.name}: declare_state_and_memory raised {type(exc).__name__}: {exc}"
                ) from exc
            if not isinstance(state, State):
                raise SpecError(
                    f"{node.name}: declare_state_and_memory must return (State, allocation)"
                )
            is_jit = bool(state.jit_mode)
            if is_jit and not prev.jit_mode:
                is_jit = False  # back to numpy after ToTensor: stays in the Python tail
            states[node.position] = state
            jit[node.position] = is_jit
            q = _queries(query, node)
            if is_jit:
                for x in q if isinstance(q, list) else [q]:
                    if x is not None and is_torch_dtype(x.dtype):
                        raise SpecError(
                            f"{node.name} asks for torch memory ({x.dtype}) before ToTensor(); "
                            "use a numpy dtype or move the op after ToTensor()"
                        )
                if state.shape is None:
                    raise SpecError(f"{node.name} declared an output state without a shape")
            alloc[node.position] = q
            shared[node.position] = shared_q if isinstance(shared_q, AllocationQuery) else None
        for path in self.paths:
            leaf = self._jit_leaf(path, jit)
            if leaf is None:
                raise SpecError(
                    f"pipeline '{path.name}' has no numpy stage; start it with a decoder"
                )
            first_tail = next((i for i, nd in enumerate(path.nodes) if not jit[nd.position]), None)
            if first_tail is not None and first_tail < path.own_start:
                raise SpecError(
                    f"pipeline '{path.name}' branches from {path.nodes[path.own_start - 1].name}, "
                    "which runs after ToTensor(); branch from an op before ToTensor()"
                )
        signature = (
            {k: (s.shape, str(s.dtype)) for k, s in states.items()},
            {k: _alloc_key(v) for k, v in alloc.items()},
            {k: _alloc_key(v) for k, v in shared.items()},
        )
        changed = signature != self._signature
        self._states, self._alloc, self._shared_alloc, self._jit = states, alloc, shared, jit
        self._outputs_static = self._static_outputs()
        if self._fns:
            self._steps = self._build_steps()
        if changed:
            layout = repr(
                (
                    self.batch_size,
                    [
                        (nd.position, type(nd.op).__module__, type(nd.op).__qualname__)
                        for nd in self.nodes
                    ],
                    sorted(jit.items()),
                    [sorted(part.items()) for part in signature],
                )
            )
            gone: list[Any] = []  # freed on return, outside the lock
            with _FREE_SETS:
                self._signature = signature
                self.generation += 1
                gone.append(self._free)
                self._free = []
                for _ in range(self._holders):  # a held plan's holds move to its new layout
                    gone.append(_FREE_SETS.unhold(self._layout))
                    _FREE_SETS.hold(layout)
                self._layout = layout
        return changed

    def _leaf(self, path: OutputPath) -> Node:
        """The last jit op of ``path`` (``_declare`` guarantees there is one)."""
        leaf = self._jit_leaf(path)
        if leaf is None:  # pragma: no cover - rejected in _declare
            raise SpecError(f"pipeline '{path.name}' has no numpy stage")
        return leaf

    def _jit_leaf(self, path: OutputPath, jit: dict[int, bool] | None = None) -> Node | None:
        jit = self._jit if jit is None else jit
        leaf = None
        for nd in path.nodes:
            if not jit[nd.position]:
                break
            leaf = nd
        return leaf

    def _generate(self, use_cache: bool) -> None:
        cached = (
            self._cache.get(self._cache_key)
            if (use_cache and self._cache and self._cache_key)
            else None
        )
        fns: dict[int, Callable[..., Any]] = {}
        for node in self.nodes:
            pos = node.position
            self._shared_fns[pos] = node.op.generate_code_for_shared_state()
            if cached is not None and pos in cached:
                fns[pos] = cached[pos]
                continue
            try:
                fn = node.op.generate_code()
            except BetonError:
                raise  # already typed (SpecError, PipelineError...)
            except Exception as exc:  # the op's own code, given its parameters: a bad request
                raise SpecError(
                    f"{node.name}: generate_code() raised {type(exc).__name__}: {exc}"
                ) from exc
            if not callable(fn):
                raise SpecError(f"{node.name}: generate_code() must return a function, got {fn!r}")
            if self._jit[pos] and not getattr(fn, "python", False):
                flags = {
                    k: getattr(fn, k)
                    for k in ("with_indices", "with_seed", "python")
                    if hasattr(fn, k)
                }
                try:
                    fn2 = Compiler.compile(fn)
                except Exception as exc:
                    raise SpecError(f"{node.name}: numba could not compile it: {exc}") from exc
                for k, v in flags.items():
                    try:
                        setattr(fn2, k, v)
                    except AttributeError:
                        pass
                fn = fn2
            fns[pos] = fn
        self._fns = fns
        self._steps = self._build_steps()
        if self._cache is not None and self._cache_key is not None and cached is None:
            self._cache.put(self._cache_key, fns)

    def _compile_ahead(self) -> bool:
        """With a cold compile cache, compile the ops that allow it (``Operation.compile_ahead``)
        while the decoders' kernels compile, instead of after them (issue 14 §2).

        A crop decoder's first batch waits for its kernels (this process's ``beton-prewarm``
        thread and the prewarm helper process), and only then did the ops after it meet their
        first call and compile, one after the other on the first batch's path: a flip and the
        label's decoder added ~1.4 s to a cold RandomResizedCrop start. Queued behind this
        process's own prewarm compile (:func:`beton_serve._prewarm.ahead`), they compile while
        the helper still works. Nothing happens with a warm cache (nothing is under way), nor
        for ops that do not allow it. Whether anything was queued."""
        if not any(step[0].op.compile_ahead for step in self._steps):
            return False
        from beton_serve import _prewarm

        return _prewarm.ahead(self._run_on_zeros)

    def _run_on_zeros(self) -> None:
        """Call each ``compile_ahead`` op once, as :meth:`run` would call it (the same argument
        types, so the same compiled specialisation), on a private one-sample batch of zeros: the
        output of an op that is not called here (a crop decoder) is zeros of its declared state.
        Nothing the workers use is touched; an op that fails is skipped, and compiles at its
        first batch as it would have without this."""
        idx = np.zeros(1, np.uint64)
        seed = np.uint64(0)
        results: dict[int, Any] = {}
        passed: dict[int, Any] = {}
        for step in list(self._steps):
            node, pos, fn, parent, metadata, with_indices, with_seed, _, over, mirror, copy = step
            if mirror is _ABSORBED:
                if over in results:
                    results[pos] = passed[pos] = results[over]
                continue
            ok = node.op.compile_ahead and mirror is None and self._shared_alloc[pos] is None
            if parent is None and (metadata is None or len(metadata) == 0):
                ok = False  # a decoder reads sample 0's metadata: there must be one
            if not ok:
                continue
            if parent is not None and parent not in results:
                st = self._states[parent]
                results[parent] = passed[parent] = np.zeros((1, *(st.shape or ())), st.dtype)
            if over is not None and results.get(over) is passed.get(over):
                dst = results[over]
            else:
                dst = _zeros(self._alloc[pos])
            if parent is None:
                args: list[Any] = [idx, dst, metadata, self._storage_state]
            else:
                src = results[parent]
                args = [src.copy() if copy and isinstance(src, np.ndarray) else src, dst]
                if with_indices:
                    args.append(idx)
            if with_seed:
                args.append(seed)
            try:
                results[pos] = fn(*args)
            except Exception as exc:  # compiled at the first batch instead
                log.debug("compile ahead: %s failed on zeros (%r)", node.name, exc)
                continue
            passed[pos] = dst

    def refresh(self, epoch: int, *, recompile: bool = False) -> bool:
        """Re-declare every op's state before ``epoch`` (FFCV does this each epoch).

        Returns ``True`` when an output shape or a buffer changed (old workspaces are dropped and
        callers must re-allocate destinations from :attr:`outputs`). ``recompile`` regenerates and
        recompiles every op (FFCV's ``recompile=True``).
        """
        changed = self._declare()
        if recompile:
            self._generate(use_cache=False)
        return changed

    # -- description ---------------------------------------------------------------------
    @property
    def jit_nodes(self) -> list[Node]:
        return [nd for nd in self.nodes if self._jit[nd.position]]

    @property
    def outputs(self) -> list[OutputSpec]:
        specs = []
        for path in self.paths:
            leaf = self._leaf(path)
            st = self._states[leaf.position]
            specs.append(OutputSpec(path.name, tuple(st.shape or ()), np.dtype(st.dtype)))
        return specs

    @property
    def client_tail(self) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {}
        for path in self.paths:
            out[path.name] = [nd.op for nd in path.nodes if not self._jit[nd.position]]
        return out

    @property
    def sliceable(self) -> bool:
        return not any(nd.op.batch_wide for nd in self.jit_nodes)

    def state_of(self, op: Any) -> State:
        """The declared output state of ``op`` (for tests and diagnostics)."""
        for nd in self.nodes:
            if nd.op is op:
                return self._states[nd.position]
        raise KeyError(op)

    def fn_of(self, op: Any) -> Callable[..., Any]:
        """The function (compiled or not) that runs ``op``."""
        for nd in self.nodes:
            if nd.op is op:
                return self._fns[nd.position]
        raise KeyError(op)

    def seed_keys(self, seed: int, epoch: int) -> NDArray[np.uint64]:
        """``derive_seed_key(seed, epoch, position)`` for every op position, as ``uint64``.

        All zeros when no op asks for a seed (``with_seed``), so plans without random ops do not
        depend on the rng module.
        """
        if not any(getattr(f, "with_seed", False) for f in self._fns.values()):
            return np.zeros(len(self.nodes), dtype=np.uint64)
        from beton_serve.pipeline.rng import derive_seed_key

        return np.array(
            [int(derive_seed_key(seed, epoch, nd.position)) for nd in self.nodes], dtype=np.uint64
        )

    # -- running -------------------------------------------------------------------------
    @property
    def workspace_bytes(self) -> int:
        """Bytes of the buffers one running batch needs (:class:`Workspace`): the ops' output and
        scratch memory at ``batch_size``, and their shared memory."""
        total = 0
        for node in self.jit_nodes:
            q = self._alloc[node.position]
            for x in q if isinstance(q, list) else [q]:
                if x is not None:
                    total += _query_bytes(x, self.batch_size)
            sq = self._shared_alloc.get(node.position)
            if sq is not None:
                total += _query_bytes(sq, None)
        return total

    def acquire_workspace(self) -> Workspace:
        """A workspace for one batch; give it back with :meth:`release_workspace`."""
        with _FREE_SETS:
            if self._holders:
                ws = _FREE_SETS.take(self._layout)
                if ws is not None:
                    return ws
            elif self._free:
                return self._free.pop()
        return Workspace(self)

    def release_workspace(self, ws: Workspace) -> None:
        """Give back a workspace from :meth:`acquire_workspace`: kept for the next batch of a
        plan of its layout while a source holds one (or, for a plan no source ever held, in its
        own free list), else freed."""
        gone: list[Workspace] = []  # freed on return, outside the lock
        with _FREE_SETS:
            if ws.layout != self._layout:  # allocated before a refresh changed a buffer
                return
            if self._holders:
                gone = _FREE_SETS.put(self._layout, [ws])  # noqa: F841 (freed on return)
            elif not self._held:
                self._free.append(ws)

    def hold(self) -> None:
        """A source that runs this plan opened: keep released workspaces for reuse (shared
        with the held plans of the same layout) until the last such source calls
        :meth:`unhold`."""
        with _FREE_SETS:
            self._holders += 1
            self._held = True
            _FREE_SETS.hold(self._layout)
            own, self._free = self._free, []
            gone = _FREE_SETS.put(self._layout, own) if own else []  # noqa: F841 (freed on return)

    def unhold(self) -> None:
        """A source from :meth:`hold` closed. When no held plan of this layout is left, its
        free workspaces are freed (a batch still running frees its own when it ends)."""
        with _FREE_SETS:
            if not self._holders:
                return
            self._holders -= 1
            gone = _FREE_SETS.unhold(self._layout)  # noqa: F841 (freed on return, unlocked)

    def drop_workspaces(self) -> None:
        """Free the workspaces a plan no source holds keeps (e.g. after a precompile's one
        batch); a held plan's are shared with its layout and stay."""
        with _FREE_SETS:
            gone, self._free = self._free, []  # noqa: F841 (freed on return, unlocked)

    def op_times(self) -> dict[str, tuple[float, int]]:
        """``{op name: (seconds, runs)}``: wall time each jit op spent in :meth:`run`, summed
        over every run (a run is one batch or one slice of it). Thread-safe; for metrics."""
        with self._lock:
            return {k: (float(v[0]), int(v[1])) for k, v in self._op_time.items()}

    def run(
        self,
        ws: Workspace,
        batch_indices: NDArray[np.uint64],
        seed_keys: NDArray[np.uint64],
        outs: Sequence[np.ndarray] | None = None,
    ) -> list[np.ndarray]:
        """Run the jit prefix for ``batch_indices`` (at most ``batch_size`` of them).

        Args:
            ws: a workspace of the plan's current layout, owned by the caller.
            batch_indices: the sample ids of the batch (``uint64``, C-contiguous).
            seed_keys: from :meth:`seed_keys` for this epoch.
            outs: destinations, one per output, each at least ``(len(batch_indices), *shape)``;
                ``None`` returns views of workspace buffers (valid until ``ws`` is reused).

        Returns:
            One array per output: ``outs[i][:n]`` (or a workspace view).

        Raises:
            OpFailure: an op raised; ``node`` says which (the engine adds the sample).
        """
        n = len(batch_indices)
        if n > self.batch_size:
            raise PipelineError(
                f"a batch of {n} samples exceeds the plan's batch_size {self.batch_size}"
            )
        # -- sample check (issue 11): the checksum sidecar, before any decoder reads the bytes.
        # A mismatch fails like an op, so BatchSource's bad-sample budget applies to it.
        if self.sample_check is not None:
            try:
                self.sample_check(batch_indices)
            except BetonError as exc:
                raise OpFailure(_SAMPLE_CHECK, exc) from exc
        # -- end of sample check
        results: dict[int, Any] = {}
        direct = self._direct_outputs(outs)
        passed: dict[int, Any] = {}  # the destination each op was given
        timed: list[tuple[str, float]] = []
        clock = time.perf_counter
        storage_state = self._storage_state
        for step in self._steps:
            node, pos, fn, parent, metadata, with_indices, with_seed, name, over, mirror, copy = (
                step
            )
            if mirror is _ABSORBED:  # its decoder wrote its result (see _mirror_fusions)
                results[pos] = passed[pos] = results[over]
                timed.append((name, 0.0))
                continue
            buf = direct.get(pos)
            if buf is not None:
                dst = buf[:n]
            elif over is not None and results[over] is passed[over]:
                dst = results[over]  # in place: the parent returned the buffer it was given
            else:
                dst = _slice(ws.buffer(pos), n)
            passed[pos] = dst
            try:
                if mirror is not None:
                    mirrored, mask_of, flip_pos = mirror
                    mask = mask_of(batch_indices, seed_keys[flip_pos])
                    t0 = clock()
                    results[pos] = mirrored(batch_indices, dst, metadata, storage_state, mask)
                    timed.append((name, clock() - t0))
                    continue
                if parent is None:
                    args: list[Any] = [batch_indices, dst, metadata, storage_state]
                else:
                    src = results[parent]
                    if copy and isinstance(src, np.ndarray):  # see _copies_input
                        src = src.copy()
                    args = [src, dst]
                    if with_indices:
                        args.append(batch_indices)
                if with_seed:
                    args.append(seed_keys[pos])
                if pos in ws.shared:
                    init = self._shared_fns.get(pos)
                    if init is not None:
                        if getattr(init, "with_indices", False):
                            init(ws.shared[pos], batch_indices)
                        else:
                            init(ws.shared[pos])
                    args.append(ws.shared[pos])
                t0 = clock()
                results[pos] = fn(*args)
                timed.append((name, clock() - t0))
            except Exception as exc:
                raise OpFailure(node, exc) from exc
        with self._lock:
            for name, sec in timed:
                acc = self._op_time.setdefault(name, [0.0, 0])
                acc[0] += sec
                acc[1] += 1
        out_arrays = []
        for i, (leaf_pos, _, _, _, head) in enumerate(self._outputs_static):
            res = results[leaf_pos]
            if outs is None:
                out_arrays.append(res)
                continue
            mine = direct.get(head)
            if mine is outs[i] and res is passed[leaf_pos] is passed[head]:
                out_arrays.append(res)  # written into the destination (in place from the head)
                continue
            dst = outs[i][:n]
            if not (isinstance(res, np.ndarray) and same_array(res, dst)):
                try:
                    np.copyto(dst, res, casting="no")
                except (ValueError, TypeError) as exc:  # not what the op declared
                    raise self._undeclared_output(leaf_pos, res, dst, exc) from exc
            out_arrays.append(dst)
        return out_arrays

    def _undeclared_output(self, pos: int, res: Any, dst: np.ndarray, exc: Exception) -> OpFailure:
        """The failure of the op at ``pos`` whose batch is not the shape or dtype it declared
        (named, as a failure of that op, instead of numpy's bare copy error)."""
        node = next(nd for nd in self.nodes if nd.position == pos)
        got = f"{getattr(res, 'shape', '?')} {getattr(res, 'dtype', type(res).__name__)}"
        return OpFailure(
            node,
            ValueError(
                f"it returned a batch of {got}, but declared {dst.shape} {dst.dtype} in "
                f"declare_state_and_memory ({exc})"
            ),
        )

    def _build_steps(self) -> list[tuple[Any, ...]]:
        """What :meth:`run` calls, in order, with what only a declaration or a compile
        changes: ``(node, position, fn, parent position or None, the field's metadata for a
        decoder, fn.with_indices, fn.with_seed, the op's name, the position of the op whose
        buffer it may work on in place or None, a fusion, whether its input is copied first
        (:meth:`_copies_input`))`` (read once here, not per batch: those lookups were a
        measurable share of a small batch's time)."""
        fusions = self._mirror_fusions()
        absorbed = {flip_pos for _, _, flip_pos in fusions.values()}
        steps = []
        for node in self.jit_nodes:
            fn = self._fns[node.position]
            over = self._inplace_parent(node)
            steps.append(
                (
                    node,
                    node.position,
                    fn,
                    None if node.parent is None else node.parent.position,
                    self._metadata[node.field_name] if node.parent is None else None,
                    bool(getattr(fn, "with_indices", False)),
                    bool(getattr(fn, "with_seed", False)),
                    type(node.op).__name__,
                    None if over is None else over.position,
                    _ABSORBED if node.position in absorbed else fusions.get(node.position),
                    self._copies_input(node),
                )
            )
        return steps

    def _copies_input(self, node: Node) -> bool:
        """Whether ``node`` gets a copy of its input: its op declares no buffer (FFCV's
        contract for an op that writes its input and returns it: ``Cutout``, the colour
        jitters, ``RandomTranslate``, ``Poison``, ``ReplaceLabel``, many custom ops), and
        something else reads that input too: a sibling (``PipelineSpec(source=...)`` of the
        same op) or an output that ends there. Without the copy each view got the other's
        augmentation too (two branches of one decode came out identical; a branch's ``Cutout``
        drew its squares into the trunk's output), as in FFCV 1.0.2."""
        parent = node.parent
        if parent is None or self._alloc[node.position] is not None:
            return False
        return len(parent.children) > 1 or any(
            self._jit_leaf(path) is parent for path in self.paths
        )

    def _mirror_fusions(self) -> dict[int, tuple[Callable[..., Any], Callable[..., Any], int]]:
        """Decoders that take the place of the flip after them: ``{decoder position: (its
        mirrored function, the flip's mask function, the flip's position)}``.

        A decoder whose function offers a ``mirrored`` variant (``f(batch_indices, dst,
        metadata, storage_state, mask)``: the images of ``mask`` written mirrored along W; the
        raw ``SimpleRGBImageDecoder`` of a file whose allocations hold whole images), followed
        by a flip whose function offers its draws (``mirror_mask(batch_indices, seed_key)``:
        ``RandomHorizontalFlip``) and that works in place over the decoder's buffer (:meth:`_inplace_parent`: nothing else reads the
        unflipped images). The two then run as one pass that writes each image once, flipped
        or not: the flip's own pass re-read and re-wrote every image it flipped, the largest
        share of a CIFAR-sized batch's cost, and more in the daemon, whose ring slots are cold
        (issue 15 §3). The pixels are the same (``tests/unit/test_mirror_fusion.py``); the
        flip's time is counted in the decoder's (:meth:`op_times`).
        """
        fusions: dict[int, tuple[Callable[..., Any], Callable[..., Any], int]] = {}
        if not self._fuse_mirror:
            return fusions
        for node in self.jit_nodes:
            parent = self._inplace_parent(node)
            if parent is None or parent.parent is not None:
                continue
            mirrored = getattr(self._fns[parent.position], "mirrored", None)
            mask_of = getattr(self._fns[node.position], "mirror_mask", None)
            if mirrored is None or mask_of is None:
                continue
            fusions[parent.position] = (Compiler.compile(mirrored), mask_of, node.position)
        return fusions

    def _static_outputs(self) -> list[tuple[int, bool, tuple[int, ...], np.dtype[Any], int]]:
        """What :meth:`run` needs of each output that only a declaration changes: its leaf,
        whether the output may be written straight into the caller's destination, its shape and
        dtype, and the op that is given that destination (the head).

        The head is the leaf, or, when the leaf ends a chain of ``inplace`` ops, the op before
        the chain (:meth:`_inplace_parent`): it writes the destination and the chain works on it
        in place. Direct writing needs that no other jit op reads the leaf's buffer and that the
        leaf's allocation is exactly its output state (then so is every chain op's)."""
        static = []
        for path in self.paths:
            leaf = self._leaf(path)
            q = self._alloc[leaf.position]
            st = self._states[leaf.position]
            ok = (
                not any(self._jit[c] for c in leaf.children)
                and isinstance(q, AllocationQuery)
                and q.shape == st.shape
                and np.dtype(q.dtype) == np.dtype(st.dtype)
            )
            shape = tuple(q.shape) if isinstance(q, AllocationQuery) else ()
            dtype = np.dtype(q.dtype) if isinstance(q, AllocationQuery) else np.dtype(np.uint8)
            head = leaf
            # each link allocates what its child does (_inplace_parent), so the head allocates
            # exactly the output state too
            while ok and (parent := self._inplace_parent(head)) is not None:
                head = parent
            static.append((leaf.position, ok, shape, dtype, head.position))
        return static

    def _inplace_parent(self, node: Node) -> Node | None:
        """The jit op whose buffer ``node`` may work on in place: ``node``'s parent, when
        ``node``'s op is ``inplace``, the parent is a jit op, nothing else reads the parent's
        buffer (``node`` is its only child, and no output ends at it: a branch,
        ``PipelineSpec(source=parent)``, reads it too), and both allocate one buffer of the same
        shape and dtype."""
        parent = node.parent
        if parent is None or not node.op.inplace or not self._jit[parent.position]:
            return None
        if parent.children != [node.position]:
            return None
        if any(self._jit_leaf(path) is parent for path in self.paths):
            return None
        q, pq = self._alloc[node.position], self._alloc[parent.position]
        if not isinstance(q, AllocationQuery) or not isinstance(pq, AllocationQuery):
            return None
        if tuple(q.shape) != tuple(pq.shape) or np.dtype(q.dtype) != np.dtype(pq.dtype):
            return None
        return parent

    def _direct_outputs(self, outs: Sequence[np.ndarray] | None) -> dict[int, np.ndarray]:
        """The outputs' head ops (:meth:`_static_outputs`) that write straight into the caller's
        destination."""
        if outs is None:
            return {}
        direct: dict[int, np.ndarray] = {}
        for i, (_, ok, shape, dtype, head) in enumerate(self._outputs_static):
            o = outs[i]
            # one destination per head: two outputs that end at one op (branches from it) are
            # both its result, and the second is copied into its own destination
            if ok and head not in direct and o.dtype == dtype and o.shape[1:] == shape:
                if o.flags.c_contiguous:
                    direct[head] = o
        return direct


def _spec_key(paths: list[OutputPath]) -> Any:
    parts = []
    for path in paths:
        ops = []
        for nd in path.nodes:
            try:
                params = json.dumps(nd.op.spec_params(), sort_keys=True, default=str)
            except NotImplementedError:
                return None
            ops.append((type(nd.op).__module__, type(nd.op).__qualname__, nd.field_name, params))
        parts.append((path.name, path.own_start, tuple(ops)))
    return tuple(parts)


def compile_pipelines(
    reader: Any,
    pipelines: Mapping[str, Sequence[Any] | PipelineSpec | None],
    *,
    batch_size: int,
    custom_fields: Mapping[str, Any] | None = None,
    cache: PlanCache | None = None,
    sample_check: Callable[[NDArray[np.uint64]], None] | None = None,
) -> Plan:
    """Plan and compile FFCV-style ``pipelines`` over ``reader``.

    Args:
        reader: a ``BetonReader`` (see CONTRACTS.md).
        pipelines: ``{output name: [ops] | PipelineSpec | None}`` with FFCV's semantics.
        batch_size: the largest batch the plan's buffers hold.
        custom_fields: the ``custom_fields`` the reader was opened with; their names must exist.
        cache: share compiled functions with other plans of the same file and pipelines.
        sample_check: becomes :attr:`Plan.sample_check` (e.g. ``ChecksumVerifier.check``): run
            on every batch's sample ids before decoding; what it raises fails those samples.

    Raises:
        SpecError: the pipelines are invalid; the message names the op and what to change.
    """
    for name in custom_fields or {}:
        if name not in reader.handlers:
            raise SpecError(f"custom_fields[{name!r}]: the file has no field {name!r}")
    paths, nodes = build_graph(list(reader.field_names), reader.handlers, pipelines)
    key = None
    if cache is not None:
        spec = _spec_key(paths)
        # The file itself, not its path: the generated functions close over the file's columns
        # (a JPEG decoder reads each sample at the pointer its metadata gave), so the functions
        # of another file at the same path (a relative path from another directory, a file
        # rewritten) read this one's bytes at that file's offsets. A reader that cannot say
        # which file it is gets nothing cached.
        identity = getattr(reader, "identity", None)
        if spec is not None and identity is not None:
            key = (identity, reader.schema_key(), spec)
    plan = Plan(reader, paths, nodes, batch_size=batch_size, cache=cache, cache_key=key)
    plan.sample_check = sample_check
    return plan
