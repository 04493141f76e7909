"""Watching served files for changes that would crash the daemon (truncation under the mmap).

Readers map each ``.beton`` file. If the file is truncated while it is mapped, touching a page
past the new end raises **SIGBUS**, which kills the whole daemon (every dataset, every client).
:class:`FileWatch` keeps a descriptor of each served file (the inode that is mapped, even if the
path is later replaced) and, before each batch is submitted, compares its ``fstat`` size with the
size at open time. A file that shrank makes :meth:`FileWatch.check` raise
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

Growing files (appended bytes) are ignored: the mapped range stays valid.
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
        self._files: list[tuple[str, int, int]] = []  # (path, fd, size at open)
        for p in paths:
            try:
                fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            self._files.append((p, fd, os.fstat(fd).st_size))
        self.broken: tuple[str, int, str] | None = None  # (path, offset, reason) once broken

    def check(self, dataset: str) -> None:
        """Raise if a file shrank since it was opened (the first failure sticks).

        Raises:
            FormatError: naming the file, both sizes and what to do.
        """
        if self.broken is not None:
            raise FormatError(*self.broken)
        now_t = time.monotonic()
        if now_t - self._last < self.min_interval:
            return
        self._last = now_t
        for path, fd, size in self._files:
            try:
                now = os.fstat(fd).st_size
            except OSError as exc:
                now, why = -1, f"cannot stat it ({exc})"
            else:
                why = f"it shrank from {size} to {now} bytes"
            if now < size:
                self.broken = (
                    path,
                    max(now, 0),
                    f"changed while dataset {dataset!r} is served: {why}; its streams are ended "
                    "(reading past the new end would crash the daemon). Restore the file and "
                    "restart the daemon; never rewrite a served .beton in place",
                )
                log.error("dataset %s: %s %s; its streams are ended", dataset, path, why)
                raise FormatError(*self.broken)

    def close(self) -> None:
        """Close the descriptors (idempotent)."""
        files, self._files = self._files, []
        for _, fd, _ in files:
            with contextlib.suppress(OSError):
                os.close(fd)
