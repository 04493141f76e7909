"""Publishers: where a stream's finished batch goes once the stream has booked it.

A stream reaches its client on one of three paths, and each has one :class:`Publisher`:

* :class:`CallPublisher`: the ``Batches`` call (``Stream.run_epoch`` drives the epoch); queues a
  :class:`BatchOut` that the call yields;
* :class:`NoticePublisher`: the notice pump (``daemon._pump``); sends a ``BATCH`` or ``BATCH_AT``
  record (``beton_wire.notice``);
* ``daemon._grpc_batches.StreamProducer``: the grpc batch method, one WANT per batch; hands the
  slot's views to the chunk encoder.

Everything else is the stream's, done once for all three (``daemon._stream.Stream``): it takes a
slot within the client's credits (``acquire``), submits the batch into it, and when the batch is
decoded books it in :meth:`Stream.finish <beton_serve.daemon._stream.Stream.finish>` (the sample
ids the batch holds, the stream's and dataset's counters, the bad samples, the slot's lease, an
shm ring's id table and release word, a sharing group's reference) before it calls
:meth:`Publisher.publish` with the :class:`Finished` batch. The slot comes back through
``Stream.release`` whatever the publisher.

Threads: ``publish`` runs where ``Stream.finish`` runs: on the event-loop thread for the
``Batches`` call and the grpc method; on the engine worker that finished the batch for the notice
pump, which holds ``Stream.lock``. It must not block (a notice record is a non-blocking send).

Memory: :attr:`Finished.arrays` are views of the daemon's slot; the slot stays leased until the
client releases it, so a publisher may hand the views on (the grpc encoder copies them out, then
releases the slot) but must not keep them past that release. :class:`BatchOut` holds no views.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
from beton_wire.slots import SlotLayout
from numpy.typing import NDArray

from beton_serve.transport.base import Published

if TYPE_CHECKING:
    from beton_serve.transport.notice import NoticeConn

__all__ = [
    "BatchOut",
    "CallPublisher",
    "EpochEnd",
    "Finished",
    "NoticePublisher",
    "Publisher",
    "TensorOut",
]


@dataclass(frozen=True, slots=True)
class Finished:
    """A decoded batch, booked by its stream and ready to publish.

    Attributes:
        epoch, batch_index: which batch.
        slot: the ring slot that holds it (leased to the client from now on).
        length: rows in the batch (the last batch of an epoch may be short).
        sample_ids: the samples it holds, uint64 (a skipped bad sample is replaced).
        arrays: one view per daemon-side output into the slot, full batch size, C-contiguous.
        published: what the ring's ``publish`` returned (transport-specific, e.g. a CUDA event).
        at: ``(segment, offset)`` when the data lives in a sharing group's buffer, not in
            ``slot`` (zero-copy sharing, shm with the notice channel only); ``None`` otherwise.
        skipped: ``(sample_id, op, cause)`` of each failing sample the batch skipped (under a
            bad-sample budget), as charged; the grpc publisher sends them
            (``beton_wire.skipped``).
    """

    epoch: int
    batch_index: int
    slot: int
    length: int
    sample_ids: NDArray[np.uint64]
    arrays: Sequence[np.ndarray]
    published: Published
    at: tuple[str, int] | None = None
    skipped: Sequence[tuple[int, str, BaseException]] = ()


class Publisher(Protocol):
    """Hands a stream's booked batches to its client (see the module docstring).

    ``Stream.finish`` calls :meth:`publish` once per batch, in the order the driver of the path
    finishes them (batch order on the ``Batches`` call and the notice channel; WANT order on the
    grpc method); ``Stream.end_epoch`` calls :meth:`end` once after the last batch of an epoch
    (never on the grpc method, which has no epochs).
    """

    def publish(self, batch: Finished) -> None:
        """Hand ``batch`` to the client.

        Raises:
            TransportError: the client is gone or stopped reading (the stream then ends).
        """
        ...

    def end(self, epoch: int, batches: int) -> None:
        """Tell the client that ``epoch`` ended after ``batches`` batches.

        Raises:
            TransportError: the client is gone or stopped reading.
        """
        ...


@dataclass(frozen=True, slots=True)
class TensorOut:
    """Where one output of a published batch is: shape includes the batch dimension."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class BatchOut:
    """A batch published on the ``Batches`` call (``beton_serve.rpc`` makes the message)."""

    epoch: int
    batch_index: int
    slot: int
    length: int
    tensors: tuple[TensorOut, ...]
    sample_ids: np.ndarray
    published: Published
    #: ``(segment, offset)`` when the data is not in ``slot`` but in a sharing group's buffer
    #: (zero-copy sharing, notice channel only); ``None`` otherwise.
    at: tuple[str, int] | None = None


@dataclass(frozen=True, slots=True)
class EpochEnd:
    """Every batch of ``epoch`` was published."""

    epoch: int
    batches: int


class CallPublisher:
    """The ``Batches`` call's publisher: :attr:`items` queues what the call yields next.

    Event-loop thread only (``Stream.run_epoch`` publishes and yields on the loop).
    """

    def __init__(self, layout: SlotLayout) -> None:
        self.layout = layout
        #: Published batches and epoch ends, oldest first, not yet yielded.
        self.items: deque[BatchOut | EpochEnd] = deque()

    def publish(self, batch: Finished) -> None:
        """Queue the batch's message: where each output lies in the slot, the ids, the lease."""
        n = batch.length
        self.items.append(
            BatchOut(
                epoch=batch.epoch,
                batch_index=batch.batch_index,
                slot=batch.slot,
                length=n,
                tensors=tuple(
                    TensorOut(t.name, (n, *t.shape), t.dtype, t.offset, t.sample_bytes * n)
                    for t in self.layout.tensors
                ),
                sample_ids=batch.sample_ids,
                published=batch.published,
                at=batch.at,
            )
        )

    def end(self, epoch: int, batches: int) -> None:
        """Queue the epoch's end."""
        self.items.append(EpochEnd(epoch=epoch, batches=batches))


class NoticePublisher:
    """The notice channel's publisher: one 32-byte record per batch (``beton_wire.notice``).

    Called on the engine worker that finished the batch, under ``Stream.lock``; the client reads
    the sample ids from the ring's id table, so the record carries none.
    """

    def __init__(self, conn: NoticeConn) -> None:
        self.conn = conn

    def publish(self, batch: Finished) -> None:
        """Send ``BATCH`` (the data is in the slot) or ``BATCH_AT`` (in a group's buffer)."""
        if batch.at is None:
            self.conn.send_batch(batch.slot, batch.epoch, batch.batch_index, batch.length)
        else:
            segment, offset = batch.at
            self.conn.send_batch_at(
                batch.slot, batch.epoch, batch.batch_index, batch.length, segment, offset
            )

    def end(self, epoch: int, batches: int) -> None:
        """Send ``END``."""
        self.conn.send_end(epoch, batches)
