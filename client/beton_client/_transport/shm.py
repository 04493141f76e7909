"""The client side of the shm transport: map the daemon's slot ring once, view slots without copying.

The daemon creates ``/dev/shm/<segment>`` (mode 0600) and unlinks it; the client only opens and
maps it (read-write, so that torch tensors over it are writable and torch does not warn) and never
unlinks it. A mapping stays valid after the daemon unlinks the name, so a daemon that dies never
makes a tensor the trainer holds invalid.

Threading: one :class:`ShmReceiver` belongs to one Loader stream and is used from the thread that
iterates the Loader. Memory: the views returned by :meth:`ShmReceiver.arrays` alias the slot; the
slot is the Loader's until it sends the release (before it asks for the next batch).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from beton_client.errors import TransportError

__all__ = ["SHM_DIR", "ShmReceiver", "TensorInfo"]

SHM_DIR = Path("/dev/shm")


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of a published batch: full shape (batch first), dtype name, place in the slot."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


class ShmReceiver:
    """Maps one shm ring.

    Args:
        segment: the segment name under ``/dev/shm``.
        segment_bytes: its size, as the daemon reported it.
        slot_count: number of slots.
        slot_bytes: bytes per slot.

    Raises:
        TransportError: the segment cannot be opened or is smaller than announced (e.g. the
            client is in another IPC namespace or container).
    """

    kind = "shm"

    def __init__(
        self,
        segment: str,
        segment_bytes: int,
        slot_count: int,
        slot_bytes: int,
        shm_dir: Path = SHM_DIR,
    ) -> None:
        if "/" in segment or not segment.startswith("beton-"):
            raise TransportError(f"refusing to map {segment!r}: not a beton-serve segment name")
        path = shm_dir / segment
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise TransportError(
                f"cannot open the daemon's shared memory {path}: {exc}. The trainer must run on "
                "the daemon's host, as its user, sharing its /dev/shm (containers: --ipc=host)"
            ) from None
        try:
            size = os.fstat(fd).st_size
            if size < segment_bytes or segment_bytes < slot_count * slot_bytes:
                raise TransportError(
                    f"shared memory {path} has {size} bytes, the daemon announced {segment_bytes}"
                )
            self._mmap = mmap.mmap(fd, segment_bytes, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.segment = segment
        self.slot_count = slot_count
        self.slot_bytes = slot_bytes
        self._base = np.frombuffer(self._mmap, dtype=np.uint8)

    def arrays(self, slot: int, tensors: Sequence[TensorInfo]) -> list[np.ndarray]:
        """Numpy views of the tensors of ``slot`` (no copy), valid until the slot is released.

        Raises:
            TransportError: the description does not fit inside the slot (a protocol error).
        """
        if not 0 <= slot < self.slot_count:
            raise TransportError(f"slot {slot} is outside the ring's {self.slot_count} slots")
        base = slot * self.slot_bytes
        out = []
        for t in tensors:
            dt = np.dtype(t.dtype)
            count = 1
            for d in t.shape:
                count *= d
            if count * dt.itemsize != t.nbytes or t.offset + t.nbytes > self.slot_bytes:
                raise TransportError(
                    f"tensor {t.name!r} ({t.shape}, {t.dtype}) at offset {t.offset} does not fit "
                    f"in a {self.slot_bytes}-byte slot"
                )
            raw = self._base[base + t.offset : base + t.offset + t.nbytes]
            out.append(raw.view(dt).reshape(t.shape))
        return out

    def close(self) -> None:
        """Drop the mapping (it stays alive while user tensors still reference it)."""
        self._base = np.empty(0, np.uint8)
        with contextlib.suppress(BufferError):
            self._mmap.close()
