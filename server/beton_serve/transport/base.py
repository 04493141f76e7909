"""The transport seam: protocols and plain data shared by every transport (see the package)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
from beton_wire.slots import SlotLayout

__all__ = [
    "HostSlotRing",
    "Published",
    "SlotTransport",
    "TransportFactory",
    "TransportSetup",
    "slot_views",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class TransportSetup:
    """What a client needs to attach to a ring; ``kind`` selects which fields are meaningful.

    Attributes:
        kind: the transport name.
        slot_count: number of slots.
        slot_bytes: bytes per slot.
        segment: shm segment name under /dev/shm (shm).
        segment_bytes: size of that segment (shm).
        ids_offset: offset of the sample-id table inside the segment (shm; 0: none).
        release_offset: offset of the release words inside the segment (shm; 0: none).
        notice_socket: the notice channel's socket name under /dev/shm (shm; "": none).
        notice_token: the secret binding a notice connection to the stream (shm).
        extra: transport-specific values (e.g. cuda_ipc handles as bytes); plain data only.
    """

    kind: str
    slot_count: int
    slot_bytes: int
    segment: str = ""
    segment_bytes: int = 0
    ids_offset: int = 0
    release_offset: int = 0
    notice_socket: str = ""
    notice_token: bytes = b""
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class Published:
    """What the client needs to read one published slot, beyond the slot layout.

    Attributes:
        data: the slot's bytes for transports that carry them in the message (grpc), else empty.
        extra: transport-specific plain data (e.g. an event handle).
    """

    data: Sequence[bytes] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)


class NoticeExtras(Protocol):
    """What a ring offers the notice channel (``beton_wire.notice``), beyond :class:`SlotTransport`.

    Only the shm ring has it: an id table the client reads each batch's sample ids from, and one
    release word per slot that the client stores a lease token into instead of sending a message.
    """

    #: Whether the daemon waits for a release to go on (the client then sends ``WAKE``).
    starved: bool

    def write_ids(self, slot: int, ids: np.ndarray) -> None:
        """Store the sample ids of the batch in ``slot`` in the id table (before publishing)."""
        ...

    def arm(self, slot: int, token: int) -> None:
        """Expect ``token`` in ``slot``'s release word."""
        ...

    def reap(self) -> list[int]:
        """The slots whose release word holds the armed token (disarmed; release them)."""
        ...

    def disarm(self, slot: int) -> None:
        """Stop expecting a token in ``slot``'s word (it was released another way)."""
        ...

    def client_wait_us(self) -> int:
        """The client's total wait for data, as it last stored it (microseconds)."""
        ...


@runtime_checkable
class SlotTransport(Protocol):
    """A ring of batch slots owned by one stream (see the module docstring for the contract)."""

    kind: str
    layout: SlotLayout
    slot_count: int

    @property
    def notice_extras(self) -> NoticeExtras | None:
        """The id table and release words of the notice channel, or ``None`` (not shm)."""
        ...

    def setup(self) -> TransportSetup:
        """Describe the ring for the client (sent once, in the OpenStream reply)."""
        ...

    def acquire(self) -> int | None:
        """Take a FREE slot and mark it FILLING; ``None`` when every slot is in use."""
        ...

    def host_views(self, slot: int) -> list[np.ndarray]:
        """The ``(batch_size, *shape)`` arrays of ``slot``, in output order, for the engine to fill.

        The memory belongs to the transport and stays valid until :meth:`close`.
        """
        ...

    def publish(self, slot: int, length: int) -> Published:
        """The engine finished writing ``length`` rows of ``slot``: mark it LEASED."""
        ...

    def release(self, slot: int) -> bool:
        """The client is done with ``slot``; return ``False`` if it was not leased (ignored)."""
        ...

    def abandon(self, slot: int) -> None:
        """Return a FILLING slot to FREE without publishing it (the batch failed or was cancelled)."""
        ...

    def leased(self) -> int:
        """Number of slots currently FILLING or LEASED."""
        ...

    def nbytes(self) -> int:
        """Bytes of memory the ring holds."""
        ...

    def close(self) -> None:
        """Free every slot and the ring's memory (idempotent); leased slots are reclaimed."""
        ...


