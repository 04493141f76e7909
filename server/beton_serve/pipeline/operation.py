"""The ``Operation`` contract (mirrors ``ffcv.pipeline.operation``).

An op is planned once and compiled once:

1. ``accept_field(field)`` and ``accept_globals(metadata, memory_read)`` are called on decoders
   (and on any op that is first in a pipeline) before planning.
2. ``declare_state_and_memory(previous_state) -> (state, allocation)`` says what comes out and what
   per-sample memory the op needs. The planner allocates ``(batch_size, *shape)`` buffers.
3. ``generate_code()`` returns the per-batch function (not its result). Attributes on that
   function change how it is called:

   * decoders: ``f(batch_indices, dst, metadata, storage_state[, seed_key]) -> output``;
   * transforms: ``f(inp, dst[, batch_indices][, seed_key][, shared_memory]) -> output``;
   * ``f.with_indices = True``: also receive ``batch_indices``, the dataset sample ids of the
     batch (``uint64``), in batch order;
   * ``f.with_seed = True`` (beton-serve extension): also receive ``seed_key``, a ``uint64``
     that is a pure function of (loader seed, epoch, op position). Random draws made as a pure
     function of ``(seed_key, sample_id, draw_number)`` are reproducible whatever the worker
     count or thread timing (see :mod:`beton_serve.pipeline.rng`);
   * ``f.python = True`` (beton-serve extension): the function is plain Python that releases
     the GIL itself (e.g. JPEG decoding through libjpeg-turbo) and must not be Numba-compiled,
     even though the op's output state is in jit mode.

   An op whose output state has ``jit_mode=True`` is Numba-compiled (``nopython``, ``nogil``);
   an op whose output state is not in jit mode runs as Python on torch tensors.

beton-serve streams pipelines over the wire as data, so every built-in op also has a registered
``spec_name`` and JSON-safe ``spec_params()``; ``beton_serve.pipeline.registry`` rebuilds ops from
them. A user's op needs neither (docs/custom-ops.md): every subclass's constructor records its
arguments when they are JSON-safe (:meth:`Operation.import_spec`), so that a daemon allowed to
import the op's module from its own disk can rebuild it; otherwise the client runs it.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

from beton_serve.pipeline.allocation_query import Allocation
from beton_serve.pipeline.state import State

__all__ = ["Operation", "same_array"]


def same_array(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are one array: the same object, or views with the same data
    pointer, shape and strides (what an ``inplace`` op checks of its input and destination, and
    the planner of an op's result and the caller's destination)."""
    return a is b or (
        hasattr(a, "ctypes")
        and hasattr(b, "ctypes")
        and a.shape == b.shape
        and a.strides == b.strides
        and a.ctypes.data == b.ctypes.data
    )


