"""The client side of each output: the ops the client runs on a received batch, as FFCV runs them.

Data structure. An :class:`OutputTail` is a list of steps built once per stream. Each step is
one op and what it needs to run: its function, the buffers it asked for, whether it is compiled.
Building it walks the ops as ``beton_serve.pipeline`` plans them in process:

* a :class:`State` (``jit_mode``, ``device``, ``shape``, ``dtype``) starts from the daemon's
  output spec (a numpy array on the CPU, ``jit_mode=True``) and is carried through each op's
  ``declare_state_and_memory``. Ops change it with :func:`dataclasses.replace`, so this dataclass
  (same field names as ``beton_serve.pipeline.State``) stands in for the server's;
* each ``AllocationQuery`` (per-sample ``shape``, ``dtype``, ``device``) becomes one buffer with
  the batch dimension added, on the declared device, reused for every batch (so, as in process,
  a tail's output is valid until the next batch);
* an op whose output state is still in jit mode, and whose input was, is compiled with Numba
  (``_local_jit``) unless its function says ``python = True``. That is the *local stage* of
  route c (docs/custom-ops.md): the daemon handed the op back. Every other op's function runs as
  plain Python on torch tensors (FFCV's non-jit stage);
* functions are called ``f(inp, dst[, batch_indices][, seed_key][, shared])``, with
  ``batch_indices`` the batch's sample ids (``uint64``) when ``f.with_indices``, and ``seed_key``
  = ``derive_seed_key(seed, epoch, position)`` when ``f.with_seed``: the op's position in the
  in-process graph, so draws equal the in-process Loader's.

The built-in conversion ops (``ToTensor``, ``ToDevice``, ``ToTorchImage``, ``Convert``, ``Squeeze``,
``View``) and the ops the daemon describes (``SpecOp``) run through ``_ops``' torch
implementations, which avoid a buffer copy per batch (``ToTorchImage`` is a view, ``ToDevice``
pins once). ``tests/unit/test_client_tail.py`` checks that they equal the ops' own
``generate_code`` bit for bit. ``NormalizeImage`` and every other op run their own
``generate_code``. torch modules and other callables are called on the batch.

Threading: built and called from the thread that iterates the Loader.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from beton_client._ops import (
    CLIENT_IMPLEMENTED,
    LOCAL_MARKER,
    PipelinePlan,
    SpecOp,
    _op_name,
    build_tail,
)
from beton_client._torch import import_torch, torch_if_installed
from beton_client.errors import PipelineError, SpecError, TransportError

__all__ = [
    "OutputInfo",
    "OutputTail",
    "State",
    "build_output_tails",
    "output_positions",
    "wire_dtype",
]


def wire_dtype(code: int) -> str:
    """The numpy name of an output's wire dtype (``beton_wire.slots.dtype_name``).

    Raises:
        TransportError: a dtype this client does not know (a daemon of a newer release).
    """
    from beton_wire.slots import dtype_name

    try:
        return dtype_name(code)
    except ValueError as exc:
        raise TransportError(str(exc)) from None


log = logging.getLogger("beton_client")

#: (output, op class) pairs whose route-c cost was logged (once per process each).
_LOGGED: set[tuple[str, str]] = set()


@dataclass(frozen=True, slots=True)
class OutputInfo:
    """One output as a backend produces it, before the client tail.

    Attributes:
        name: the output's name.
        shape: per-sample shape.
        dtype: numpy dtype name.
        client_ops: ops the backend leaves to the tail before the user's (a default pipeline's
            ``ToTensor``): ``SpecOp``s from a daemon, op objects in process. A first ``SpecOp``
            named ``@local`` says the daemon handed the user's ops back from ``from`` (route c).
        positions: the graph position of each op the tail runs (``client_ops``, then the
            user's), when the backend knows them (in process); else they are derived from the
            pipelines as the daemon's graph numbers them (:func:`output_positions`).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    client_ops: tuple[Any, ...] = ()
    positions: tuple[int, ...] | None = None

    @classmethod
    def from_wire(cls, msg: Any) -> OutputInfo:
        """From a ``beton_wire.v1.OutputSpec``."""
        return cls(
            msg.name,
            tuple(int(d) for d in msg.shape),
            wire_dtype(msg.dtype),
            tuple(SpecOp.from_wire(op) for op in msg.client_ops),
        )


@dataclass
class State:
    """Shape, dtype and device of a per-sample value (the fields of
    ``beton_serve.pipeline.State``, which ops change with :func:`dataclasses.replace`)."""

    jit_mode: bool
    device: Any
    shape: tuple[int, ...] | None
    dtype: Any


def _is_torch_dtype(dtype: Any) -> bool:
    return type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype"


def _queries(alloc: Any, where: str) -> list[Any] | Any:
    if not alloc:  # None, or a falsy non-query such as FFCV ops' 0
        return None
    if isinstance(alloc, tuple | list):
        return list(alloc)
    if hasattr(alloc, "shape") and hasattr(alloc, "dtype"):
        return alloc
    raise SpecError(f"{where}: declare_state_and_memory returned {alloc!r} as its allocation")


def _empty(q: Any, batch: int | None) -> Any:
    shape = tuple(q.shape) if batch is None else (batch, *q.shape)
    if _is_torch_dtype(q.dtype):
        torch = import_torch()
        return torch.empty(shape, dtype=q.dtype, device=q.device or "cpu")
    return np.empty(shape, dtype=q.dtype)


def _buffers(q: Any, batch: int) -> Any:
    if q is None:
        return None
    if isinstance(q, list):
        return [_empty(x, batch) for x in q]
    return _empty(q, batch)


def _slice(buf: Any, n: int) -> Any:
    if buf is None:
        return None
    if isinstance(buf, list):
        return tuple(b[:n] for b in buf)
    return buf[:n]


@dataclass
class _Step:
    name: str
    fn: Callable[..., Any]
    #: ``"ffcv"``: ``fn(inp, dst, ...)``; ``"call"``: ``fn(x)`` (built-in fast path, callable).
    kind: str
    position: int | None = None
    jit: bool = False
    buf: Any = None
    shared: Any = None
    init_shared: Callable[..., Any] | None = None
    #: Set after the first successful call (a jit op's first call compiles it).
    ran: bool = False


def _declare(op: Any, state: State, where: str) -> tuple[State, Any]:
    try:
        new, alloc = op.declare_state_and_memory(state)
    except SpecError:
        raise
    except Exception as exc:
        # The server's SpecError (and others) become the client's, naming the op.
        raise SpecError(
            f"{where} rejected its input {state}: {type(exc).__name__}: {exc}"
        ) from None
    if not all(hasattr(new, f) for f in ("jit_mode", "device", "shape", "dtype")):
        raise SpecError(f"{where}: declare_state_and_memory must return (State, allocation)")
    return new, alloc


def _spec_state(op: Any, state: State) -> State:
    """The state after a built-in op known only by name (a :class:`SpecOp` from the daemon)."""
    if op.spec_name == "ToTensor" and state.jit_mode:
        try:
            torch = import_torch()
            dtype = torch.from_numpy(np.empty(0, dtype=state.dtype)).dtype
        except (ImportError, TypeError):
            dtype = state.dtype
        return State(jit_mode=False, device=state.device, shape=state.shape, dtype=dtype)
    return dataclasses.replace(state, jit_mode=False)


def _on_torch(op: Any) -> bool:
    """Whether ``op`` runs on torch tensors here: a conversion op (built in, or named by the
    daemon), a torch module or another callable (FFCV's non-jit stage)."""
    return isinstance(op, SpecOp) or _op_name(op) in CLIENT_IMPLEMENTED or not _has_ffcv_api(op)


class OutputTail:
    """The client-side ops of one output (see the module docstring). Call it on each batch.

    Args:
        output: the output's name (for errors and logs).
        shape, dtype: the daemon's output spec (per sample; numpy dtype).
        ops: the ops to run, in order: the daemon's ``client_ops`` (``SpecOp``), then the user's.
        positions: each op's position in the in-process graph (``None`` when it draws no seed).
        batch_size: the largest batch (buffers are allocated for it).
        why: the daemon's reasons for handing ops back (route c), logged once.
        builtin_fast_path: run the built-in conversion ops through ``_ops``' torch
            implementations (``False``: through their own ``generate_code``, as in process).

    Raises:
        SpecError: an op rejected its input state, or a local (Numba) op cannot be compiled.
    """

    def __init__(
        self,
        output: str,
        shape: Sequence[int],
        dtype: Any,
        ops: Sequence[Any],
        positions: Sequence[int | None],
        *,
        batch_size: int,
        why: Sequence[str] = (),
        builtin_fast_path: bool = True,
    ) -> None:
        self.output = output
        self.why = list(why)
        self.steps: list[_Step] = []
        self._keys: tuple[int, int, list[Any]] | None = None  # (seed, epoch, keys by step)
        state = State(jit_mode=True, device="cpu", shape=tuple(shape), dtype=np.dtype(dtype))
        local: list[str] = []
        if any(_on_torch(op) for op in ops):
            # Before any op's own code imports it: off this stack (beton_client._torch).
            with contextlib.suppress(ImportError):  # the op that needs it says so below
                torch_if_installed()
        for op, pos in zip(ops, positions, strict=True):
            name = _op_name(op)
            where = f"{type(op).__name__} (pipeline {output!r})"
            # NormalizeImage runs its own code (as in process: a contiguous NCHW output into a
            # reused buffer), unless the daemon named it (a SpecOp has no code here).
            fast = isinstance(op, SpecOp) or (
                builtin_fast_path and name in CLIENT_IMPLEMENTED and name != "NormalizeImage"
            )
            if fast or not _has_ffcv_api(op):
                if isinstance(op, SpecOp):
                    new = _spec_state(op, state)
                elif _has_ffcv_api(op):
                    new, _ = _declare(op, state, where)
                else:
                    new = dataclasses.replace(state, jit_mode=False)  # a module: state unchanged
                (impl,) = build_tail([op])
                self.steps.append(_Step(name, impl, "call", pos))
                state = new
                continue
            new, alloc = _declare(op, state, where)
            jit = bool(new.jit_mode) and bool(state.jit_mode)
            q = _queries(alloc, where)
            # As in process, only compiled ops get a shared buffer (``Workspace``).
            shared_q = (
                op.declare_shared_memory(state)
                if jit and hasattr(op, "declare_shared_memory")
                else None
            )
            fn = op.generate_code()
            if not callable(fn):
                raise SpecError(f"{where}: generate_code() must return a function, got {fn!r}")
            if jit:
                local.append(f"{type(op).__module__}.{type(op).__qualname__}")
                if not getattr(fn, "python", False):
                    from beton_client._local_jit import compile_op

                    fn = compile_op(fn, where)
            init = op.generate_code_for_shared_state() if shared_q is not None else None
            self.steps.append(
                _Step(
                    name,
                    fn,
                    "ffcv",
                    pos,
                    jit,
                    _buffers(q, batch_size),
                    None if shared_q is None else _empty(shared_q, None),
                    init,
                )
            )
            state = new
        self.state = state
        #: The per-batch fast path (checked in ``tests/unit/test_client_tail.py``): when every
        #: step is a plain call (the built-in conversions, modules), a batch needs neither its
        #: ids nor seed keys, so ``__call__`` only chains the calls.
        self._calls: tuple[_Step, ...] | None = (
            tuple(self.steps) if all(st.kind == "call" for st in self.steps) else None
        )
        if local:
            key = (output, ",".join(local))
            if key not in _LOGGED:
                _LOGGED.add(key)
                log.warning(
                    "pipeline %r: %s run(s) in this process, compiled here with Numba, on the "
                    "received batch (%s). Cost: the first batch waits for the compilation, and "
                    "every batch is decoded in the daemon but augmented by this process's "
                    "thread, on its CPU time. To run it in the daemon, move the op into a module "
                    "the daemon can import, with JSON-safe constructor arguments, or load it as "
                    "a plugin (docs/custom-ops.md)",
                    output,
                    ", ".join(local),
                    "; ".join(why) or "the daemon handed it back",
                )

    def _seed_keys(self, seed: int, epoch: int) -> list[Any]:
        if self._keys is not None and self._keys[:2] == (seed, epoch):
            return self._keys[2]
        keys: list[Any] = []
        for step in self.steps:
            if step.kind == "ffcv" and getattr(step.fn, "with_seed", False):
                if step.position is None:
                    raise SpecError(f"{step.name} draws random numbers but has no position")
                from beton_client._local_jit import seed_key

                keys.append(seed_key(seed, epoch, step.position))
            else:
                keys.append(None)
        self._keys = (seed, epoch, keys)
        return keys

    def __call__(self, x: Any, batch_indices: np.ndarray, epoch: int, seed: int) -> Any:
        """Run every step on batch ``x`` (``batch_indices``: its sample ids) of ``epoch``.

        Raises:
            PipelineError: an op raised; the message names it.
        """
        calls = self._calls
        if calls is not None:
            step = None
            try:
                for step in calls:
                    x = step.fn(x)
            except (SpecError, PipelineError):
                raise
            except Exception as exc:
                name = "?" if step is None else step.name
                raise PipelineError(
                    f"{name} (pipeline {self.output!r}, run in this process): "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            return x
        n = int(x.shape[0]) if hasattr(x, "shape") else len(batch_indices)
        ids = np.ascontiguousarray(batch_indices, dtype=np.uint64)
        keys = self._seed_keys(seed, epoch)
        for step, key in zip(self.steps, keys, strict=True):
            try:
                if step.kind == "call":
                    x = step.fn(x)
                    continue
                if step.jit and not isinstance(x, np.ndarray):
                    x = np.asarray(x)  # a CPU tensor or buffer view from the transport
                args: list[Any] = [x, _slice(step.buf, n)]
                if getattr(step.fn, "with_indices", False):
                    args.append(ids)
                if key is not None:
                    args.append(key)
                if step.shared is not None:
                    if step.init_shared is not None:
                        if getattr(step.init_shared, "with_indices", False):
                            step.init_shared(step.shared, ids)
                        else:
                            step.init_shared(step.shared)
                    args.append(step.shared)
                x = step.fn(*args)
                step.ran = True
            except (SpecError, PipelineError):
                raise
            except Exception as exc:
                if step.jit and not step.ran and _is_compile_error(exc):
                    # Numba compiles on the first call: a handed-back op that cannot compile
                    # here can run nowhere.
                    raise SpecError(
                        f"pipeline {self.output!r}: {step.name} can run nowhere. In the daemon: "
                        f"{'; '.join(self.why) or 'it was handed back'}. In this process: numba "
                        f"could not compile it: {type(exc).__name__}: {exc}"
                    ) from None
                raise PipelineError(
                    f"{step.name} (pipeline {self.output!r}, run in this process): "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        return x


def _is_compile_error(exc: BaseException) -> bool:
    """A Numba typing/lowering error (raised by a dispatcher's first call), by its module."""
    return type(exc).__module__.startswith("numba")


def _has_ffcv_api(op: Any) -> bool:
    return callable(getattr(op, "generate_code", None)) and callable(
        getattr(op, "declare_state_and_memory", None)
    )


def output_positions(
    plans: Sequence[PipelinePlan], outputs: Sequence[str]
) -> dict[str, tuple[int, int]]:
    """``{output: (position of its root node, position of user_ops[0])}`` in the daemon's graph.

    The graph is the in-process one (``beton_serve.pipeline._graph``): outputs in order, each
    its root decoder then its ops, depth-first; a pipeline not sent, or sent empty, is
    ``[decoder, ToTensor]``; one whose first op is no decoder gets the default one prepended.
    A branch (``PipelineSpec(source=<op>)``) has no root of its own: its ops are numbered in the
    first pass over the outputs after the one that numbered the pipeline holding its source op
    (as ``build_graph`` defers it), and its root is the source op. The tail travels as
    placeholders, so the daemon's positions are these.
    """
    by_name = {p.name: p for p in plans if not p.skip}
    out: dict[str, tuple[int, int]] = {}
    base = 0
    pending = list(outputs)
    while pending:
        rest = []
        for name in pending:
            p = by_name.get(name)
            if p is not None and p.branch_of:
                src = out.get(p.branch_of)
                if src is None:
                    rest.append(name)
                    continue
                out[name] = (src[1] + p.branch_op, base)
                base += len(p.user_ops)
                continue
            if p is None or not p.user_ops:
                out[name] = (base, base + 1)
                base += 2
                continue
            first = base if p.decoder_given else base + 1
            out[name] = (base, first)
            base = first + len(p.user_ops)
        if len(rest) == len(pending):
            raise SpecError(f"pipelines {rest} branch from ops no other pipeline holds")
        pending = rest
    return out


def build_output_tails(
    outputs: Sequence[OutputInfo], plans: Sequence[PipelinePlan], batch_size: int
) -> list[OutputTail]:
    """One :class:`OutputTail` per output of a backend (:class:`OutputInfo`).

    An output's ops are the daemon's ``client_ops`` (e.g. a default pipeline's ``ToTensor``),
    then the user's ops from where the daemon stopped: its tail, or, when the daemon handed ops
    back (an ``@local`` marker, route c), ``user_ops[from:]``.

    Raises:
        SpecError: as :class:`OutputTail`; when route c cannot run either, the message also gives
            the daemon's reasons (the op can run nowhere).
    """
    by_name: Mapping[str, PipelinePlan] = {p.name: p for p in plans}
    names = [o.name for o in outputs]
    positions = output_positions(plans, names)
    tails = []
    for o in outputs:
        spec_ops = list(o.client_ops)
        why: list[str] = []
        p = by_name.get(o.name)
        user: list[Any] = list(p.tail) if p is not None else []
        start = p.boundary if p is not None else 0
        if spec_ops and isinstance(spec_ops[0], SpecOp) and spec_ops[0].spec_name == LOCAL_MARKER:
            marker = spec_ops.pop(0).spec_params()
            start = int(marker.get("from", 0))
            why = [str(w) for w in marker.get("why", [])]
            user = list(p.user_ops[start:]) if p is not None else []
        root, first = positions[o.name]
        pos: list[int | None] = [root + 1 + i for i in range(len(spec_ops))]
        pos += [first + start + i for i in range(len(user))]
        if o.positions is not None:
            if len(o.positions) != len(pos):
                raise SpecError(
                    f"pipeline {o.name!r}: {len(o.positions)} tail positions for {len(pos)} ops"
                )
            pos = list(o.positions)
        try:
            tails.append(
                OutputTail(
                    o.name,
                    o.shape,
                    o.dtype,
                    [*spec_ops, *user],
                    pos,
                    batch_size=batch_size,
                    why=why,
                )
            )
        except SpecError as exc:
            if not why:
                raise
            raise SpecError(
                f"pipeline {o.name!r}: an op can run nowhere. In the daemon: {'; '.join(why)}. "
                f"In this process: {exc}"
            ) from None
    return tails
