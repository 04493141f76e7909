"""A SIGBUS guard for mapped ``.beton`` files: a truncated file is an error, not a dead process.

Readers map each file. When a mapped file is truncated, a read of a page past its new end raises
**SIGBUS**. The default action kills the process: every dataset of a daemon, every stream, and
the segments it would have freed. The checks before a batch (``daemon._health.FileWatch``) leave
a window of one batch's decode, and a 512-px batch is long enough for a truncation to land in it.

This module closes that window with a process-wide ``SIGBUS`` handler, installed once, the first
time a mapping is guarded:

* A table of guarded address ranges (``lo``, ``hi``, ``hits``), one row per mapped file, lives
  in a NumPy array at a fixed address. :func:`guard` fills a row and returns a :class:`Region`;
  :meth:`Region.close` (or the mapping being freed) clears it.
* The handler is a Numba ``cfunc`` (``_guard_handler``, cached on disk by Numba, since nothing
  of one process is baked into it): machine code that needs neither the GIL nor the interpreter, so it runs on whichever thread faulted (a decode worker inside a ``nogil``
  kernel or libjpeg-turbo). It reads the faulting address (``si_addr``). If the address is
  inside a guarded range, it maps one anonymous zero page over the faulting page with
  ``mmap(MAP_FIXED)``, counts a hit in that row and returns, so that the read completes and
  returns zeros. Any other fault is not ours: it restores the handler that was installed before
  (Python's ``faulthandler``, or the default action) and returns, so that the instruction faults
  again and that handler deals with it, as if no guard existed.
* Whoever reads a guarded mapping checks :meth:`Region.hits` after a batch (one load from the
  table) and raises :class:`~beton_serve.errors.FormatError` when it is not zero. Since the zero
  pages stay mapped, the count never goes back down, and the reader stays failed: the data it
  would return is no longer the file's.

Cost: nothing on the read path (no fault, no handler), one integer read per batch, and loading
the handler once per process, the first time a file is guarded: about 0.15 s from Numba's cache,
0.4 s the first time on a machine (compiling it).

Limits: Linux on x86-64 and AArch64 (where ``struct sigaction`` and ``siginfo_t`` have the
layouts used here); elsewhere :func:`guard` returns ``None`` and reads are unguarded, as before.
A handler that other code installs for SIGBUS after ours replaces it; :func:`guard` re-installs
ours (chaining to the newer one) the next time a file is mapped. At most :data:`MAX_REGIONS`
mappings are guarded at once; past that, :func:`guard` returns ``None`` and logs why.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import platform
import signal
import sys
import threading
import weakref
from typing import Any

import numpy as np

__all__ = ["MAX_REGIONS", "Region", "guard", "supported"]

log = logging.getLogger("beton_serve.format")

#: Mappings guarded at once (rows of the table).
MAX_REGIONS = 4096
#: The external symbols through which the cached handler reaches this process's table and its
#: saved previous ``struct sigaction`` (versioned with the table's layout; see ``_guard_handler``).
TABLE_SYMBOL = "beton_serve_sigbus_table_v1"
PREVIOUS_SYMBOL = "beton_serve_sigbus_previous_v1"

#: The "in use" word of a row: 1 for a read-only mapping (a zero page mapped read-only over a
#: fault), 2 for one the process writes too (a zero page mapped read-write: the write completes
#: into private memory, and the row's hits say the mapping is no longer the file's).
_READ_ONLY = 1
_WRITABLE = 2
_SA_SIGINFO = 0x4
_SA_ONSTACK = 0x08000000
_PROT_READ = 0x1
_MAP_PRIVATE = 0x02
_MAP_FIXED = 0x10
_MAP_ANONYMOUS = 0x20


class _Sigaction(ctypes.Structure):
    # glibc's (and musl's) struct sigaction on x86-64 and AArch64.
    _fields_ = [
        ("handler", ctypes.c_void_p),
        ("mask", ctypes.c_ulong * 16),
        ("flags", ctypes.c_int),
        ("restorer", ctypes.c_void_p),
    ]


def supported() -> bool:
    """Whether this platform can be guarded (see the module docstring)."""
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64", "aarch64")


class _Guard:
    """The process's one table and handler (created by :func:`_the_guard`)."""

    def __init__(self) -> None:
        self.table = np.zeros((MAX_REGIONS, 4), np.uint64)  # lo, hi, hits, in use
        self.previous = _Sigaction()
        self.lock = threading.Lock()
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.sigaction = self.libc.sigaction
        self.sigaction.restype = ctypes.c_int
        self.sigaction.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        self.handler = _load_handler(self.table.ctypes.data, ctypes.addressof(self.previous))
        self.install()

    def installed(self) -> bool:
        current = _Sigaction()
        if self.sigaction(int(signal.SIGBUS), None, ctypes.byref(current)) != 0:
            return False
        return bool(current.handler == self.handler.address)

    def install(self) -> None:
        """Install the handler (again, if something replaced it), chaining to the current one."""
        if self.installed():
            return
        new = _Sigaction()
        new.handler = self.handler.address
        new.flags = _SA_SIGINFO | _SA_ONSTACK
        old = _Sigaction()
        if self.sigaction(int(signal.SIGBUS), ctypes.byref(new), ctypes.byref(old)) != 0:
            raise OSError(ctypes.get_errno(), "sigaction(SIGBUS) failed")
        # The handler reads `previous` only on a foreign fault (until this copy, a foreign fault
        # gets the default action, which is what the previous handler would mostly do too).
        ctypes.memmove(ctypes.byref(self.previous), ctypes.byref(old), ctypes.sizeof(old))

    def add(self, lo: int, hi: int, writable: bool = False) -> int | None:
        with self.lock:
            free = np.flatnonzero(self.table[:, 3] == 0)
            if not len(free):
                return None
            row = int(free[0])
            t = self.table
            t[row, 3] = _WRITABLE if writable else _READ_ONLY
            t[row, 2] = 0
            t[row, 1] = 0  # hi last: a half-written row matches nothing
            t[row, 0] = lo
            t[row, 1] = hi
            return row

    def remove(self, row: int) -> None:
        """Free ``row``. It takes no lock: it runs from a mapping's finalizer, which the garbage
        collector may run inside :meth:`add`'s locked section on the same thread (the lock is
        not reentrant). ``add`` only claims rows whose "in use" word is 0, and that word is
        cleared last, so a concurrent ``add`` never claims a half-cleared row."""
        t = self.table
        t[row, 1] = 0  # hi first: a half-cleared row matches nothing
        t[row, 0] = 0
        t[row, 2] = 0
        t[row, 3] = 0


