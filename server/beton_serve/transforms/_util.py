"""Small helpers shared by the transform modules (no Numba, no torch at import)."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
from beton_wire.limits import short_repr

from beton_serve.errors import SpecError

__all__ = [
    "bind",
    "check_fill",
    "check_int",
    "check_real",
    "dtype_name",
    "mark",
    "require_image",
    "to_list",
]


def mark(fn: Any, *, indices: bool = False, seed: bool = False, python: bool = False) -> Any:
    """Set the call-convention attributes of a generated function (see ``operation.py``)."""
    if indices:
        fn.with_indices = True
    if seed:
        fn.with_seed = True
    if python:
        fn.python = True
    return fn


def bind(kernel: Any, *params: Any, indices: bool = False, seed: bool = False) -> Any:
    """An op function that runs ``kernel`` compiled, with ``params`` passed after the op's own
    arguments: ``kernel(*op_args, *params)``.

    Numba freezes the values a compiled closure captures into its machine code, and never frees
    machine code (numba's MCJIT keeps every module). A built-in op whose closure captured its
    parameters compiled once per distinct value (0.2-0.5 s) and grew the process by 1.5-2 MB
    each time, for good: a long-lived daemon serving a sweep over ``RandomBrightness(magnitude)``
    or ``RandomHorizontalFlip(p)`` grew by that much per job. ``kernel`` must capture no
    parameter value (only helpers and the like), so that its fingerprint, hence its in-process
    dispatcher and its compile-cache entry, is the same for every value: it compiles once per
    process, and once per machine through the cache. Parameters of one Python type compile to
    one signature; the ops cast them (``float(p)``) so that ``1`` and ``1.0`` share it.

    The returned function is plain Python (``python = True``) calling the nogil kernel; the
    compiled kernel is its ``kernel`` attribute.
    """
    from beton_serve.pipeline.compiler import Compiler

    compiled = Compiler.compile(kernel)

    def op(*args: Any) -> Any:
        return compiled(*args, *params)

    op.kernel = compiled  # type: ignore[attr-defined]
    op.__name__ = op.__qualname__ = getattr(kernel, "__name__", "op")
    return mark(op, indices=indices, seed=seed, python=True)


def check_fill(op: str, fill: Any) -> np.ndarray:
    """``fill`` as an array of 3 numbers (one per channel); :class:`SpecError` otherwise (the
    kernels read ``fill[0..2]`` without bounds checks)."""
    try:
        arr = np.array(fill)
        ok = arr.shape == (3,) and np.issubdtype(arr.dtype, np.number)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise SpecError(f"{op}: fill must be 3 numbers (one per channel), got {fill!r}")
    return arr


def check_int(op: str, name: str, value: Any) -> int:
    """``value`` as an ``int`` when it is an integer (``int`` or a numpy integer); a
    :class:`SpecError` for anything else. ``int()`` would have truncated ``8.7``, read ``"8"``
    and taken ``True`` for 1; a parameter from the wire must be refused, not changed."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise SpecError(f"{op}: {name} must be an integer, got {short_repr(value)}")


def check_real(op: str, name: str, value: Any) -> float:
    """``value`` as a ``float`` when it is a real number (an int, a float, a numpy number; not
    a bool or a string); a :class:`SpecError` otherwise."""
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    ):
        return float(value)
    raise SpecError(f"{op}: {name} must be a number, got {short_repr(value)}")


def dtype_name(dtype: Any) -> str:
    """A JSON-safe name for a numpy or torch dtype (``"float16"``, ``"uint8"``)."""
    if type(dtype).__module__ == "torch":
        return str(dtype).replace("torch.", "")
    return np.dtype(dtype).name


def to_list(value: Any) -> Any:
    """Numpy arrays/scalars and tuples to JSON-safe lists/numbers (recursively)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [to_list(v) for v in value]
    return value


def require_image(op: Any, state: Any, *, channels: int | None = 3, dtype: Any = None) -> None:
    """Raise :class:`SpecError` unless ``state`` is a jit-mode (H, W, C) image."""
    name = type(op).__name__
    if not state.jit_mode:
        raise SpecError(f"{name} works on numpy images before ToTensor; move it before ToTensor()")
    shape = state.shape
    if shape is None or len(shape) != 3 or (channels is not None and shape[2] != channels):
        raise SpecError(
            f"{name} needs (H, W, {channels or 'C'}) images per sample, got shape {shape}; "
            "put it after an image decoder"
        )
    if dtype is not None and np.dtype(state.dtype) != np.dtype(dtype):
        raise SpecError(f"{name} needs {np.dtype(dtype)} images, got {state.dtype}")
