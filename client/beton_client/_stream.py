"""One local stream of a ``beton_client.Loader`` (shm or cuda_ipc) and its epoch iterator.

A :class:`_Stream` owns the stream's ``Batches`` call, its receiver and, for shm streams whose
daemon offers one, its notice channel (``beton_wire.notice``). Per batch it hands the iterator a
:class:`Ready` (which slot, which rows, which sample ids) or an :class:`End`, read from the notice
channel when there is one and from the Batches call otherwise; releases go back the same way.
With the notice channel, a batch costs two 32-byte socket records instead of two gRPC messages,
which matters when a batch is a fraction of a millisecond of decoding (CIFAR-like data).

Threading: used from the thread that iterates the Loader; gRPC consumes the request queue on its
own thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from beton_wire import notice
from beton_wire.slots import DTYPE_NAMES, slot_layout
from beton_wire.v1 import beton_pb2 as pb

from beton_client._forks import owner_only
from beton_client._tail import OutputInfo, wire_dtype
from beton_client._transport import Receiver, ShmReceiver, TensorInfo
from beton_client._transport.shm import NoticeChannel, SegmentGone
from beton_client.errors import BetonClientError, ServerError, ServerUnavailable, from_rpc_error
from beton_client.frontend import RawBatch, pipelines_key

__all__ = ["End", "Ready"]

#: Wire dtype code -> numpy name, for the per-batch path (0 and unknown codes: not in it).
_DTYPES = {code: name for code, name in enumerate(DTYPE_NAMES) if name}
log = logging.getLogger("beton_client")

#: Coalesced waits (see :meth:`_Stream.nap_for`): a stream whose batches come at most this many
#: seconds apart naps before waiting for one that is not published yet ...
NAP_MAX_PACE_S = 0.005
#: ... for a third of its ring's slots in batch periods (so one wake-up finds about as many
#: batches more), at most this many, ...
NAP_BATCHES = 5.0
#: ... when its ring has at least this many slots (room for what is decoded meanwhile).
NAP_MIN_SLOTS = 8
#: Weight of the newest period in the stream's average period.
NAP_EWMA = 0.125
#: ``0`` turns coalesced waits off (read when a stream opens).
ENV_COALESCE = "BETON_CLIENT_COALESCE_WAITS"


def nap_batches(slots: int) -> float:
    """Batch periods a stream whose ring has ``slots`` slots naps (:meth:`_Stream.nap_for`): a
    third of its slots, at most :data:`NAP_BATCHES`. The daemon fills the ring meanwhile, and
    the slots the client holds or the daemon is decoding into stay out of that third.

    Why a third and not a fixed 2.5: each nap is a sleep and a wake-up, which costs the client
    ~80-100 us of CPU per wake-up on the 2-core VM measured (its calls that napped took 91-125 us
    of thread CPU, the others 16-31 us), while the batches a wake-up collects cost ~20 us each.
    On CIFAR-sized batches (16 slots) 5 periods instead of 2.5 cut the client's wake-ups from
    0.33 to 0.17 per batch and its CPU per batch by ~5-15 us (benchmarks/RESULTS.md, session
    59). A ring of 8 slots naps ~2.7 periods, as all rings did before.
    """
    return min(NAP_BATCHES, slots / 3.0)


@dataclass(frozen=True, slots=True)
class Ready:
    """A published batch: ``slot`` holds batch ``index`` of ``epoch``, ``length`` rows."""

    epoch: int
    index: int
    slot: int
    length: int
    tensors: Sequence[TensorInfo]
    sample_ids: np.ndarray
    #: ``(segment, offset)`` of a batch shared with identical streams, else ``None`` (in the slot).
    at: tuple[str, int] | None = None


@dataclass(frozen=True, slots=True)
class End:
    """The daemon ended ``epoch`` after ``batches`` batches."""

    epoch: int
    batches: int


class _Stream:
    """One open local stream (``beton_client.frontend.Feed``): its Batches call, its receiver, its outputs."""

    def __init__(
        self,
        channel: grpc.Channel,
        stub: Any,
        reply: Any,
        receiver: Receiver,
        key: bytes,
        target: str,
    ) -> None:
        self.channel = channel
        self.reply = reply
        self.receiver = receiver
        self.key = key
        self.target = target
        self.num_batches = int(reply.num_batches)
        self.num_samples = int(reply.num_samples)
        #: The dataset's files by content (``""``: a daemon that does not say).
        self.dataset_digest = str(reply.dataset_digest)
        self.batch_rows = max(1, int(reply.batch_size))
        self.names = [o.name for o in reply.outputs]
        self._outputs = tuple(OutputInfo.from_wire(o) for o in reply.outputs)
        #: False while an epoch was started and its end not read (then it cannot start another).
        self.complete = True
        self.held: tuple[int, int, int, int] | None = None  # (slot, batch, wait_us, lease token)
        self.wait_us = 0  # total, reported through the release words
        self._started = False
        self.notice = _connect_notices(reply, receiver)
        #: Per-stream constants of the per-batch path: the shm receiver (``None``: another
        #: transport) and the receiver's own release step (cuda_ipc records an event there).
        self.shm = receiver if isinstance(receiver, ShmReceiver) else None
        self._release_hook = None if self.shm is not None else receiver.release
        self._layout = slot_layout(
            [(o.name, tuple(o.shape), wire_dtype(o.dtype)) for o in reply.outputs],
            self.batch_rows,
        )
        self._full: list[TensorInfo] | None = None
        #: Coalesced waits: whether this stream may nap, its average period between batches
        #: (seconds) and when the iterator last asked for a batch (see :meth:`nap_for`).
        self._may_nap = (
            self.notice is not None
            and self.shm is not None
            and self.shm.slot_count >= NAP_MIN_SLOTS
            and os.environ.get(ENV_COALESCE, "1").strip() != "0"
        )
        self._nap_batches = nap_batches(self.shm.slot_count if self.shm is not None else 0)
        self._pace = 0.0
        self._last_ask = 0.0
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._call = stub.Batches(iter(self._requests.get, None))
        self.closed = False
        self._finalizer = weakref.finalize(
            self, owner_only(_close_stream), self._requests, self._call, receiver, self.notice
        )

    @property
    def outputs(self) -> Sequence[OutputInfo]:
        return self._outputs

    def accepts(self, plans: Sequence[Any]) -> bool:
        return self.complete and not self.closed and pipelines_key(plans) == self.key

    def epoch(self, epoch: int, start: int) -> _LocalEpochFeed:
        return _LocalEpochFeed(self, epoch, start)

    def send(self, msg: Any) -> None:
        self._requests.put(msg)

    def start(self, epoch: int, next_batch: int) -> None:
        """Start ``epoch`` at ``next_batch`` with every credit (after the Batches call's first
        ``Start``, on the notice channel when there is one)."""
        if self.notice is not None and self._started:
            self.notice.start(epoch, next_batch, self.reply.max_credits)
            return
        self._started = True
        self.send(
            pb.ClientMessage(
                start=pb.Start(
                    stream_id=self.reply.stream_id,
                    epoch=epoch,
                    next_batch=next_batch,
                    credits=self.reply.max_credits,
                    notices=self.notice is not None,
                )
            )
        )

    def release_held(self) -> None:
        if self.held is not None:
            slot, index, wait_us, token = self.held
            self.held = None
            release = self._release_hook
            if release is not None:  # cuda_ipc: record the free event before the Release
                release(slot)
            shm = self.shm
            if self.notice is not None and shm is not None:  # a store; a record only if starved
                self.wait_us += wait_us
                if shm.release_word(slot, token, self.wait_us):
                    self.notice.wake()
            else:
                self.send(
                    pb.ClientMessage(
                        release=pb.Release(slot=slot, batch_index=index, wait_us=wait_us)
                    )
                )

    def recv(self) -> Any:
        """The next message of the Batches call."""
        try:
            return next(self._call)
        except StopIteration:
            raise ServerUnavailable(
                f"the daemon at {self.target} ended the stream unexpectedly"
            ) from None
        except grpc.RpcError as err:
            raise from_rpc_error(err, target=self.target) from None

    def lost(self, why: BaseException, wait_s: float = 5.0) -> BetonClientError:
        """The error to raise when a published batch can no longer be read (``why``): the
        Batches call's final status once it comes (within ``wait_s``; a SIGTERM drain's is
        ``ServerUnavailable`` with ``server_error == "ShuttingDown"``), else
        ``ServerUnavailable``. Either way the batch was not yielded, so a reconnecting Loader
        resumes at it."""
        deadline = time.monotonic() + wait_s
        done = getattr(self._call, "done", None)
        while done is not None and not done() and time.monotonic() < deadline:
            time.sleep(0.01)
        if done is not None and done():
            try:
                self.recv()
            except BetonClientError as err:
                return err
        return ServerUnavailable(f"the daemon at {self.target} stopped serving this stream: {why}")

    def nap_for(self, now: float, first: bool) -> float:
        """How long to nap before waiting for a batch that is not published yet (seconds; 0:
        wait at once), asked at ``now`` (``time.perf_counter``); ``first``: the epoch's first.

        Why: when the daemon cannot keep up (every core busy), the iterator finds no batch
        ready almost every time, and each wait is a sleep and a wake-up of this process, which
        on the machines measured (virtual machines) costs ~80-100 us of this thread's CPU
        (session 59; the batches read after it run on cold caches), on cores the decoding
        needs. On CIFAR-sized batches (~0.4 ms each, or
        ~1.6 ms each for four clients of one daemon) that is a tenth of the work. Napping
        :func:`nap_batches` periods instead (5 on a 16-slot ring) makes one wake-up collect
        ~6 batches: it changes when this process looks, not how fast batches come, since the
        ring keeps being filled meanwhile (a third of its slots). Measured on CIFAR, 2 cores:
        one client's CPU per batch 66-82 us -> 53-65 us; four clients' 82-84 us -> 66-68 us,
        and the daemon's 613-616 us -> 591-599 us with naps of 2.5 periods (benchmarks/RESULTS.md,
        session 16); 5 periods took one client from ~50-57 us to ~40-50 us (session 59). Only streams
        with batches under :data:`NAP_MAX_PACE_S` apart and rings of :data:`NAP_MIN_SLOTS`
        slots or more nap, never for an epoch's first batch (its latency is the start-up
        time), and never when a batch is already there.
        """
        last, self._last_ask = self._last_ask, now
        if first or not self._may_nap:
            return 0.0
        period = now - last
        pace = self._pace = (
            period if self._pace == 0.0 else self._pace + NAP_EWMA * (period - self._pace)
        )
        if pace > NAP_MAX_PACE_S or pace <= 0.0:
            return 0.0
        return self._nap_batches * pace

    def next_ready(self, nap_s: float = 0.0) -> Ready | End:
        """The next published batch or end of epoch, from the notice channel if there is one
        (napping ``nap_s`` seconds first if it is not there yet: :meth:`nap_for`).

        Raises:
            ServerUnavailable, ServerError, ...: the stream ended (the Batches call's status).
        """
        if self.notice is None:
            return self._from_message(self.recv())
        rec = self.notice.recv(nap_s)
        if rec is None:  # the daemon closed the channel: the reason is the call's status
            msg = self.recv()
            raise ServerError(
                f"the daemon at {self.target} closed the notice channel but sent "
                f"{msg.WhichOneof('kind')!r} on the Batches call"
            )
        kind, a, b, c, d, payload = rec
        if kind == notice.END:
            return End(b, c)
        if kind not in (notice.BATCH, notice.BATCH_AT):
            raise ServerError(f"unexpected record kind {kind} on the notice channel")
        if not 0 < d <= self._layout.batch_size:
            raise ServerError(f"batch {c} has {d} rows, outside 1..{self._layout.batch_size}")
        at = None
        if kind == notice.BATCH_AT:
            try:
                offset, segment = notice.split_at(payload)
            except ValueError as exc:
                raise ServerError(f"bad BATCH_AT record: {exc}") from None
            at = (segment, offset)
        shm = self.shm
        if shm is None:  # _connect_notices opens a notice channel for shm receivers only
            raise ServerError("a notice channel without an shm receiver")
        return Ready(b, c, a, d, self._tensors(d), shm.ids(a, d), at)

    def _tensors(self, length: int) -> list[TensorInfo]:
        if length == self._layout.batch_size and self._full is not None:
            return self._full
        out = [
            TensorInfo(t.name, (length, *t.shape), t.dtype, t.offset, t.nbytes(length))
            for t in self._layout.tensors
        ]
        if length == self._layout.batch_size:
            self._full = out
        return out

    @staticmethod
    def _from_message(msg: Any) -> Ready | End:
        kind = msg.WhichOneof("kind")
        if kind == "end":
            return End(msg.end.epoch, msg.end.batches)
        b = msg.batch
        tensors = [
            TensorInfo(
                t.name,
                tuple(t.shape),
                _DTYPES.get(t.dtype) or wire_dtype(t.dtype),
                t.offset,
                t.nbytes,
            )
            for t in b.tensors
        ]
        ids = np.frombuffer(b.sample_ids, dtype="<u8").astype(np.uint64)
        return Ready(b.epoch, b.batch_index, b.slot, b.length, tensors, ids)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._finalizer()


def _connect_notices(reply: Any, receiver: Receiver) -> NoticeChannel | None:
    """The stream's notice channel when the daemon offers one and it can be reached."""
    setup = reply.transport
    shm = setup.shm
    if setup.kind != "shm" or not (shm.notice_socket and shm.ids_offset and shm.release_offset):
        return None
    if not isinstance(receiver, ShmReceiver) or not receiver.has_release_words:
        return None
    try:
        return NoticeChannel(setup.shm.notice_socket, bytes(setup.shm.notice_token))
    except OSError as exc:
        log.info("no notice channel (%s): batch notices use the Batches call", exc)
        return None


def _close_stream(
    requests: queue.SimpleQueue[Any],
    call: Any,
    receiver: Receiver,
    channel: NoticeChannel | None,
) -> None:
    requests.put(None)
    with contextlib.suppress(Exception):
        call.cancel()
    if channel is not None:
        channel.close()
    receiver.close()


class _LocalEpochFeed:
    """One epoch of a :class:`_Stream` (``beton_client.frontend.EpochFeed``): the published batches in order;
    :meth:`release` hands the previous slot back."""

    def __init__(self, stream: _Stream, epoch: int, start: int) -> None:
        self.stream = stream
        self.epoch = epoch
        self.start = start
        self.index = start
        self.done = False
        stream.release_held()
        stream.complete = False
        stream.start(epoch, start)

    def release(self) -> None:
        self.stream.release_held()

    def next(self) -> RawBatch | None:
        s = self.stream
        if self.done:
            return None
        s.release_held()
        t0 = time.perf_counter()
        b = s.next_ready(s.nap_for(t0, self.index == self.start))
        wait_us = int((time.perf_counter() - t0) * 1e6)
        if isinstance(b, End):
            if self.index != s.num_batches:
                raise ServerError(
                    f"the daemon ended epoch {self.epoch} after {self.index} of "
                    f"{s.num_batches} batches"
                )
            self._finish()
            return None
        if b.epoch != self.epoch or b.index != self.index:
            raise ServerError(
                f"out-of-order batch: expected epoch {self.epoch} batch {self.index}, got "
                f"epoch {b.epoch} batch {b.index}"
            )
        shm = s.shm
        if b.at is not None:
            if shm is None:
                raise ServerError("a shared batch (BATCH_AT) on a stream that is not shm")
            try:
                arrays = shm.arrays_at(b.at[0], b.at[1], b.tensors)
            except SegmentGone as exc:
                raise s.lost(exc) from None
        elif shm is not None and b.tensors is s._full:  # views built once per slot
            arrays = shm.slot_arrays(b.slot, b.tensors)
        else:
            arrays = s.receiver.arrays(b.slot, b.tensors)
        s.held = (b.slot, b.index, wait_us, notice.lease_token(b.epoch, b.index, s.num_batches))
        self.index += 1
        if self.index == s.num_batches:
            # Read the end-of-epoch marker now, so that the loop ends without another wait and
            # the stream is known to be idle (the next epoch starts on it).
            if not isinstance(s.next_ready(), End):
                raise ServerError(f"expected the end of epoch {self.epoch}, got another batch")
            self._finish()
        return RawBatch(arrays, b.sample_ids)

    def _finish(self) -> None:
        self.done = True
        self.stream.complete = True

    def close(self) -> None:
        """Stop early; an epoch left before its end makes the stream re-open for the next one
        (its batches in flight are dropped with it)."""
        self.done = True
