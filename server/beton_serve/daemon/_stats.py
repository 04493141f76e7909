"""The daemon's stats snapshot (:class:`~beton_serve.daemon.DaemonStats`), what the Stats RPC
returns and the Prometheus collector (``beton_serve.metrics``) reads.

:class:`StatsBook` keeps the only state a snapshot needs beyond what it reads: when the daemon
started, and the worker utilisation between two snapshots (the engine's busy seconds at the
previous one). Everything else is read at the snapshot, from the streams (their counters and
rings), the datasets (their counters), the plan registry (plans and op times), the engine
(queue, busy time, replaced workers) and the process's decode cache (decode groups).

Stream ids: a stream's id is what a ``Batches`` call (and the grpc batch method) names to read
it, so it must stay secret to the client that opened it. The rows given to anyone but the
daemon's own user over its Unix socket (a TCP peer's ``Stats``, the Prometheus endpoint) carry a
public name instead (:func:`public_stream_id`: a keyed hash, stable for the stream's life and
the same in both views). A loopback TCP peer read the ids from ``Stats`` and claimed another
client's stream before that client iterated it.

Threads: event-loop thread (the stream and plan tables are the loop's); the counters written
by engine workers are read without their locks (a snapshot may be a batch behind).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from beton_serve.daemon._backend import EngineLike, PlanLike
from beton_serve.daemon._datasets import Dataset
from beton_serve.daemon._messages import DaemonStats, DecodeGroupRow, StreamStats
from beton_serve.daemon._stream import Stream
from beton_serve.daemon._streams import StreamTable
from beton_serve.errors import FormatError

__all__ = ["UTILISATION_WINDOW_S", "StatsBook", "public_stream_id"]

#: The key of :func:`public_stream_id` (one per daemon process).
_PUBLIC_KEY = secrets.token_bytes(16)


def public_stream_id(stream_id: str) -> str:
    """The name under which ``stream_id`` is shown to peers that may not read it (see the
    module docstring): 16 hex digits, ``p`` first, that do not reveal the id."""
    digest = hashlib.blake2b(stream_id.encode(), key=_PUBLIC_KEY, digest_size=8).hexdigest()
    return "p" + digest[1:]


#: Seconds between two utilisation samples (a snapshot closer to the last one repeats it).
UTILISATION_WINDOW_S = 0.5


@dataclass(kw_only=True)
class StatsBook:
    """Builds snapshots of one daemon (see the module docstring)."""

    workers: int
    started: float = field(default_factory=time.monotonic)
    _util_prev: tuple[float, float] = (0.0, 0.0)  # (monotonic time, engine busy seconds)
    _util_last: float = 0.0

    def snapshot(
        self,
        *,
        streams: StreamTable,
        datasets: Sequence[Dataset],
        plans: Sequence[PlanLike],
        engine: EngineLike | None,
        max_ring_bytes: int = 0,
        ring_bytes: int = 0,
        visible: Callable[[Dataset], bool] | None = None,
        public_ids: bool = False,
    ) -> DaemonStats:
        """A snapshot of the daemon made of these parts (``plans``: the compiled ones).

        ``visible``: the datasets the asking peer may see (``None``: all). The others, their
        streams and their decode groups are left out of the rows; the totals (memory, queue,
        utilisation) still count them. ``public_ids``: the stream rows carry
        :func:`public_stream_id`, not the ids (module docstring).
        """
        from beton_serve.pipeline import workspace_memory

        now = time.monotonic()
        buffers = workspace_memory()
        shown = [s for s in streams if visible is None or visible(s.dataset)]
        if visible is not None:
            datasets = [d for d in datasets if visible(d)]
        return DaemonStats(
            pid=os.getpid(),
            uptime_s=now - self.started,
            workers=self.workers,
            streams=tuple(_stream_row(s, now, public_ids) for s in shown),
            datasets=tuple((d.name, d.samples_decoded, d.batches_decoded) for d in datasets),
            shm_bytes=sum(s.ring.nbytes() for s in streams),
            compiled_plans=len(plans),
            streams_opened=streams.opened,
            queue_depth=0 if engine is None else int(engine.queue_depth),
            worker_utilisation=self._utilisation(now, engine),
            workers_replaced=0 if engine is None else int(engine.workers_replaced),
            bad_samples=tuple((d.name, d.bad_samples) for d in datasets),
            refused=tuple(
                (d.name, str(FormatError(*d.watch.broken)))  # what its streams were told
                for d in datasets
                if d.watch is not None and d.watch.broken is not None
            ),
            op_seconds=_op_seconds(plans),
            decode_groups=_decode_groups(None if visible is None else datasets),
            max_ring_bytes=max_ring_bytes,
            ring_bytes=ring_bytes,
            buffer_bytes=buffers.live_bytes,
            idle_buffer_bytes=buffers.idle_bytes,
            max_idle_buffer_bytes=buffers.limit_bytes,
            idle_buffers_freed=buffers.evicted,
        )

    def _utilisation(self, now: float, engine: EngineLike | None) -> float:
        """Busy share of the pool since the previous sample (repeated within the window)."""
        busy = 0.0 if engine is None else float(engine.busy_s)
        t0, b0 = self._util_prev
        if now - t0 >= UTILISATION_WINDOW_S:
            if t0 > 0:
                self._util_last = min(1.0, max(0.0, (busy - b0) / ((now - t0) * self.workers)))
            self._util_prev = (now, busy)
        return self._util_last


def _stream_row(s: Stream, now: float, public_id: bool) -> StreamStats:
    return StreamStats(
        stream_id=public_stream_id(s.stream_id) if public_id else s.stream_id,
        dataset=s.dataset.name,
        client_name=s.client_name,
        client_pid=s.client_pid,
        transport=s.ring.kind,
        batches_sent=s.counters.batches_sent,
        samples_sent=s.counters.samples_sent,
        slots_leased=s.ring.leased(),
        slot_count=s.ring.slot_count,
        client_wait_us=s.counters.client_wait_us,
        age_s=now - s.created,
    )


def _op_seconds(plans: Sequence[PlanLike]) -> tuple[tuple[str, float, int], ...]:
    """``(op, seconds, runs)`` summed over every plan, by op name."""
    total: dict[str, list[float]] = {}
    for plan in plans:
        for op, (sec, n) in plan.op_times().items():
            acc = total.setdefault(op, [0.0, 0])
            acc[0] += sec
            acc[1] += n
    return tuple((op, s, int(n)) for op, (s, n) in sorted(total.items()))


def _decode_groups(datasets: Sequence[Dataset] | None) -> tuple[DecodeGroupRow, ...]:
    """The process's decode groups (``fields.decode_cache``; imported only when asked): all
    of them, or those of ``datasets``' files."""
    from beton_serve.engine import dataset_identity
    from beton_serve.fields.decode_cache import default_decode_cache

    groups = default_decode_cache().stats()
    if datasets is not None:
        idents = {dataset_identity(d.reader) for d in datasets} - {None}
        groups = [g for g in groups if g.dataset in idents]
    return tuple(
        DecodeGroupRow(
            dataset=g.label or g.dataset[:12],
            field=g.field,
            order=hashlib.sha256(g.order.encode()).hexdigest()[:12],
            decode=g.decode,
            members=g.members,
            detached=g.detached,
            delivered=g.delivered,
            decoded=g.decoded,
            hits=g.hits,
            evicted=g.evicted,
            live_bytes=g.bytes,
            waits=g.waits,
        )
        for g in groups
    )
