"""Pausing Python's cyclic garbage collector while a Loader starts (issue 14).

A trainer imports torch before it builds a Loader, and torch leaves about a million tracked
objects behind. A Loader's start then imports numba (in process) or grpc and protobuf (served)
and loads compiled kernels: hundreds of thousands of new objects, enough to trigger a full
(generation 2) collection, which walks every object of the process: **40 to 65 ms** measured here,
one or two of them per start, for no garbage (a Loader's start creates no cycles to collect).

:func:`gc_paused` turns automatic collection off for the duration of a block and back on after
it, unless it was already off. Nested and concurrent uses (two threads building Loaders) keep the
collector off until the last one ends, and never turn on a collector that the application had
turned off.

When the last block ends, the objects made inside it move, unexamined, to the oldest generation
(:func:`promote_young`), where they would have gone anyway: they are long-lived (numba's
modules, loaded kernels, grpc's). Left young, they were examined by the first generation-0 and
then the first generation-1 collection after the block: ~190,000 objects after an in-process
Loader's start, 100 ms and 140 ms of the training loop's thread, in the middle of its first
epochs (on CIFAR-like data, a quarter of that thread's CPU over 20 epochs: RESULTS.md,
session 56). Nothing is lost: the next full collection examines them, as it examines every
long-lived object, and frees any cycle among them that has become garbage.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["gc_paused", "promote_young"]

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
                promote_young()
                gc.enable()


def promote_young() -> bool:
    """Move every object of the young generations into the oldest one without examining them
    (``gc.freeze()`` then ``gc.unfreeze()``, which CPython documents as putting the frozen
    objects back into the oldest generation); constant time. Skipped while the application
    keeps objects frozen (``gc.get_freeze_count() > 0``): unfreezing would thaw them.

    Returns:
        Whether the objects were moved.
    """
    if gc.get_freeze_count() > 0:
        return False
    gc.freeze()
    gc.unfreeze()
    return True
