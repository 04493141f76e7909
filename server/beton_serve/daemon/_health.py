"""Watching served files for changes that would crash the daemon (truncation under the mmap) or
serve another file's samples (a rewrite in place).

Readers map each ``.beton`` file. If the file is truncated while it is mapped, touching a page
past the new end raises **SIGBUS**, which kills the whole daemon (every dataset, every client).
:class:`FileWatch` keeps a descriptor of each served file (the inode that is mapped, even if the
path is later replaced) and, before each batch is submitted, compares its ``fstat`` size and
modification time with those at open time. A file that shrank, or was written to at all, makes
:meth:`FileWatch.check` raise
:class:`~beton_serve.errors.FormatError` (``DATA_LOSS`` on the wire, ``FormatError``, a
``DataError``, in the client): the affected dataset's streams end with a clear error, and the dataset stays refused
until the daemon is restarted; other datasets carry on.

What is *not* covered (residual risk, DESIGN.md §8):

* a truncation between the check and the workers' reads of a batch already submitted (the
  window is one batch's decode time, plus :data:`MIN_INTERVAL_S`: checks closer together than
  that are skipped, since at thousands of small batches a second the ``fstat`` calls and their
  GIL hand-offs cost the workers about a tenth of their time) raises SIGBUS, which the reader's
  guard (:mod:`beton_serve.format._guard`) turns into zeros and a ``FormatError`` for that
  batch: the same outcome as this check, one batch later;
* a file replaced by rename (new inode) keeps serving the old, still-mapped inode: safe, but
  the new content is not seen until a restart;
* pages that become unreadable (an I/O error on the device) also raise SIGBUS on access, and
  are caught by the same guard.

A write that keeps the size (another dataset copied over the file in place, say) leaves every
mapped page valid, but the header, field types and allocation table read at open no longer
describe the bytes: clients would get the other file's samples, or samples cut at the old
offsets, with no error. So any change of the modification time counts (appending or ``touch``
too: a ``.beton`` is never edited while it is served).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Sequence

from beton_serve.errors import FormatError

__all__ = ["MIN_INTERVAL_S", "FileWatch"]

#: Seconds within which a second :meth:`FileWatch.check` returns at once.
MIN_INTERVAL_S = 0.002

log = logging.getLogger("beton_serve.daemon")


class FileWatch:
    """Descriptors and open-time sizes of a dataset's files (see the module docstring).

    Args:
        paths: the files, as served. Paths that cannot be opened are not watched (a test
            backend may use names that are not files).
        min_interval: checks closer together than this many seconds are skipped.
    """

    def __init__(self, paths: Sequence[str], min_interval: float = MIN_INTERVAL_S) -> None:
        self.min_interval = min_interval
        self._last = -float("inf")
        self._files: list[tuple[str, int, int, int]] = []  # (path, fd, size, mtime_ns) at open
        for p in paths:
            try:
                fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            st = os.fstat(fd)
            self._files.append((p, fd, st.st_size, st.st_mtime_ns))
        self.broken: tuple[str, int, str] | None = None  # (path, offset, reason) once broken

    def check(self, dataset: str) -> None:
        """Raise if a file shrank or was written to since it was opened (the first failure
        sticks).

        Raises:
            FormatError: naming the file, both sizes and what to do.
        """
        if self.broken is not None:
            raise FormatError(*self.broken)
        now_t = time.monotonic()
        if now_t - self._last < self.min_interval:
            return
        self._last = now_t
        for path, fd, size, mtime in self._files:
            why: str | None = None
            try:
                st = os.fstat(fd)
            except OSError as exc:
                now, why = 0, f"cannot stat it ({exc})"
            else:
                now = st.st_size
                if now < size:
                    why = (
                        f"it shrank from {size} to {now} bytes (reading past the new end would "
                        "crash the daemon)"
                    )
                elif st.st_mtime_ns != mtime:
                    why = (
                        "it was written to (its modification time changed): its header and "
                        "allocation table, read at open, may no longer describe its bytes"
                    )
            if why is not None:
                self.broken = (
                    path,
                    min(now, size),
                    f"changed while dataset {dataset!r} is served: {why}; its streams are ended. "
                    "Restore the file and restart the daemon; never rewrite a served .beton in "
                    "place",
                )
                log.error("dataset %s: %s %s; its streams are ended", dataset, path, why)
                raise FormatError(*self.broken)

    def watched(self) -> dict[str, tuple[int, int, int, int]]:
        """``path -> (device, inode, size, mtime_ns)`` of each watched file, as opened."""
        out: dict[str, tuple[int, int, int, int]] = {}
        for path, fd, size, mtime in self._files:
            try:
                st = os.fstat(fd)
            except OSError:
                continue
            out[path] = (st.st_dev, st.st_ino, size, mtime)
        return out

    def close(self) -> None:
        """Close the descriptors (idempotent)."""
        files, self._files = self._files, []
        for _, fd, _, _ in files:
            with contextlib.suppress(OSError):
                os.close(fd)
