"""The client side of the shm transport: map the daemon's slot ring once, view slots without copying.

The daemon creates ``/dev/shm/<segment>`` (mode 0600) and unlinks it; the client only opens and
maps it (read-write, so that torch tensors over it are writable and torch does not warn) and never
unlinks it. A mapping stays valid after the daemon unlinks the name, so a daemon that dies never
makes a tensor the trainer holds invalid.

The notice channel (:mod:`beton_wire.notice`): when the daemon offers one, :class:`NoticeChannel`
connects to its socket and carries the stream's per-batch traffic (batch-ready notices in, releases
out) as 32-byte records instead of gRPC messages; a batch's sample ids are then read from the
segment's id table (:meth:`ShmReceiver.ids`).

Threading: one :class:`ShmReceiver` belongs to one Loader stream and is used from the thread that
iterates the Loader. Memory: the views returned by :meth:`ShmReceiver.arrays` alias the slot; the
slot is the Loader's until it sends the release (before it asks for the next batch).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
from beton_wire import notice

from beton_client.errors import TransportError

__all__ = ["SHM_DIR", "NoticeChannel", "ShmReceiver", "TensorInfo"]

SHM_DIR = Path("/dev/shm")
#: Other segments of the daemon (sharing arenas) a receiver keeps open, at most.
MAX_EXTRA_SEGMENTS = 32


class SegmentGone(TransportError):
    """A batch's segment was removed before this client mapped it: its daemon stopped (a
    SIGTERM drain frees the streams' segments) or died and another daemon swept it. The stream is
    lost, not the data corrupt: the Loader reports it as the stream's end (``_stream``)."""


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
        ids_offset: where the segment's sample-id table starts (0: it has none).
        release_offset: where its release words start (0: it has none).

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
        ids_offset: int = 0,
        release_offset: int = 0,
    ) -> None:
        if "/" in segment or not segment.startswith("beton-"):
            raise TransportError(f"refusing to map {segment!r}: not a beton-serve segment name")
        path = shm_dir / segment
        try:
            # A file object, not a bare descriptor: one Ctrl-C between the open and the code
            # that closes it would leak a bare one (the mapping keeps its own).
            f = open(path, "r+b", buffering=0)  # closed below
        except OSError as exc:
            raise TransportError(
                f"cannot open the daemon's shared memory {path}: {exc}. The trainer must run on "
                "the daemon's host, as its user, sharing its /dev/shm (containers: --ipc=host)"
            ) from None
        with f:
            size = os.fstat(f.fileno()).st_size
            if size < segment_bytes or segment_bytes < slot_count * slot_bytes:
                raise TransportError(
                    f"shared memory {path} has {size} bytes, the daemon announced {segment_bytes}"
                )
            self._mmap = mmap.mmap(f.fileno(), segment_bytes, mmap.MAP_SHARED)
        self.segment = segment
        self.slot_count = slot_count
        self.slot_bytes = slot_bytes
        self._base = np.frombuffer(self._mmap, dtype=np.uint8)
        self._shm_dir = shm_dir
        #: Other segments of the daemon: open file (read-only) and size, by name.
        self._extra: OrderedDict[str, tuple[BinaryIO, int]] = OrderedDict()
        #: Batches read from other segments (sharing arenas), for tests and diagnostics.
        self.shared_batches = 0
        self._ids: np.ndarray | None = None
        if ids_offset:
            table_end = release_offset or segment_bytes  # the release words follow the table
            rows = (table_end - ids_offset) // (8 * slot_count)
            if ids_offset < slot_count * slot_bytes or rows < 1:
                raise TransportError(
                    f"shared memory {path}: the id table at {ids_offset} does not fit in "
                    f"{segment_bytes} bytes"
                )
            table = self._base[ids_offset : ids_offset + 8 * rows * slot_count]
            self._ids = table.view("<u8").reshape(slot_count, rows)
        #: Views of each slot for one tensor list (a stream's full-batch layout, which it hands
        #: over as the same object every batch), built once per slot: see :meth:`slot_arrays`.
        self._layout_key: Sequence[TensorInfo] | None = None
        self._slot_views: list[list[np.ndarray] | None] = [None] * slot_count
        self._ctl: np.ndarray | None = None
        if release_offset:
            end = release_offset + 8 * (notice.RELEASE_WORDS + slot_count)
            if release_offset < slot_count * slot_bytes or end > segment_bytes:
                raise TransportError(
                    f"shared memory {path}: the release words at {release_offset} do not fit in "
                    f"{segment_bytes} bytes"
                )
            self._ctl = self._base[release_offset:end].view("<u8")

    @property
    def has_release_words(self) -> bool:
        """Whether slots are released through the segment's release words."""
        return self._ctl is not None

    def release_word(self, slot: int, token: int, wait_us: int) -> bool:
        """Release ``slot`` by storing its lease token, with the total wait so far; returns
        whether the daemon is starved (then send it a ``WAKE``)."""
        ctl = self._ctl
        if ctl is None or not 0 <= slot < self.slot_count:
            raise TransportError(f"no release word for slot {slot} in {self.segment}")
        ctl[notice.WAIT_WORD] = wait_us
        ctl[notice.RELEASE_WORDS + slot] = token
        return bool(ctl[notice.STARVED_WORD])

    def ids(self, slot: int, length: int) -> np.ndarray:
        """A copy of the sample ids of the ``length``-row batch in ``slot`` (from the id table).

        Raises:
            TransportError: the segment has no id table, or the slot or length is out of range.
        """
        if self._ids is None or not 0 <= slot < self.slot_count or length > self._ids.shape[1]:
            raise TransportError(f"no sample ids for slot {slot} ({length} rows) in {self.segment}")
        return self._ids[slot, :length].astype(np.uint64)

    def arrays_at(
        self, segment: str, offset: int, tensors: Sequence[TensorInfo]
    ) -> list[np.ndarray]:
        """Views of a batch the daemon keeps at ``offset`` in another of its segments (a batch
        decoded once for several identical streams, whose other clients read the same memory).

        Each such batch gets its own copy-on-write mapping (``MAP_PRIVATE`` of a read-only
        descriptor): reading it costs no copy, and a training loop that modifies its batch in
        place changes private pages of its own, never what the other jobs read. The mapping is
        unmapped when the last view of it is dropped.

        Raises:
            TransportError: the name is not a segment of this ring's daemon, it cannot be mapped,
                or the batch does not fit in it.
        """
        got = self._extra.get(segment)
        if got is None:
            got = self._open_extra(segment)
        else:
            self._extra.move_to_end(segment)
        f, size = got
        if offset < 0 or offset + self.slot_bytes > size:  # past the end would be SIGBUS
            raise TransportError(
                f"a {self.slot_bytes}-byte batch at {offset} does not fit in {segment} ({size} B)"
            )
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        length = offset - start + self.slot_bytes
        try:
            mapping = mmap.mmap(
                f.fileno(),
                length,
                flags=mmap.MAP_PRIVATE,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
                offset=start,
            )
        except (OSError, ValueError) as exc:
            raise TransportError(
                f"cannot map {self.slot_bytes} bytes at {offset} of {segment}: {exc}"
            ) from None
        self.shared_batches += 1
        base = np.frombuffer(mapping, dtype=np.uint8)
        return _views(base, offset - start, self.slot_bytes, tensors)

    def _open_extra(self, segment: str) -> tuple[BinaryIO, int]:
        owner = self.segment.split("-", 2)[:2]  # ["beton", "<daemon pid>"]
        if "/" in segment or segment.split("-", 2)[:2] != owner:
            raise TransportError(f"refusing to map {segment!r}: not a segment of this daemon")
        path = self._shm_dir / segment
        try:
            f = open(path, "rb", buffering=0)  # kept; closed by close()
        except FileNotFoundError:
            # Only its daemon removes its segments: it stopped (or is stopping) with this batch
            # published but not yet read.
            raise SegmentGone(f"the daemon's shared memory {path} is gone") from None
        except OSError as exc:
            raise TransportError(f"cannot open the daemon's shared memory {path}: {exc}") from None
        got = (f, os.fstat(f.fileno()).st_size)
        self._extra[segment] = got
        while len(self._extra) > MAX_EXTRA_SEGMENTS:
            self._extra.popitem(last=False)[1][0].close()
        return got

    def arrays(self, slot: int, tensors: Sequence[TensorInfo]) -> list[np.ndarray]:
        """Numpy views of the tensors of ``slot`` (no copy), valid until the slot is released.

        Raises:
            TransportError: the description does not fit inside the slot (a protocol error).
        """
        if not 0 <= slot < self.slot_count:
            raise TransportError(f"slot {slot} is outside the ring's {self.slot_count} slots")
        return _views(self._base, slot * self.slot_bytes, self.slot_bytes, tensors)

    def slot_arrays(self, slot: int, tensors: Sequence[TensorInfo]) -> list[np.ndarray]:
        """:meth:`arrays`, for a caller that passes the same ``tensors`` object every batch.

        The views of each slot are checked and built once for that object (the first one
        passed; another is served by :meth:`arrays`) and each call returns new array objects
        over them (``ndarray.view``), so changing one batch's array (its shape or flags) never
        changes another's. What a batch costs then no longer depends on the number of tensors'
        descriptions (CIFAR-sized batches arrive every few hundred microseconds).

        Raises:
            TransportError: as :meth:`arrays`.
        """
        if self._layout_key is None:
            self._layout_key = tensors
        if tensors is not self._layout_key or not 0 <= slot < self.slot_count:
            return self.arrays(slot, tensors)
        views = self._slot_views[slot]
        if views is None:
            views = self._slot_views[slot] = self.arrays(slot, tensors)
        return [v.view() for v in views]

    def release(self, slot: int) -> None:
        """Nothing to do: a slot goes back through its release word or a Release message."""

    def close(self) -> None:
        """Drop the mapping (it stays alive while user tensors still reference it)."""
        self._slot_views = [None] * self.slot_count
        self._layout_key = None
        self._base = np.empty(0, np.uint8)
        self._ids = self._ctl = None
        extra, self._extra = self._extra, OrderedDict()
        for f, _ in extra.values():  # the mappings made from them live on while viewed
            with contextlib.suppress(OSError):
                f.close()
        with contextlib.suppress(BufferError):
            self._mmap.close()


