"""Reference cycles: what only the garbage collector would free.

A stream, a Loader or a failed batch caught in a reference cycle keeps what it holds (a ring's
mapping, batch buffers, a whole Loader) until the next collection of its generation, which a
process that allocates little may not run for a long time. Tests call :func:`cyclic_garbage`
with the collector disabled, after the objects should have been freed by reference counting.
"""

from __future__ import annotations

import gc
import weakref
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: The modules whose objects count (ours and gRPC's: a call's state held by a cycle).
MODULES = ("beton_", "grpc")

#: Run in a test daemon when ``BETON_TEST_GC_REPORT`` names a file (``helpers.daemon``): the
#: collector is off from the start, and SIGUSR1 writes how many objects of each of our types
#: were in cycles since the last report (:func:`cyclic_counts`, ``count type`` lines) there.
DAEMON_HOOK = f"""
import gc, os, signal, sys
_report = os.environ.get("BETON_TEST_GC_REPORT")
if _report:
    sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
    from helpers.cycles import cyclic_counts
    gc.disable()
    def _write_report(*_):
        counts = cyclic_counts(("beton_",))
        with open(_report + ".tmp", "w") as fh:
            fh.write("".join(f"{{n}} {{name}}\\n" for name, n in counts.items()))
        os.replace(_report + ".tmp", _report)
    signal.signal(signal.SIGUSR1, _write_report)
"""


def cyclic_garbage() -> list[str]:
    """The types (``module.qualname``) of beton-serve's and gRPC's objects that only a
    collection frees, found by one collection with ``DEBUG_SAVEALL``; the garbage is freed."""
    return sorted(cyclic_counts())


def cyclic_counts(modules: tuple[str, ...] = MODULES) -> dict[str, int]:
    """How many objects of each type of ``modules`` only a collection frees (as
    :func:`cyclic_garbage`)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return dict(
            Counter(
                f"{type(o).__module__}.{type(o).__qualname__}"
                for o in gc.garbage
                if type(o).__module__.startswith(modules)
            )
        )
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def assert_freed_by_refcount(make: Callable[[], Any], what: str) -> None:
    """With the collector off, the object ``make()`` returns (a Loader), once closed and
    dropped, is gone, and nothing of ours or gRPC's is left in a reference cycle."""
    gc.collect()
    gc.disable()
    try:
        obj = make()
        ref = weakref.ref(obj)
        obj.close()
        del obj
        assert ref() is None, f"{what} outlived its close()"
        cyclic = cyclic_garbage()
        assert not cyclic, f"freed only by the garbage collector: {cyclic}"
    finally:
        gc.enable()
