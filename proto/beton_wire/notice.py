"""The notice channel of the shm transport: batch-ready and release notices without gRPC.

A batch of a small-sample dataset (CIFAR-like: 512 images of 32x32) takes well under a millisecond
to decode, so one gRPC message each way per batch, with its HTTP/2 framing, completion-queue
threads and protobuf objects, would cost about as much CPU as the batch itself. For shm streams the
daemon therefore also listens on a ``SOCK_SEQPACKET`` unix socket under ``/dev/shm`` (reachable
exactly when the ring's segment is, mode 0600), and the per-batch traffic moves there:

* the client connects and sends ``HELLO`` with the stream's secret token
  (``ShmSetup.notice_token``) as payload, then starts its first epoch on the Batches call with
  ``Start.notices = true``, and later epochs with ``START`` records;
* the daemon sends ``BATCH`` (slot, epoch, batch index, rows) when a slot is published, and
  ``END`` (epoch, batches) after an epoch's last batch. ``BATCH_AT`` is a ``BATCH`` whose data is
  not in the slot but in another segment of the daemon (a batch decoded once for several
  identical streams, issue 6): its payload is the byte offset (uint64) and the segment name; the sample ids of a batch are in the
  segment's id table (``ShmSetup.ids_offset``), written before the notice is sent;
* the client releases a slot it is done with. When the segment has release words
  (``ShmSetup.release_offset``: ``[starved, wait_us, word per slot]``, uint64 each) it stores the
  batch's lease token (:func:`lease_token`) in the slot's word and its total wait in ``wait_us``,
  which costs no system call: the daemon collects released slots whenever a batch completes.
  The daemon zeroes a slot's word before it announces a batch in it, so that a word left from
  the slot's last lease never reads as this one's release. Only when the daemon has nothing in flight and is waiting for a slot does it set ``starved``;
  a client that sees it sends ``WAKE``. (If both sides miss each other's store, the daemon's
  back-off timer collects the release a few milliseconds later.) Without release words the
  client sends ``RELEASE`` (slot, batch index, microseconds it waited) instead.

Errors and the end of the stream still travel on the Batches call: when the daemon ends a stream
it closes the connection, the client reads end-of-file and then the call's status.

Every record is one 32-byte header, :data:`RECORD` = ``(kind, a, b, c, d)``, plus an optional
payload (``HELLO`` and ``BATCH_AT`` have one). This module depends on the standard library only.
"""

from __future__ import annotations

import struct

__all__ = [
    "BATCH",
    "BATCH_AT",
    "END",
    "HELLO",
    "MAX_RECORD",
    "RECORD",
    "RELEASE",
    "RELEASE_WORDS",
    "START",
    "STARVED_WORD",
    "WAIT_WORD",
    "WAKE",
    "TOKEN_BYTES",
    "batch",
    "batch_at",
    "end",
    "hello",
    "lease_token",
    "release",
    "split_at",
    "start",
    "unpack",
    "wake",
]

#: ``kind`` (uint8), 3 pad bytes, ``a`` (uint32), ``b``, ``c``, ``d`` (uint64), little-endian.
RECORD = struct.Struct("<B3xIQQQ")

#: Client -> daemon, first record of a connection: payload = the stream's token.
HELLO = 1
#: Daemon -> client: slot ``a`` holds batch ``c`` of epoch ``b``, with ``d`` rows.
BATCH = 2
#: Daemon -> client: epoch ``b`` ended after ``c`` batches.
END = 3
#: Client -> daemon: slot ``a`` (batch ``b``) is free; the client had waited ``c`` microseconds.
#: The daemon ignores one whose batch is not the one the slot holds (stale or replayed).
RELEASE = 4

#: Daemon -> client: like ``BATCH``, but the data is at payload ``(offset, segment name)``.
BATCH_AT = 5
#: Client -> daemon: release words changed while the daemon was starved (no fields).
WAKE = 6
#: Client -> daemon: start epoch ``b`` at batch ``c`` with ``a`` credits (0: the ring size), as
#: the Batches call's ``Start`` with ``notices``; only after the call's first ``Start``.
START = 7