class Operation(ABC):
    """Base class of every pipeline op: decoders, transforms and user-defined ops.

    Subclasses implement :meth:`generate_code` and :meth:`declare_state_and_memory`. Ports of FFCV
    ops need no other change than their imports.
    """

    #: Registered wire name of a built-in or plugin op (``None`` for unregistered user ops).
    spec_name: ClassVar[str | None] = None
    #: Traits the planner reads (declared by the op class, never inferred from its name):
    #: ``torch_op``: runs on torch tensors only, so it must come after ``ToTensor()``;
    #: ``batch_wide``: a sample's output depends on other samples of the batch (mixup pairs
    #: samples), so the batch is never split into slices across workers;
    #: ``inplace``: the op's function is correct when its destination *is* its input (the same
    #: array), and then works in place. The planner passes the input as the destination when
    #: the op before it returned the very buffer the planner gave it and no other op reads it,
    #: so that the ops share one buffer (and a decoder before it writes the batch's destination).
    #: A subclass that overrides ``generate_code`` is not ``inplace`` unless it says so itself.
    #: ``compile_ahead``: the op's function has no effect but its return value and writes into
    #: the arrays it is given, whatever their values. With a cold compile cache, the planner may
    #: then call it once on a private one-sample batch of zeros, on a background thread while
    #: the decoders' kernels compile, so that its Numba code is compiled before the first batch
    #: needs it instead of after the decoder (issue 14). Only set by built-in ops: user ops are
    #: never called on data they did not ask for. Reset, as ``inplace``, by a subclass that
    #: overrides ``generate_code``.
    torch_op: ClassVar[bool] = False
    batch_wide: ClassVar[bool] = False
    inplace: ClassVar[bool] = False
    compile_ahead: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Wrap the subclass's own ``__init__`` so that each instance records the arguments it
        was built with, when JSON-safe (for :meth:`import_spec`; no boilerplate in user ops)."""
        super().__init_subclass__(**kwargs)
        if "generate_code" in cls.__dict__ and "inplace" not in cls.__dict__:
            # ``inplace`` vouches for one generate_code: a subclass that replaces the code (a
            # user's variant of RandomHorizontalFlip, say) declares it again, or is not in place
            cls.inplace = False
        if "generate_code" in cls.__dict__ and "compile_ahead" not in cls.__dict__:
            cls.compile_ahead = False  # likewise: it vouches for the code it was set beside
        init = cls.__dict__.get("__init__")
        if init is None or getattr(init, "_beton_records_args", False):
            return

        @functools.wraps(init)
        def __init__(self: Operation, *args: Any, **kw: Any) -> None:
            # Only the constructor the instance's own class resolves to records: a subclass's
            # super().__init__(...) call must not overwrite its caller's arguments.
            own = type(self).__init__ is __init__
            if own:
                self.__dict__["_beton_init_args"] = _json_safe_args(args, kw)
            init(self, *args, **kw)
            if own and self.__dict__.get("_beton_init_args") is not None:
                self.__dict__["_beton_init_attrs"] = _param_attrs(self)

        __init__._beton_records_args = True  # type: ignore[attr-defined]
        cls.__init__ = __init__  # type: ignore[method-assign]

    def __init__(self) -> None:
        self.metadata: Any = None
        self.memory_read: Callable[..., Any] | None = None
        self.field: Any = None

    # -- called by the planner -------------------------------------------------------------
    def accept_field(self, field: Any) -> None:
        """Receive the handler of the field this pipeline reads (``self.field``)."""
        self.field = field

    def accept_globals(self, metadata: Any, memory_read: Callable[..., Any]) -> None:
        """Receive the field's metadata column over all samples and the byte-reading function."""
        self.metadata = metadata
        self.memory_read = memory_read

    @abstractmethod
    def generate_code(self) -> Callable[..., Any]:
        """Return the per-batch function (see the module docstring for its signature)."""

    @abstractmethod
    def declare_state_and_memory(self, previous_state: State) -> tuple[State, Allocation]:
        """Return ``(output_state, allocation_query_or_queries_or_None)``."""

    def declare_shared_memory(self, previous_state: State) -> Any:
        """Optional per-op shared buffer (an ``AllocationQuery``) filled once per batch."""
        return None

    def generate_code_for_shared_state(self) -> Callable[..., Any] | None:
        """Optional function that fills the shared buffer; called once per batch."""
        return None

    # -- wire description --------------------------------------------------------------------
    def spec_params(self) -> dict[str, Any]:
        """JSON-safe constructor arguments that rebuild this op through the registry.

        Built-in ops override this. The default refuses, naming the op, because an
        unregistered op cannot travel to a daemon.
        """
        raise NotImplementedError(
            f"{type(self).__name__} has no wire description; load it into the daemon with "
            "--plugin and give it a spec_name, or run it in the client after ToDevice"
        )

    def import_spec(self) -> dict[str, Any]:
        """How a daemon may rebuild this op from its own copy of the op's module.

        Returns ``{"module", "qualname", "args", "kwargs"}``: the class's import path and the
        constructor arguments recorded when this instance was built (JSON-safe values only:
        ``None``, bools, numbers, strings, lists and dicts of them; tuples come back as lists).
        The daemon imports ``module`` from its own ``sys.path``, never code from the wire, and
        only for a peer it trusts (docs/custom-ops.md).

        Raises:
            NotImplementedError: the op cannot be rebuilt that way; the message says why (the
                class lives in ``__main__`` or is local to a function, or an argument is not
                JSON-safe).
        """
        cls = type(self)
        name = cls.__qualname__
        if cls.__module__ == "__main__":
            raise NotImplementedError(
                f"{name} is defined in the script (__main__), which a daemon cannot import; "
                "move it into a module"
            )
        if "<locals>" in name:
            raise NotImplementedError(
                f"{name} is defined inside a function; define it at module level"
            )
        if "_beton_init_args" in self.__dict__:
            recorded = self.__dict__["_beton_init_args"]
        elif type(self).__init__ is Operation.__init__:
            recorded = ([], {})
        else:
            raise NotImplementedError(
                f"{name}'s constructor arguments were not recorded (its __init__ was added "
                "after the class was created, e.g. by @dataclass, or it was built without "
                "calling it)"
            )
        if recorded is None:
            raise NotImplementedError(
                f"{name}'s constructor arguments are not JSON-safe (numbers, strings, bools, None, "
                "lists and dicts of them)"
            )
        changed = _changed_param_attr(self)
        if changed is not None:
            raise NotImplementedError(
                f"{name}.{changed} was changed after the op was built, and a daemon rebuilds "
                "the op from its constructor arguments; pass the new value to the constructor "
                "(a new op) to keep it in the daemon"
            )
        args, kwargs = recorded
        return {"module": cls.__module__, "qualname": name, "args": args, "kwargs": kwargs}

    def __repr__(self) -> str:
        try:
            params = self.spec_params()
        except NotImplementedError:
            return f"{type(self).__name__}()"
        args = ", ".join(f"{k}={v!r}" for k, v in params.items())
        return f"{type(self).__name__}({args})"


