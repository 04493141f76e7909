"""Which process a client object belongs to.

A process forked from a trainer that holds a served Loader inherits the Loader's gRPC channel,
its stream's notice socket and its shared-memory mappings. They belong to the parent: a child
that read batches from them would take batches meant for the parent (both then failed with
"out-of-order batch"), and a child that closed them at exit hung in gRPC's channel close
(gRPC objects do not survive a fork), with its parent waiting for it.

So every finalizer that closes such a resource runs only in the process that made it
(:func:`owner_only`), and the front end refuses to iterate a served Loader in a forked child
(``FrontEnd``). The in-process Loader starts its own workers in a child instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

__all__ = ["generation", "owner_only"]

#: How many forks separate this process from its first ancestor that imported this module;
#: objects remember the value they were made under.
_GENERATION = [0]


def _forked() -> None:
    _GENERATION[0] += 1


os.register_at_fork(after_in_child=_forked)


def generation() -> int:
    """The current process's fork generation (see the module docstring)."""
    return _GENERATION[0]


def owner_only(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, as a function that does nothing in a process forked after this call."""
    made = _GENERATION[0]

    def call(*args: Any, **kwargs: Any) -> Any:
        if _GENERATION[0] != made:
            return None
        return fn(*args, **kwargs)

    call.__name__ = call.__qualname__ = getattr(fn, "__name__", "call")
    return call
