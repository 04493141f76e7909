"""The grpc transport's ring: batch slots in private host memory, and their factory.

A stream negotiated as ``grpc`` (a client on another host, or ``transport="grpc"``) gets a
:class:`HostRing`: the same slot ring as shm, in private process memory instead of a shared
segment. Its batches travel on the pass-through batch method (``transport.grpc_codec``); the
daemon's producer for that method (``daemon._grpc_batches``) fills the ring and hands its slots to
the encoder. :class:`GrpcFactory` builds rings and checks the compressions a daemon allows.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from beton_wire.framing import ALL_CODECS, DEFAULT_CHUNK_BYTES, Codec, Compression
from beton_wire.slots import SlotLayout

from beton_serve.errors import ConfigError, SpecError, TransportError
from beton_serve.transport.base import HostSlotRing, Published, TransportSetup

__all__ = ["BATCH_METHOD", "BATCH_SERVICE", "GrpcFactory", "HostRing", "parse_codecs"]

#: The batch method's full path, as the OpenStream reply gives it to clients.
BATCH_SERVICE = "beton_wire.v1.BatchStream"
BATCH_METHOD = f"/{BATCH_SERVICE}/Stream"


def parse_codecs(names: Iterable[str]) -> frozenset[Codec]:
    """The allow-list of compressions from names (``"lz4"``, ``"zstd"``); ``none`` is always in.

    Raises:
        ConfigError: an unknown name.
    """
    out = {Codec.NONE}
    for n in names:
        try:
            out.add(Codec[n.strip().upper()])
        except KeyError:
            raise ConfigError(
                f"unknown grpc compression {n!r}: use {sorted(c.name.lower() for c in ALL_CODECS)}"
            ) from None
    return frozenset(out)


class HostRing(HostSlotRing):
    """A ring of batch slots in private host memory (the grpc transport's :class:`SlotTransport`).

    Args:
        layout: the slot layout of the stream.
        slot_count: number of slots (at least 1).
        setup_extra: what :meth:`setup` tells the client (method path, chunk size).
    """

    kind = "grpc"

    def __init__(
        self, layout: SlotLayout, slot_count: int, setup_extra: dict[str, Any] | None = None
    ) -> None:
        if slot_count < 1:
            raise TransportError(f"a ring needs at least one slot, not {slot_count}")
        self.layout = layout
        self.slot_count = slot_count
        self._extra = dict(setup_extra or {})
        self._base = np.empty(layout.slot_bytes * slot_count, np.uint8)
        self._init_slots()

    def setup(self) -> TransportSetup:
        """Method path and chunk size for the client (no memory to map)."""
        return TransportSetup(
            kind="grpc",
            slot_count=self.slot_count,
            slot_bytes=self.layout.slot_bytes,
            extra=dict(self._extra),
        )

    def publish(self, slot: int, length: int) -> Published:
        """Mark a FILLING slot LEASED (the batch method is copying it out)."""
        if not self._mark_leased(slot):
            raise TransportError(f"slot {slot} was published without being filled")
        return Published()

    def nbytes(self) -> int:
        """Bytes of the ring's memory."""
        return int(self._base.nbytes)

    def close(self) -> None:
        """Reclaim every slot and drop the memory (idempotent; engine views keep it alive)."""
        if self._closed:
            return
        self._reset_slots()


class GrpcFactory:
    """Builds :class:`HostRing` s; carries what every grpc stream's reply says.

    Args:
        chunk_bytes: raw bytes per chunk message (benchmarks chose 2 MiB).
        allowed_codecs: compressions clients may ask for (``NONE`` is always allowed).
        method: the batch method's full path.
    """

    kind = "grpc"

    def __init__(
        self,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        allowed_codecs: Iterable[Codec] = ALL_CODECS,
        method: str = BATCH_METHOD,
    ) -> None:
        self.chunk_bytes = int(chunk_bytes)
        self.allowed_codecs = frozenset({Codec.NONE, *allowed_codecs})
        self.method = method

    def check_compression(self, text: str) -> str:
        """Validate a client's requested compression; returns it normalised ("" for none).

        Raises:
            SpecError: malformed, or not enabled on this daemon.
        """
        if not text or text.lower() == "none":
            return ""
        try:
            comp = Compression.parse(text)
        except ValueError as exc:
            raise SpecError(f"compression {text!r}: {exc}") from None
        if comp.codec not in self.allowed_codecs:
            allowed = sorted(c.name.lower() for c in self.allowed_codecs if c is not Codec.NONE)
            raise SpecError(
                f"compression {text!r} is not enabled on this daemon (it allows {allowed or 'none'});"
                " pass compression=None or start the daemon with --grpc-compression"
            )
        return str(comp) if comp.codec is not Codec.NONE else ""

    def create(self, layout: SlotLayout, slot_count: int, *, device_index: int = -1) -> HostRing:
        """A new ring (``device_index`` is ignored)."""
        return HostRing(
            layout, slot_count, {"chunk_bytes": self.chunk_bytes, "method": self.method}
        )
