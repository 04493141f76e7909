"""What a client tells a stream: the events of the ``Batches`` call and the notice channel.

``beton_serve.rpc`` turns the ``Batches`` call's messages into these (``event_from_message``); the
notice channel's ``START`` and ``RELEASE`` records become them in ``Stream.attach_notices``. All
are handled on the event-loop thread (``Daemon.run_stream``, ``Stream.on_release``,
``Stream.on_credit``).
"""

from __future__ import annotations

from dataclasses import dataclass

from beton_serve.errors import TransportError

__all__ = ["ClientEvent", "ClientHungUp", "CreditEvent", "ReleaseSlot", "StartEpoch"]


class ClientHungUp(TransportError):
    """The client closed its notice channel: the stream ends quietly."""


@dataclass(frozen=True, slots=True)
class StartEpoch:
    """Start (or resume) ``epoch`` at batch ``next_batch`` with ``credits`` (0: the ring size);
    ``notices``: publish on the stream's notice channel rather than the Batches call."""

    stream_id: str
    epoch: int
    next_batch: int = 0
    credits: int = 0
    notices: bool = False


@dataclass(frozen=True, slots=True)
class ReleaseSlot:
    """The client is done with ``slot`` (it held batch ``batch_index``); it waited ``wait_us``."""

    slot: int
    batch_index: int = 0
    wait_us: int = 0


@dataclass(frozen=True, slots=True)
class CreditEvent:
    """The client grants ``count`` more credits (up to the ring size)."""

    count: int


ClientEvent = StartEpoch | ReleaseSlot | CreditEvent