def _views(
    base: np.ndarray, start: int, slot_bytes: int, tensors: Sequence[TensorInfo]
) -> list[np.ndarray]:
    """Views of ``tensors`` in the ``slot_bytes``-long slot at byte ``start`` of ``base``."""
    if start < 0 or start + slot_bytes > len(base):
        raise TransportError(f"a slot at {start} does not fit in a {len(base)}-byte segment")
    out = []
    for t in tensors:
        dt = np.dtype(t.dtype)
        count = 1
        for d in t.shape:
            count *= d
        if count * dt.itemsize != t.nbytes or t.offset + t.nbytes > slot_bytes:
            raise TransportError(
                f"tensor {t.name!r} ({t.shape}, {t.dtype}) at offset {t.offset} does not fit "
                f"in a {slot_bytes}-byte slot"
            )
        raw = base[start + t.offset : start + t.offset + t.nbytes]
        out.append(raw.view(dt).reshape(t.shape))
    return out


class NoticeChannel:
    """The client's end of a stream's notice channel (see the module docstring).

    Args:
        socket_name: ``ShmSetup.notice_socket``, a name under ``shm_dir``.
        token: ``ShmSetup.notice_token``.

    Raises:
        TransportError: the name is not a beton-serve socket name.
        OSError: the socket cannot be reached (e.g. another mount namespace); the caller then
            uses the Batches call instead.
    """

    def __init__(self, socket_name: str, token: bytes, shm_dir: Path = SHM_DIR) -> None:
        if "/" in socket_name or not socket_name.startswith("beton-"):
            raise TransportError(
                f"refusing to connect to {socket_name!r}: not a beton-serve socket"
            )
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.connect(str(shm_dir / socket_name))
            sock.sendall(notice.hello(token))
        except BaseException:
            sock.close()
            raise
        self._sock = sock

    def recv(self, nap_s: float = 0.0) -> tuple[int, int, int, int, int, bytes] | None:
        """The next record from the daemon as ``(kind, a, b, c, d, payload)``; ``None`` at end
        of file (the daemon ended the stream: its status is on the Batches call).

        ``nap_s > 0`` coalesces wake-ups: when no record is there yet, sleep ``nap_s`` seconds
        before waiting on the socket, so that one wake-up finds several records (see
        ``beton_client._stream.nap_for``). A record that arrives during the nap waits for it.

        Raises:
            TransportError: the daemon sent something that is not a record.
        """
        sock = self._sock
        try:
            if nap_s > 0.0:
                try:
                    data = sock.recv(notice.MAX_RECORD, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    time.sleep(nap_s)
                    data = sock.recv(notice.MAX_RECORD)
            else:
                data = sock.recv(notice.MAX_RECORD)
        except OSError:
            return None
        if not data:
            return None
        try:
            return notice.unpack(data)
        except ValueError as exc:
            raise TransportError(f"bad record on the notice channel: {exc}") from None

    def release(self, slot: int, index: int, wait_us: int) -> None:
        """Give ``slot`` back; a daemon that is gone is noticed by the next :meth:`recv`."""
        with contextlib.suppress(OSError):
            self._sock.send(notice.release(slot, index, wait_us))

    def start(self, epoch: int, next_batch: int, credits: int) -> None:
        """Start an epoch (a daemon that is gone is noticed by the next :meth:`recv`)."""
        with contextlib.suppress(OSError):
            self._sock.send(notice.start(epoch, next_batch, credits))

    def wake(self) -> None:
        """Tell a starved daemon that release words changed."""
        with contextlib.suppress(OSError):
            self._sock.send(notice.wake())

    def close(self) -> None:
        """Close the connection (idempotent); the daemon ends the stream if it still runs."""
        self._sock.close()