#: An attribute :func:`_param_attrs` cannot snapshot (not JSON-safe, not an array).
_UNKNOWN = object()


#: Arrays above this many bytes are remembered by a digest of their bytes, not a copy.
_SNAPSHOT_COPY_BYTES = 1 << 20


def _snapshot(value: Any) -> Any:
    if hasattr(value, "__array__") and hasattr(value, "dtype") and hasattr(value, "copy"):
        try:
            if getattr(value, "nbytes", 0) > _SNAPSHOT_COPY_BYTES:
                import hashlib

                import numpy as np

                a = np.ascontiguousarray(value)
                digest = hashlib.blake2b(a.data.cast("B"), digest_size=16).digest()
                return ("digest", (str(a.dtype), a.shape, digest))
            return ("array", value.copy())
        except Exception:
            return _UNKNOWN
    try:
        return ("json", _json_value(value))
    except (TypeError, RecursionError):
        return _UNKNOWN


def _same(snap: Any, value: Any) -> bool:
    if snap is _UNKNOWN:
        return True  # cannot tell: assume unchanged
    now = _snapshot(value)
    if now is _UNKNOWN or now[0] != snap[0]:
        return False
    if snap[0] == "array":
        import numpy as np

        a, b = snap[1], now[1]
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        try:
            return bool(np.array_equal(a, b, equal_nan=True))  # a NaN left alone is unchanged
        except TypeError:  # a dtype without NaN (strings, objects)
            return bool(np.array_equal(a, b))
    return bool(snap[1] == now[1])


#: Attributes the planner sets on every op (``accept_field``, ``accept_globals``): not the op's
#: parameters, and the daemon sets them on its own copy.
_PLANNER_ATTRS = frozenset({"metadata", "memory_read", "field"})


def _param_attrs(op: Any) -> dict[str, Any]:
    """Every attribute as the constructor left it (but what the planner sets): a later change
    to one (``op.c = 100`` after ``AddConst(5)``, or to a value the constructor derived,
    ``op._twice = 200``) is not in the recorded arguments a daemon rebuilds the op from
    (:func:`_changed_param_attr`)."""
    return {
        n: _snapshot(v)
        for n, v in op.__dict__.items()
        if n not in _PLANNER_ATTRS and not n.startswith("_beton_")
    }


def _changed_param_attr(op: Any) -> str | None:
    """The first attribute the constructor set (in the order it set them) whose value changed
    since it returned, or ``None``."""
    snaps = op.__dict__.get("_beton_init_attrs")
    if not snaps:
        return None
    for name, snap in snaps.items():
        if name not in op.__dict__ or not _same(snap, op.__dict__[name]):
            return name
    return None


def _json_value(value: Any, depth: int = 0) -> Any:
    """``value`` as a JSON value (tuples as lists); ``TypeError`` if it is not JSON-safe."""
    if depth > 32:
        raise TypeError("nested too deep")
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int | float) and type(value) in (int, float):
        if isinstance(value, float) and not math.isfinite(value):
            raise TypeError("not finite")
        return value
    if isinstance(value, list | tuple):
        return [_json_value(v, depth + 1) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _json_value(v, depth + 1) for k, v in value.items()}
    raise TypeError(type(value).__name__)


def _json_safe_args(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[Any], dict[str, Any]] | None:
    """``(args, kwargs)`` as JSON values, or ``None`` if any is not JSON-safe (numpy scalars and
    arrays, objects, non-finite floats, dicts with non-str keys are not)."""
    try:
        return _json_value(list(args)), _json_value(dict(kwargs))
    except TypeError:
        return None
