"""Large batch buffers, mapped so that their first batch is written at a steady speed.

A batch buffer is written once per batch and reused for the whole run, but the first write of
each fresh page is a page fault, and a Loader's first batches each land in a fresh slot. numpy
asks for transparent huge pages (``madvise(MADV_HUGEPAGE)``) on every array of 4 MiB or more.
On the VMs we measure on, that made the first batches bimodal (issue 14, ``benchmarks/
RESULTS.md``, "Session 15"), for RRC-224 batches of 256 images (38.5 MB per slot):

* Sometimes a huge-page slot faulted in as fast as 4 KiB pages (first batch 0.11 s).
* In about half the runs it took 30-50 ms more per slot (first batch 0.14-0.16 s, the next two
  0.21 s instead of 0.13 s), with free 2 MiB blocks to spare and no fallback counted. Our
  reading: a huge page is a free 2 MiB block, and a guest kernel that reports its free blocks
  to the hypervisor (free page reporting, which reports blocks of that size) gets them back
  unbacked, so the host must fault each one in again.
* With ``MADV_NOHUGEPAGE`` the same slots took 0.116-0.117 s for the first batch and 0.13 s for
  the next two, in every run.

So by default these buffers are private anonymous mappings advised ``MADV_NOHUGEPAGE``. On
bare metal that costs a few milliseconds once per buffer: 4 KiB faults instead of 2 MiB ones.
Once the buffers are written, the steady rate measured the same (RRC-224 + flip, 2 workers, six
alternated pairs).
``BETON_SERVE_HUGEPAGES=1`` gives numpy's default instead: advised, huge pages where the kernel
has them.

Only process-private memory is concerned: shared-memory rings are tmpfs, whose huge pages are a
system setting (``shmem_enabled``).
"""

from __future__ import annotations

import errno
import math
import mmap
import os
from typing import Any

import numpy as np

__all__ = ["BATCH_MAP_MIN_BYTES", "batch_empty", "memory_limit_bytes"]

#: Smaller buffers come from ``np.empty`` (numpy advises huge pages only from 4 MiB up, too).
BATCH_MAP_MIN_BYTES = 4 << 20

_NO_HUGE: int | None = getattr(mmap, "MADV_NOHUGEPAGE", None)
_PRIVATE: int | None = (
    mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS if hasattr(mmap, "MAP_ANONYMOUS") else None
)


def memory_limit_bytes() -> int:
    """The memory this process may use: the host's, or its cgroup's limit when that is lower (a
    container's ``memory.max``, cgroup v2); 8 GiB where neither can be read."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 8 << 30
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            text = f.read().strip()
        if text.isdigit():
            total = min(total, int(text))
    except OSError:
        pass
    return int(total)


def _huge_pages_wanted() -> bool:
    return os.environ.get("BETON_SERVE_HUGEPAGES", "").strip() in ("1", "true", "yes")


def batch_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised C-contiguous array, like ``np.empty(shape, dtype)``.

    From ``BATCH_MAP_MIN_BYTES`` up, on platforms with ``MADV_NOHUGEPAGE``, it is a private
    anonymous mapping so advised (its ``base`` is the ``mmap``, unmapped when the last view of
    it goes); otherwise, or with ``BETON_SERVE_HUGEPAGES=1``, it is ``np.empty``.

    Raises:
        MemoryError: the process cannot map that much (as ``np.empty`` raises it).
    """
    dt = np.dtype(dtype)
    nbytes = math.prod(shape) * dt.itemsize
    if (
        nbytes < BATCH_MAP_MIN_BYTES
        or _NO_HUGE is None
        or _PRIVATE is None
        or dt.hasobject
        or _huge_pages_wanted()
    ):
        return np.empty(shape, dt)
    try:
        m = mmap.mmap(-1, nbytes, flags=_PRIVATE)
    except OSError as exc:  # as np.empty says it: callers turn MemoryError into advice
        if exc.errno == errno.ENOMEM:
            raise MemoryError(
                f"Unable to allocate {nbytes} bytes for an array with shape {shape} and data "
                f"type {dt}"
            ) from None
        raise
    try:
        m.madvise(_NO_HUGE)
    except OSError:  # a kernel without THP: its pages are 4 KiB anyway
        pass
    return np.ndarray(shape, dt, buffer=m)
