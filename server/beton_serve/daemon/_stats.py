"""The daemon's stats snapshot (:class:`~beton_serve.daemon.DaemonStats`), what the Stats RPC
returns and the Prometheus collector (``beton_serve.metrics``) reads.

:class:`StatsBook` keeps the only state a snapshot needs beyond what it reads: when the daemon
started, and the worker utilisation between two snapshots (the engine's busy seconds at the
previous one). Everything else is read at the snapshot, from the streams (their counters and
rings), the datasets (their counters), the plan registry (plans and op times), the engine
(queue, busy time, replaced workers) and the process's decode cache (decode groups).

Threads: event-loop thread (the stream and plan tables are the loop's); the counters written
by engine workers are read without their locks (a snapshot may be a batch behind).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from beton_serve.daemon._backend import EngineLike, PlanLike
from beton_serve.daemon._datasets import Dataset
from beton_serve.daemon._messages import DaemonStats, DecodeGroupRow, StreamStats
from beton_serve.daemon._stream import Stream
from beton_serve.daemon._streams import StreamTable

__all__ = ["UTILISATION_WINDOW_S", "StatsBook"]

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
    ) -> DaemonStats:
        """A snapshot of the daemon made of these parts (``plans``: the compiled ones).

        ``visible``: the datasets the asking peer may see (``None``: all). The others, their
        streams and their decode groups are left out of the rows; the totals (memory, queue,
        utilisation) still count them.
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
            streams=tuple(_stream_row(s, now) for s in shown),
            datasets=tuple((d.name, d.samples_decoded, d.batches_decoded) for d in datasets),
            shm_bytes=sum(s.ring.nbytes() for s in streams),
            compiled_plans=len(plans),
            streams_opened=streams.opened,
            queue_depth=0 if engine is None else int(engine.queue_depth),
            worker_utilisation=self._utilisation(now, engine),
            workers_replaced=0 if engine is None else int(engine.workers_replaced),
            bad_samples=tuple((d.name, d.bad_samples) for d in datasets),
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


def _stream_row(s: Stream, now: float) -> StreamStats:
    return StreamStats(
        stream_id=s.stream_id,
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
