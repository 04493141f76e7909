"""The Loader's remote streams: batches over the grpc transport from one daemon or several.

When the daemon chooses the ``grpc`` transport (a daemon on another host, ``transport="grpc"``, or
``server=[...]`` with several addresses), the stream's batches do not come through the
``Batches`` call: each daemon's OpenStream reply names a pass-through batch method
(``GrpcSetup.method``), and the client opens one :class:`~beton_client._transport.grpc_codec.BatchStream`
per daemon with the stream id as the OPEN payload. A
:class:`~beton_client._transport.multi.MultiDaemonReader` then asks daemon ``b mod S`` for batch
``b`` (one credit per request), reorders, and, when a daemon fails (``ServerUnavailable``), moves
its share to the others: every batch of the epoch is delivered once, in order. One daemon is the
case S = 1.

Every daemon must serve the same dataset under the same name: the batches of an epoch are a pure
function of (seed, epoch, batch index), so any daemon can make any batch. A daemon whose stream has
another length is refused (:class:`~beton_client.errors.SpecError`).

Bad samples: a daemon under a bad-sample budget skips a failing sample and charges it to its own
stream, but with several daemons each sees only its share of the epoch. Each grpc batch names
the samples it skipped (``beton_wire.skipped``), and :class:`RemoteStream` charges them against
the smallest budget the daemons announced (``OpenStreamResponse.bad_sample_budget``), in batch
order, with the in-process Loader's rule and error: the same batch fails, naming the same
sample, however the epoch is spread (a daemon's own count never runs ahead of this one).

Memory: at most ``credits_per_daemon`` batches are requested or buffered per daemon, each in a
buffer of that daemon's :class:`~beton_client._transport.grpc_codec.BufferPool`, plus the batch the
user holds. With ``copy=False`` a yielded batch's arrays are views of such a buffer, valid until the
next batch is requested (as over shm).

Threading: used from the Loader's thread only; grpcio runs each call's request stream on its own
thread.

Ending: :meth:`RemoteStream.close` (the Loader closing, or abandoning an epoch left early) closes
the reader first, so that an epoch iterator stopped or garbage-collected afterwards drains nothing,
then the calls and the channels the stream opened. A ``weakref.finalize`` does the same for a
stream that is never closed, at the latest when the interpreter exits, before its final garbage
collection (issue 11: an iterator left by ``break`` drained there and hung the exit). It is
registered on the stream's owner (the Loader) too, and so runs before the owner's own finalizer
closes the channel the first call uses: a call cancelled by that close before the daemon took it
up would leave the daemon's stream open until its unattached timeout.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Generator, Sequence
from typing import Any

import grpc
import numpy as np
from beton_wire.file_identity import compare_digests
from beton_wire.framing import ALIGN, Compression, DecodedBatch, OpenRequest
from beton_wire.skipped import SKIPPED, Skipped
from beton_wire.skipped import decode as decode_skipped
from beton_wire.skipped import max_bytes as max_skipped_bytes
from beton_wire.v1 import beton_pb2_grpc as pb_grpc

from beton_client._forks import owner_only
from beton_client._ops import PipelinePlan, explain_refusal
from beton_client._tail import OutputInfo, wire_dtype
from beton_client._transport.grpc_codec import BatchStream, BufferPool
from beton_client._transport.grpc_receiver import SAMPLE_IDS, GrpcSetupInfo
from beton_client._transport.multi import AllDaemonsLostError, MultiDaemonReader, StreamLink
from beton_client.errors import (
    PipelineError,
    ServerError,
    ServerUnavailable,
    SpecError,
    from_rpc_error,
)
from beton_client.frontend import RawBatch, pipelines_key

__all__ = ["RemoteEpochFeed", "RemoteStream", "open_remote"]

log = logging.getLogger("beton_client")

#: Batches requested or buffered per daemon at once.
CREDITS_PER_DAEMON = 3
#: Seconds to wait for one batch before a daemon is declared lost.
RECEIVE_TIMEOUT_S = 120.0


def max_batch_bytes(reply: Any) -> int:
    """The largest payload a batch of this stream can have: a header announcing more is refused
    before anything is allocated."""
    batch = max(1, int(reply.batch_size))
    total = 8 * batch + ALIGN  # the sample ids
    total += max_skipped_bytes(batch) + ALIGN  # the samples it skipped, if any
    for o in reply.outputs:
        itemsize = np.dtype(wire_dtype(o.dtype)).itemsize
        total += batch * int(np.prod(list(o.shape), dtype=np.int64)) * itemsize + ALIGN
    return int(total)


class _Daemon:
    """One daemon of a remote stream: its target, channel (when owned), reply and batch call."""

    def __init__(
        self, target: str, channel: grpc.Channel, owned: bool, reply: Any, pool_size: int
    ) -> None:
        self.target = target
        self.channel = channel
        self.owned = owned
        self.reply = reply
        info = GrpcSetupInfo.from_setup(reply.transport)
        comp = Compression.parse(info.compression or "none")
        self.stream = BatchStream(
            channel,
            open_request=OpenRequest(
                compression=comp,
                chunk_bytes=info.chunk_bytes,
                payload=reply.stream_id.encode(),
            ),
            method=info.method,
            max_batch_bytes=max_batch_bytes(reply),
            pool=BufferPool(pool_size),
        )

    def close(self) -> None:
        self.stream.close()
        if self.owned:
            self.channel.close()


class RemoteStream:
    """An open remote stream over one or several daemons (see the module docstring).

    Attributes:
        key: the request's serialisation (the Loader re-opens when it changes).
        num_batches: batches per epoch.
        names: output names, in order.
        reply: the first daemon's OpenStream reply.
        reader: the multi-daemon reader (``reader.alive`` says which daemons still serve).
    """

    def __init__(
        self,
        daemons: Sequence[_Daemon],
        key: bytes,
        credits_per_daemon: int = CREDITS_PER_DAEMON,
        owner: object | None = None,
    ) -> None:
        self.daemons = list(daemons)
        self.key = key
        self.reply = daemons[0].reply
        self.num_batches = int(self.reply.num_batches)
        self.num_samples = int(self.reply.num_samples)
        #: The dataset's files by content (``""``: a daemon that does not say).
        self.dataset_digest = str(self.reply.dataset_digest)
        self.batch_rows = max(1, *(int(d.reply.batch_size) for d in self.daemons))
        self.names = [o.name for o in self.reply.outputs]
        self._outputs = tuple(OutputInfo.from_wire(o) for o in self.reply.outputs)
        #: Distinct failing samples an epoch may skip: the smallest budget of the daemons.
        self.bad_sample_budget = min(int(d.reply.bad_sample_budget) for d in self.daemons)
        #: The distinct samples skipped so far, per epoch (at most the budget per epoch).
        self._skipped: dict[int, set[int]] = {}
        #: False while an epoch was started and neither ended nor drained.
        self.complete = True
        self.closed = False
        #: The batch an epoch stopped early was still showing (``_hold_over``): its buffer is
        #: given back only when the next epoch starts, so that the batches drained meanwhile
        #: are not decoded into memory the caller may still read.
        self._held_over: list[Any] = [None]
        targets = [d.target for d in self.daemons]
        self.reader: MultiDaemonReader[DecodedBatch] = MultiDaemonReader(
            [StreamLink(d.stream, timeout=RECEIVE_TIMEOUT_S) for d in self.daemons],
            credits_per_daemon=credits_per_daemon,
            # Not a bound method: the reader must not keep this stream alive (see the finalizer).
            on_daemon_lost=lambda index, exc: _log_lost(targets, reader_ref, index, exc),
            discard=_give_back,
            names=targets,
        )
        reader_ref = weakref.ref(self.reader)
        self._finalizer = weakref.finalize(
            self, owner_only(_close_remote), self.reader, list(self.daemons)
        )
        # Finalizers of one object run newest first: this one before the owner's (module doc).
        self._owner_finalizer = (
            weakref.finalize(owner, self._finalizer) if owner is not None else None
        )

    @property
    def outputs(self) -> Sequence[OutputInfo]:
        return self._outputs

    def accepts(self, plans: Sequence[PipelinePlan]) -> bool:
        return (
            self.complete
            and not self.closed
            and not self.reader.out_of_step
            and pipelines_key(plans) == self.key
        )

    def epoch(self, epoch: int, start: int = 0) -> RemoteEpochFeed:
        """``epoch`` from batch ``start`` (the batch the previous epoch held is now free)."""
        _release_held(self._held_over)
        return RemoteEpochFeed(self, epoch, start)

    def charge(self, epoch: int, skipped: Sequence[Skipped]) -> None:
        """Charge the samples a batch of ``epoch`` skipped, as it is delivered (in batch order):
        the in-process rule (``BatchSource.charge``): a sample counts once per epoch, and the
        batch whose samples take the epoch past the budget fails, naming its first one.

        Raises:
            PipelineError: the budget is exhausted (nothing is recorded).
        """
        if not skipped:
            return
        seen = self._skipped.setdefault(epoch, set())
        new = {s.sample_id for s in skipped} - seen
        if len(seen) + len(new) > self.bad_sample_budget:
            first = skipped[0]
            raise PipelineError(
                f"[op {first.op}, sample {first.sample_id}] {first.describe()} "
                f"(bad-sample budget {self.bad_sample_budget} exhausted)"
            )
        seen |= new

    def close(self) -> None:
        """End every batch call and close the channels this stream opened (idempotent); an epoch
        iterator of this stream stopped afterwards drains nothing (see the module docstring)."""
        if not self.closed:
            self.closed = True
            self._finalizer()
            _release_held(self._held_over)
            if self._owner_finalizer is not None:
                self._owner_finalizer.detach()


def _log_lost(
    targets: Sequence[str],
    reader_ref: weakref.ref[MultiDaemonReader[Any]],
    index: int,
    exc: BaseException,
) -> None:
    reader = reader_ref()
    left = [targets[i] for i in (reader.alive if reader is not None else ())]
    log.warning(
        "daemon %s is lost (%s); its batches move to %s",
        targets[index],
        exc,
        ",".join(left) or "no daemon",
    )


def _close_remote(reader: MultiDaemonReader[Any], daemons: Sequence[_Daemon]) -> None:
    """Close ``reader`` (no drain after this), then every daemon's call and owned channel."""
    reader.close()
    for d in daemons:
        d.close()