#: Index of the ``starved`` word and of the ``wait_us`` word among the release words; the word
#: of slot ``s`` is ``RELEASE_WORDS + s``.
STARVED_WORD = 0
WAIT_WORD = 1
RELEASE_WORDS = 2

#: Length of a stream token.
TOKEN_BYTES = 32
#: Longest segment name in a ``BATCH_AT``.
MAX_SEGMENT_NAME = 200
_OFFSET = struct.Struct("<Q")
#: Distinct lease tokens: 1 .. 2**64 - 2.
_TOKENS = (1 << 64) - 2
#: Longest record either side sends (header plus a ``BATCH_AT`` payload).
MAX_RECORD = RECORD.size + _OFFSET.size + MAX_SEGMENT_NAME


def hello(token: bytes) -> bytes:
    """The ``HELLO`` record carrying ``token``."""
    return RECORD.pack(HELLO, 0, 0, 0, 0) + token


def batch(slot: int, epoch: int, index: int, length: int) -> bytes:
    """The ``BATCH`` record."""
    return RECORD.pack(BATCH, slot, epoch, index, length)


def batch_at(slot: int, epoch: int, index: int, length: int, segment: str, offset: int) -> bytes:
    """The ``BATCH_AT`` record: batch ``index`` is at ``offset`` in ``segment``.

    Raises:
        ValueError: the segment name is longer than :data:`MAX_SEGMENT_NAME` bytes.
    """
    name = segment.encode()
    if len(name) > MAX_SEGMENT_NAME:
        raise ValueError(f"segment name {segment!r} is too long for a notice record")
    return RECORD.pack(BATCH_AT, slot, epoch, index, length) + _OFFSET.pack(offset) + name


def split_at(payload: bytes) -> tuple[int, str]:
    """``(offset, segment name)`` from a ``BATCH_AT`` payload.

    Raises:
        ValueError: the payload is too short or the name is not ASCII.
    """
    if len(payload) <= _OFFSET.size:
        raise ValueError("a BATCH_AT record needs an offset and a segment name")
    return _OFFSET.unpack_from(payload)[0], payload[_OFFSET.size :].decode("ascii")


def end(epoch: int, batches: int) -> bytes:
    """The ``END`` record."""
    return RECORD.pack(END, 0, epoch, batches, 0)


def release(slot: int, index: int, wait_us: int) -> bytes:
    """The ``RELEASE`` record (``wait_us`` is clamped to ``[0, 2**64)``)."""
    return RECORD.pack(RELEASE, slot, index, min(max(0, wait_us), 2**64 - 1), 0)


def start(epoch: int, next_batch: int, credits: int) -> bytes:
    """The ``START`` record."""
    return RECORD.pack(START, credits, epoch, next_batch, 0)


def wake() -> bytes:
    """The ``WAKE`` record."""
    return RECORD.pack(WAKE, 0, 0, 0, 0)


def lease_token(epoch: int, index: int, batches_per_epoch: int) -> int:
    """The token that releases batch ``index`` of ``epoch``: its position in the stream plus one
    (never 0, which a fresh word holds), kept in a release word's 64 bits below the daemon's
    "no lease" value (``2**64 - 1``): it wraps only past ``2**64 - 2`` batches, far beyond any
    two leases that are live at once.

    It names a batch, not a lease: the same batch of the same epoch read again on one stream
    (``next_epoch`` set back, ``load_state_dict`` to an epoch already read) has the same token, so a slot's word may still hold it from the slot's
    last lease. The daemon therefore clears the word when it arms the slot, before it announces
    the batch (``ShmRing.arm``)."""
    return (epoch * batches_per_epoch + index) % _TOKENS + 1


def unpack(data: bytes) -> tuple[int, int, int, int, int, bytes]:
    """Split a record into ``(kind, a, b, c, d, payload)``.

    Raises:
        ValueError: ``data`` is shorter than a header.
    """
    if len(data) < RECORD.size:
        raise ValueError(f"a notice record has at least {RECORD.size} bytes, not {len(data)}")
    kind, a, b, c, d = RECORD.unpack_from(data)
    return kind, a, b, c, d, data[RECORD.size :]
