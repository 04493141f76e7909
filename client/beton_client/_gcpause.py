"""Pausing Python's cyclic garbage collector while a Loader starts (issue 14).

A trainer imports torch before it builds a Loader, and torch leaves about a million tracked
objects behind. A Loader's start then imports numba (in process) or grpc and protobuf (served)
and loads compiled kernels: hundreds of thousands of new objects, enough to trigger a full
(generation 2) collection, which walks every object of the process: **40 to 65 ms** measured here,
one or two of them per start, for no garbage (a Loader's start creates no cycles to collect).

:func:`gc_paused` turns automatic collection off for the duration of a block and back on after
it, unless it was already off. Nothing is lost: the objects made inside the block are collected
as usual later (the first collection after the block examines them). Nested and concurrent uses
(two threads building Loaders) keep the collector off until the last one ends, and never turn on
a collector that the application had turned off.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["gc_paused"]

_lock = threading.Lock()
_depth = 0  # blocks inside gc_paused, in every thread
_restore = False  # whether the outermost block found the collector on


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Run the block with automatic garbage collection off (see the module docstring). Also a
    decorator: ``@gc_paused()`` on a function pauses it for each call."""
    global _depth, _restore
    with _lock:
        if _depth == 0:
            _restore = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _restore:
                gc.enable()