class RemoteEpochFeed:
    """One epoch of a :class:`RemoteStream` (``beton_client.frontend.EpochFeed``), as the shm feed does."""

    def __init__(self, stream: RemoteStream, epoch: int, start: int = 0) -> None:
        self.stream = stream
        self.epoch = epoch
        self.index = start
        self.done = False
        #: The batch last returned (its buffer goes back to the pool on release), in a box that
        #: the finalizer shares: an epoch dropped without ``close`` still gives its buffer back.
        self._held: list[Any] = [None]
        stream.complete = False
        self._gen: Generator[Any, None, None] = stream.reader.iter_epoch(  # type: ignore[assignment]
            epoch, stream.num_batches, start
        )
        self._finalizer = weakref.finalize(
            self, owner_only(_hold_over), self._held, stream._held_over
        )

    def release(self) -> None:
        _release_held(self._held)

    def next(self) -> RawBatch | None:
        self.release()
        if self.done:
            return None
        try:
            batch = next(self._gen)
        except StopIteration:
            self._finish()
            return None
        except AllDaemonsLostError as exc:
            self.done = True
            # Every daemon drained (SIGTERM): say so, as the shm path does, so that only a
            # RetryPolicy(after_shutdown=True) waits for replacements.
            why = {getattr(e, "server_error", "") for e in exc.failures.values()}
            raise ServerUnavailable(
                f"{exc}; batch {self.index} of epoch {self.epoch} was not delivered",
                code="UNAVAILABLE",
                server_error=why.pop() if len(why) == 1 else "",
            ) from exc
        self._held[0] = batch  # given back by the next release, delivered or not
        arrays_by_name = batch.arrays
        ids = arrays_by_name.get(SAMPLE_IDS)
        try:
            arrays = [arrays_by_name[n] for n in self.stream.names]
        except KeyError as exc:
            raise ServerError(f"the daemon sent a batch without output {exc}") from None
        skipped = arrays_by_name.get(SKIPPED)
        if skipped is not None:
            try:
                records = decode_skipped(skipped)
            except ValueError as exc:
                raise ServerError(f"batch {self.index} has a bad {SKIPPED} array: {exc}") from None
            try:
                self.stream.charge(self.epoch, records)
            except PipelineError:
                # The epoch ends here, as in process; the batches still owed are not drained
                # (a daemon may fail one of them on its own budget), the stream re-opens.
                self.done = True
                self.stream.reader.abandon()
                raise
        self.index += 1
        if self.index == self.stream.num_batches:
            self._finish()
        return RawBatch(arrays, np.empty(0, np.uint64) if ids is None else np.array(ids, np.uint64))

    def _finish(self) -> None:
        self.done = True
        self.stream.complete = True

    def close(self) -> None:
        """Stop early and drain what the daemons still owe. The batch last returned stays
        intact until the stream's next epoch starts (``x, y = next(iter(loader))`` closes the
        epoch at once, and the drained batches must not land in its buffer), as with shm."""
        _hold_over(self._held, self.stream._held_over)
        self.done = True
        self._gen.close()