_THE_GUARD: _Guard | None = None
_FAILED: str | None = None
_INIT_LOCK = threading.Lock()


def _the_guard() -> _Guard | None:
    global _THE_GUARD, _FAILED
    with _INIT_LOCK:
        if _THE_GUARD is None and _FAILED is None:
            if not supported():
                _FAILED = f"not supported on {sys.platform}/{platform.machine()}"
            else:
                try:
                    _THE_GUARD = _Guard()
                except Exception as exc:  # no guard is the old behaviour, never a failure
                    _FAILED = f"{type(exc).__name__}: {exc}"
                    log.warning("no SIGBUS guard for mapped files (%s)", _FAILED)
        elif _THE_GUARD is not None:
            _THE_GUARD.install()
        return _THE_GUARD


class Region:
    """One guarded mapping: its row in the table (see the module docstring)."""

    __slots__ = ("__weakref__", "_guard", "_row")

    def __init__(self, g: _Guard, row: int) -> None:
        self._guard: _Guard | None = g
        self._row = row

    def hits(self) -> int:
        """Pages of this mapping read past the file's end so far (0: every read was the file's)."""
        g = self._guard
        return 0 if g is None else int(g.table[self._row, 2])

    def close(self) -> None:
        """Stop guarding (the mapping is gone). Idempotent."""
        g, self._guard = self._guard, None
        if g is not None:
            g.remove(self._row)


def guard(
    mapping: mmap.mmap | None, address: int, length: int, *, writable: bool = False
) -> Region | None:
    """Guard ``length`` bytes at ``address`` until :meth:`Region.close`, or until ``mapping``
    (the ``mmap`` object behind them, if any) is freed; ``None`` where no guard can be had (see
    the module docstring). ``writable``: the process writes the mapping too (a shared-memory
    segment it created, which another process could truncate), so a fault maps a writable zero
    page. The caller must stop guarding before the range is unmapped and reused, except through
    ``mapping``'s own release."""
    g = _the_guard()
    if g is None or length <= 0:
        return None
    row = g.add(address, address + length, writable)
    if row is None:
        log.warning(
            "more than %d mapped files: this one is not guarded against SIGBUS", MAX_REGIONS
        )
        return None
    region = Region(g, row)
    if mapping is not None:
        weakref.finalize(mapping, region.close)
    return region


def _load_handler(table_addr: int, previous_addr: int) -> Any:
    """The handler cfunc (``_guard_handler``), linked to this process's table and saved
    previous ``struct sigaction`` through its two external symbols."""
    import llvmlite.binding as llvm

    llvm.add_symbol(TABLE_SYMBOL, table_addr)
    llvm.add_symbol(PREVIOUS_SYMBOL, previous_addr)
    from beton_serve.format._guard_handler import handler  # compiled, or loaded from the cache

    return handler
