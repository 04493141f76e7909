"""Numba compilation helpers (mirrors ``ffcv.pipeline.compiler`` without its global state).

FFCV's ``Compiler`` keeps process-wide switches (``set_enabled``, ``set_num_threads``, which also
changes torch's thread count). beton-serve runs ops on its own worker threads and never uses
Numba's parallel backend, so :meth:`Compiler.get_iterator` always returns ``range``; the class
methods are kept so that FFCV-style custom ops port by changing their imports only.

Numba is imported on first use, never at import time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Compiler", "JIT_OPTIONS"]

#: Options every compiled op uses. ``fastmath`` is off: it lets LLVM reorder float arithmetic,
#: which would make results depend on the build and break bit-identical batches.
JIT_OPTIONS: dict[str, Any] = {
    "nogil": True,
    "cache": False,
    "error_model": "numpy",
}


class Compiler:
    """Compiles op functions with Numba (``nopython``, ``nogil``)."""

    @staticmethod
    def compile(fn: Callable[..., Any], signature: Any = None) -> Callable[..., Any]:
        """Return ``fn`` compiled with Numba; already-compiled dispatchers are returned as is."""
        import numba

        if isinstance(fn, numba.core.dispatcher.Dispatcher):
            return fn
        if signature is not None:
            return numba.njit(signature, **JIT_OPTIONS)(fn)
        return numba.njit(**JIT_OPTIONS)(fn)

    @staticmethod
    def get_iterator() -> Callable[..., Any]:
        """The loop to use over the samples of a batch: always ``range`` (see module docstring)."""
        return range

    @staticmethod
    def set_enabled(enabled: bool) -> None:
        """Accepted for FFCV compatibility; beton-serve always compiles jit-mode ops."""

    @staticmethod
    def set_num_threads(n: int) -> None:
        """Accepted for FFCV compatibility; the worker pool owns parallelism."""