def _give_back(batch: DecodedBatch) -> None:
    """A batch received but never delivered: its buffer goes back to the pool."""
    if batch.release is not None:
        batch.release()


def _hold_over(box: list[Any], over: list[Any]) -> None:
    """Move the batch in ``box`` to the stream's ``over`` box (freeing the one there)."""
    held, box[0] = box[0], None
    if held is not None:
        _release_held(over)
        over[0] = held


def _release_held(box: list[Any]) -> None:
    held, box[0] = box[0], None
    if held is not None and held.release is not None:
        held.release()


def _check_same_stream(target: str, reply: Any, first_target: str, first_reply: Any) -> None:
    """Check that the daemon at ``target`` opened the same stream as the first one: the grpc
    transport, the same batch count and outputs, and the same dataset digest (two versions'
    digests cannot be compared: a warning, and the count and outputs stand alone).

    Raises:
        SpecError: it differs (the message names both daemons and what differs).
    """
    if reply.transport.kind != "grpc":
        raise SpecError(
            f"the daemon at {target} chose the {reply.transport.kind} transport; several "
            "daemons are read over grpc only"
        )
    if reply.num_batches != first_reply.num_batches or [o.name for o in reply.outputs] != [
        o.name for o in first_reply.outputs
    ]:
        raise SpecError(
            f"the daemon at {target} serves {reply.num_batches} batches of outputs "
            f"{[o.name for o in reply.outputs]}, the one at {first_target} "
            f"{first_reply.num_batches} of {[o.name for o in first_reply.outputs]}: "
            "every daemon must serve the same dataset file"
        )
    same = compare_digests(reply.dataset_digest, first_reply.dataset_digest)
    if same is False:  # a copy of the file has the same digest on any host
        raise SpecError(
            f"the daemon at {target} serves another file under this name than the one at "
            f"{first_target} (their contents differ: dataset digest "
            f"{reply.dataset_digest[:15]} against {first_reply.dataset_digest[:15]}): "
            "every daemon must serve the same dataset file"
        )
    if same is None and reply.dataset_digest and first_reply.dataset_digest:
        log.warning(
            "the daemons at %s and %s run beton-serve versions that name datasets "
            "differently (dataset digests %s and %s): that they serve the same file is "
            "checked by its batch count and outputs only; run one version on all",
            target,
            first_target,
            reply.dataset_digest[:15],
            first_reply.dataset_digest[:15],
        )