class TransportFactory(Protocol):
    """Builds rings of one transport kind for the daemon.

    Which kind a stream uses is decided first by :func:`beton_serve.transport.negotiate.negotiate`;
    the daemon then calls ``create`` of that kind's factory on its event-loop thread.
    """

    kind: str

    def create(
        self, layout: SlotLayout, slot_count: int, *, device_index: int = -1
    ) -> SlotTransport:
        """Create a ring of ``slot_count`` slots of ``layout``.

        Args:
            layout: the slot layout (host side: what the engine writes).
            slot_count: number of slots.
            device_index: for cuda_ipc, the GPU in the daemon's numbering; -1 otherwise.

        Raises:
            TransportError: the ring cannot be created (the message says why and what to do).
        """
        ...


_FREE, _FILLING, _LEASED = 0, 1, 2


def slot_views(base: np.ndarray, layout: SlotLayout, slot: int) -> list[np.ndarray]:
    """The writable ``(batch_size, *shape)`` arrays of ``slot`` of ``layout`` in ``base`` (a flat
    uint8 array of whole slots), in output order."""
    start = layout.slot_offset(slot)
    views = []
    for t in layout.tensors:
        raw = base[start + t.offset : start + t.offset + t.sample_bytes * layout.batch_size]
        views.append(raw.view(np.dtype(t.dtype)).reshape((layout.batch_size, *t.shape)))
    return views


class HostSlotRing:
    """The slot state machine and host views shared by rings whose slots live in host memory.

    Each slot moves ``FREE -> FILLING`` (:meth:`acquire`, the engine writes into
    :meth:`host_views`) ``-> LEASED`` (``publish``, the client reads it) ``-> FREE``
    (:meth:`release`); :meth:`abandon` returns a FILLING slot unpublished. All calls come from the
    daemon's event-loop thread. Subclasses own the memory (``self._base``, a flat uint8 array of
    ``slot_count * layout.slot_bytes`` bytes), call :meth:`_init_slots` once it exists, and
    implement ``setup``/``publish``/``nbytes``/``close``.
    """

    kind: str
    layout: SlotLayout
    slot_count: int
    _base: np.ndarray

    @property
    def notice_extras(self) -> NoticeExtras | None:
        """``None``: a plain host ring has no release words (the shm ring overrides this)."""
        return None

    def _init_slots(self) -> None:
        self._state = [_FREE] * self.slot_count
        self._busy = 0  # slots FILLING or LEASED
        self._closed = False
        self._views = [self._make_views(s) for s in range(self.slot_count)]

    def _make_views(self, slot: int) -> list[np.ndarray]:
        return slot_views(self._base, self.layout, slot)

    def acquire(self) -> int | None:
        """Take a FREE slot (lowest index first) and mark it FILLING; ``None`` if none is free."""
        if self._closed:
            return None
        if self._busy >= self.slot_count:
            return None
        for i, st in enumerate(self._state):
            if st == _FREE:
                self._state[i] = _FILLING
                self._busy += 1
                return i
        return None

    def host_views(self, slot: int) -> list[np.ndarray]:
        """The writable ``(batch_size, *shape)`` views of ``slot``, in output order."""
        return self._views[slot]

    def _mark_leased(self, slot: int) -> bool:
        """FILLING -> LEASED; ``False`` (nothing changes) if the slot was not being filled."""
        if self._state[slot] != _FILLING:
            return False
        self._state[slot] = _LEASED
        return True

    def release(self, slot: int) -> bool:
        """Return a LEASED slot to FREE; ``False`` (and nothing changes) if it was not leased."""
        if not 0 <= slot < self.slot_count or self._state[slot] != _LEASED:
            return False
        self._state[slot] = _FREE
        self._busy -= 1
        return True

    def abandon(self, slot: int) -> None:
        """Return a FILLING slot to FREE without publishing it."""
        if 0 <= slot < self.slot_count and self._state[slot] == _FILLING:
            self._state[slot] = _FREE
            self._busy -= 1

    def leased(self) -> int:
        """Slots that are FILLING or LEASED."""
        return self._busy

    def _reset_slots(self) -> None:
        """Mark the ring closed: every slot FREE, no views, no memory."""
        self._closed = True
        self._state = [_FREE] * self.slot_count
        self._busy = 0
        self._views = []
        self._base = np.empty(0, np.uint8)
