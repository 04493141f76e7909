"""How the format layer compiles its Numba ``cfunc`` (the SIGBUS handler of ``format._guard``).

``beton_serve.format`` sits below ``beton_serve.pipeline`` and cannot import the persistent
compile cache (``pipeline.compile_cache``). The pipeline package registers it here when it is
imported (as every Loader and the daemon do); without it, a ``cfunc`` uses Numba's own
``cache=True``. With it, loading the handler costs the runtime only, not Numba's registries
(about 0.25 s of a warm process's start-up, issue 14).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["cfunc", "register"]

_factory: Callable[[Any], Callable[[Callable[..., Any]], Any]] | None = None


def register(factory: Callable[[Any], Callable[[Callable[..., Any]], Any]]) -> None:
    """Compile ``cfunc(sig)`` decorations with ``factory(sig)`` from now on."""
    global _factory
    _factory = factory


def cfunc(sig: Any) -> Callable[[Callable[..., Any]], Any]:
    """A decorator compiling a C callback of signature ``sig`` now, with the registered
    compile cache, else with Numba's own cache."""
    if _factory is not None:
        return _factory(sig)
    import numba

    cached = numba.cfunc(sig, cache=True)

    def compile_(fn: Callable[..., Any]) -> Any:
        # Numba's cache needs a writable directory (``~/.cache/numba`` or beside the module):
        # without one (HOME unwritable, a read-only install) it raises, and the guard was lost.
        try:
            return cached(fn)
        except RuntimeError:
            return numba.cfunc(sig)(fn)

    return compile_