def open_remote(
    *,
    request: Any,
    first_reply: Any,
    first_channel: grpc.Channel,
    targets: Sequence[str],
    make_channel: Callable[[str], grpc.Channel],
    key: bytes,
    owner: object | None = None,
) -> RemoteStream:
    """Open the stream on every daemon (the first one already answered) and start their calls.

    Args:
        request: the OpenStreamRequest (sent as is to the other daemons).
        first_reply: the reply of ``targets[0]`` (its transport must be grpc).
        first_channel: the Loader's channel to ``targets[0]`` (not owned by the stream).
        targets: every daemon's address, in daemon-index order.
        make_channel: builds a channel (with the Loader's credentials) for another daemon.
        owner: the object whose channel ``first_channel`` is (the Loader): the stream is closed
            when it is collected, before its own finalizers run (see the module docstring).

    Raises:
        SpecError: a daemon's stream differs (length or outputs) from the first one's.
        ServerUnavailable etc.: a daemon refused (``from_rpc_error``).
    """
    pool = CREDITS_PER_DAEMON + 2
    daemons: list[_Daemon] = []
    try:
        daemons.append(_Daemon(targets[0], first_channel, False, first_reply, pool))
        for t in targets[1:]:
            ch = make_channel(t)
            try:
                reply = pb_grpc.BetonServeStub(ch).OpenStream(request, timeout=300.0)
            except grpc.RpcError as err:
                ch.close()
                raise explain_refusal(from_rpc_error(err, target=t), t) from None
            except BaseException:
                ch.close()
                raise
            try:
                _check_same_stream(t, reply, targets[0], first_reply)
            except BaseException:
                ch.close()
                raise
            daemons.append(_Daemon(t, ch, True, reply, pool))
        return RemoteStream(daemons, key, owner=owner)
    except BaseException:
        for d in daemons:
            d.close()
        raise
