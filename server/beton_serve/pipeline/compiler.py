"""Numba compilation helpers (mirrors ``ffcv.pipeline.compiler`` without its global state).

FFCV's ``Compiler`` keeps process-wide switches (``set_enabled``, ``set_num_threads``, which also
changes torch's thread count). beton-serve runs ops on its own worker threads and never uses
Numba's parallel backend, so :meth:`Compiler.get_iterator` always returns ``range``; the class
methods are kept so that FFCV-style custom ops port by changing their imports only.

Every dispatcher made here loads and saves its machine code through the persistent compile cache
(:mod:`beton_serve.pipeline.compile_cache`), keyed on the code, the values it freezes, the
signature and the build, so generated closures are cached too (Numba's own ``cache=True`` is
never used: its key misses globals and callees). ``cache=False`` opts out.

Within a process, compiling a function whose fingerprint (its code and the values Numba freezes
into it, the compile cache's key without the signature) equals one compiled before returns that
dispatcher: every Loader generates its ops' closures anew, and each new dispatcher kept its own
machine code for the life of the process (Numba never frees it), about 100 kB per in-process
Loader of an RRC + flip pipeline, so 1,000 Loaders grew the process by 100 MB.

Numba is imported on first use, never at import time.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

_log = logging.getLogger("beton_serve.compile")

__all__ = ["Compiler", "JIT_OPTIONS"]

#: Options every compiled op uses. ``fastmath`` is off: it lets LLVM reorder float arithmetic,
#: which would make results depend on the build and break bit-identical batches. ``cache`` is
#: Numba's own disk cache, off: ours is attached instead (see the module docstring).
JIT_OPTIONS: dict[str, Any] = {
    "nogil": True,
    "cache": False,
    "error_model": "numpy",
}


class Compiler:
    """Compiles op functions with Numba (``nopython``, ``nogil``)."""

    @staticmethod
    def compile(
        fn: Callable[..., Any], signature: Any = None, *, cache: Any = True
    ) -> Callable[..., Any]:
        """Return ``fn`` compiled with Numba; already-compiled dispatchers are returned as is.

        Args:
            fn: a Python function Numba can compile (a generated closure is fine).
            signature: compile eagerly for this signature; ``None`` compiles on the first call.
            cache: ``True`` uses the per-user compile cache the environment selects
                (``BETON_SERVE_CACHE_DIR``, read on the first compile), a
                ``compile_cache.DiskStore`` uses that one, ``False`` compiles without a cache.
        """
        return _compile(fn, signature, cache, reuse=True)

    @staticmethod
    def kernel(fn: Callable[..., Any]) -> Any:
        """Decorator for module-level kernels: :meth:`compile` with the default cache, without
        the in-process reuse (a module-level function is decorated once; fingerprinting it at
        import would be start-up work, and globals defined below it would not exist yet)."""
        return _compile(fn, None, True, reuse=False)

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


def _compile(fn: Callable[..., Any], signature: Any, cache: Any, *, reuse: bool) -> Any:
    import numba

    if isinstance(fn, numba.core.dispatcher.Dispatcher):
        return fn
    key = _memo_key(fn, cache) if reuse else None
    disp = None if key is None else _memo.get(key)
    if disp is None:
        disp = numba.njit(**JIT_OPTIONS)(fn)
        if cache is not False:
            from beton_serve.pipeline.compile_cache import attach

            # the cache fingerprints the function itself at its first compile, when every
            # global it reads exists (not this one, taken when it was handed over)
            attach(disp, None if cache is True else cache)
        if key is not None:
            with _memo_lock:
                if key not in _memo:
                    _count_variant(fn)
                disp = _memo.setdefault(key, disp)
    if signature is not None:
        disp.compile(signature)
    return disp


#: fingerprint key -> the dispatcher compiled for it in this process (see the module docstring).
#: Grows with the distinct functions compiled, as Numba's own code does.
_memo: dict[tuple[Any, ...], Any] = {}
_memo_lock = threading.Lock()


#: (module, qualified name) of a generated function -> how many distinct fingerprints of it
#: this process compiled: the same code with other captured values.
_variants: dict[tuple[str, str], int] = {}
#: A function compiled for this many distinct captured values is reported (then at each
#: doubling): see :func:`_count_variant`.
VARIANTS_WARN = 16


def _count_variant(fn: Callable[..., Any]) -> None:
    """Count a new fingerprint of ``fn``'s code; log a warning when one function has been
    compiled for :data:`VARIANTS_WARN`, then 2x, 4x... distinct captured values.

    Each variant's machine code stays for the life of the process (Numba never frees it,
    1-2 MB for an op): an op that captures its parameters, served to a sweep over them, grows a
    long-lived daemon by that much per value. The built-in ops pass their parameters as
    arguments (``transforms._util.bind``); this names a custom op that does not. Called under
    ``_memo_lock``."""
    name = (str(getattr(fn, "__module__", "?")), str(getattr(fn, "__qualname__", repr(fn))))
    n = _variants.get(name, 0) + 1
    _variants[name] = n
    if n >= VARIANTS_WARN and n & (n - 1) == 0:
        _log.warning(
            "%s.%s has been compiled for %d distinct captured values in this process, and "
            "each one's machine code stays in memory (Numba never frees it; 1-2 MB for an "
            "op). If it is your op, pass the values that change between jobs as arguments "
            "(docs/custom-ops.md, 'Parameters: arguments, not captured constants')",
            name[0],
            name[1],
            n,
        )


def _memo_key(fn: Callable[..., Any], cache: Any) -> tuple[Any, ...] | None:
    """The in-process reuse key of ``fn``: its fingerprint, its function attributes (the
    plan's flags, ``with_seed`` and the like, are set on the dispatcher) and the cache it
    uses; ``None`` when it cannot be fingerprinted (then it is compiled anew, as before)."""
    from beton_serve.pipeline._compile_key import fingerprint

    fp = fingerprint(fn)
    if fp is None:
        return None
    try:
        attrs = tuple(sorted((k, repr(v)) for k, v in vars(fn).items()))
    except TypeError:
        return None
    return (fp, attrs, cache)  # a DiskStore hashes by identity


def _forget_compiled() -> None:
    """Forget the in-process reuse table (tests that emulate a new process)."""
    with _memo_lock:
        _memo.clear()
        _variants.clear()
