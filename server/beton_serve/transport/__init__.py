"""Transports: how a batch written by the engine reaches a client (DESIGN.md §6).

The seam is :class:`SlotTransport`, a ring of fixed-size batch slots owned by one stream, and
:class:`TransportFactory`, which builds rings of one kind. The daemon (``beton_serve.daemon``)
drives them; nothing here touches protobuf (``beton_serve.rpc`` converts :class:`TransportSetup`
and :class:`Published` to messages).

Life of a slot, for every transport::

    FREE --acquire()--> FILLING --publish()--> LEASED --release()--> FREE
                           (engine writes into host_views(slot))     (client is done)

Threading: every method of a :class:`SlotTransport` is called from the daemon's event-loop thread
only, except that engine worker threads write into the arrays returned by :meth:`host_views`
between ``acquire`` and ``publish``. The transport owns all of its memory; the arrays it returns
stay valid until :meth:`SlotTransport.close`, which the daemon calls exactly once, when the
stream ends (normally, on error, on client death or on shutdown), even if slots are still leased.
"""

from __future__ import annotations

from beton_serve.transport.base import (
    Published,
    SlotTransport,
    TransportFactory,
    TransportSetup,
)
from beton_serve.transport.shm import ShmFactory, ShmNamer, ShmRing, sweep_stale_segments

__all__ = [
    "Published",
    "ShmFactory",
    "ShmNamer",
    "ShmRing",
    "SlotTransport",
    "TransportFactory",
    "TransportSetup",
    "sweep_stale_segments",
]
