"""The daemon's metrics: one Prometheus registry, an HTTP exporter, and a snapshot for the Stats RPC.

Data model. A :class:`Metrics` owns a private ``prometheus_client.CollectorRegistry`` (never the
process-global one, so two daemons or two tests in one process never collide) holding:

=====================================  =========  ==================  ==================================
name                                   kind       labels              set by
=====================================  =========  ==================  ==================================
``beton_stream_batches_total``         counter    stream, dataset     :meth:`batch_delivered`
``beton_stream_images_total``          counter    stream, dataset     :meth:`batch_delivered`
``beton_op_seconds``                   histogram  op                  :meth:`observe_op`
``beton_op_busy_seconds_total``        counter    op                  :meth:`op_time` (pulled)
``beton_op_runs_total``                counter    op                  :meth:`op_time` (pulled)
``beton_queue_depth``                  gauge      -                   :meth:`set_queue_depth`
``beton_workers``                      gauge      -                   :meth:`set_workers`
``beton_worker_utilisation``           gauge      -                   :meth:`set_worker_utilisation`
``beton_slots_in_use``                 gauge      stream              :meth:`set_slots`
``beton_slots_total``                  gauge      stream              :meth:`set_slots`
``beton_client_stall_ratio``           gauge      client              :meth:`report_stall`
``beton_client_wait_seconds_total``    counter    client              :meth:`report_stall`
``beton_client_wall_seconds_total``    counter    client              :meth:`report_stall`
``beton_samples_decoded_total``        counter    dataset             :meth:`samples_decoded`
``beton_bad_samples_total``            counter    dataset             :meth:`bad_samples`
``beton_streams_active``               gauge      -                   :meth:`open_stream`/:meth:`close_stream`
=====================================  =========  ==================  ==================================

Rates (batches/s, images/s) are what Prometheus computes from the counters. The terminal view
(``beton-serve stats``) has no Prometheus, so :meth:`snapshot` also reports per-stream rates over
a short sliding window (``rate_window_s``, 5 s by default).

Data-stall time is measured by the *client*: it alone knows how long its training loop waited
inside ``next(loader)``. The client sends deltas ``(wait_s, wall_s)`` since its previous report
(``wall_s`` is the wall time that elapsed over the same interval); the daemon calls
:meth:`report_stall`, which adds them to the two counters and sets the gauge to the share of the
last interval spent waiting, ``wait_s / wall_s``. ``rate(wait) / rate(wall)`` in PromQL gives the
same share over any window, and :meth:`snapshot` also gives the share since the client connected.

Pushing or pulling. Components may *push* (call the recorders as things happen), or the daemon,
which already keeps per-stream counters for its Stats RPC, can be *pulled*: give
:meth:`set_refresh` a function that takes the daemon's stats snapshot and passes it to
:meth:`sync_daemon_stats`; it runs before every scrape and every :meth:`snapshot`, and advances
the counters by what grew since the previous call.

Cardinality. Streams and clients come and go in a daemon that runs for weeks: call
:meth:`close_stream` / :meth:`forget_client` when they leave, which removes their label sets, so
memory stays flat. Datasets and ops are fixed for the daemon's life and are never removed.

Threading. Every method is thread-safe: ``prometheus_client`` metrics are, and the bookkeeping
here is under one lock held only for dictionary updates. The recorders are cheap (a lock and a
few additions) and may be called from worker threads for every batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from beton_serve.errors import ConfigError

__all__ = ["OP_SECONDS_BUCKETS", "Metrics", "serve_daemon_metrics"]

log = logging.getLogger(__name__)

#: Histogram buckets of ``beton_op_seconds``: an op's time for one batch, 10 µs to 10 s.
OP_SECONDS_BUCKETS: tuple[float, ...] = (
    1e-5,
    3e-5,
    1e-4,
    3e-4,
    1e-3,
    3e-3,
    1e-2,
    3e-2,
    0.1,
    0.3,
    1.0,
    3.0,
    10.0,
)

# Rate points are appended at most this often per stream, so a stream delivering 10k batches/s
# keeps a bounded window (rate_window_s / _RATE_POINT_S points).
_RATE_POINT_S = 0.1


@dataclass(slots=True)
class _StreamInfo:
    dataset: str
    client: str | None
    opened: float
    batches: int = 0
    images: int = 0
    slots_in_use: int = 0
    slots_total: int = 0
    # (monotonic time, cumulative batches, cumulative images), oldest first.
    points: deque[tuple[float, int, int]] = field(default_factory=deque)


@dataclass(slots=True)
class _ClientInfo:
    wait_s: float = 0.0
    wall_s: float = 0.0
    last_ratio: float = 0.0
    reports: int = 0


class _QuietHandler(WSGIRequestHandler):
    """Request handler that does not write an access log line to stderr for every scrape."""

    def log_message(self, format: str, *args: Any) -> None:
        return


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    # Request threads are joined by server_close(), so stop() leaves nothing running.
    daemon_threads = True
    block_on_close = True


class _ThreadingServer6(_ThreadingServer):
    address_family = socket.AF_INET6


class Metrics:
    """The daemon's metrics registry, its HTTP exporter and its Stats snapshot.

    Args:
        rate_window_s: the sliding window over which :meth:`snapshot` computes per-stream rates.
        clock: a monotonic clock in seconds; injectable so tests control the rates.

    Raises:
        ConfigError: ``rate_window_s`` is not positive.
    """

    def __init__(
        self, *, rate_window_s: float = 5.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not rate_window_s > 0:
            raise ConfigError(f"rate_window_s must be > 0 seconds, got {rate_window_s!r}")
        self._window = float(rate_window_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._streams: dict[str, _StreamInfo] = {}
        self._clients: dict[str, _ClientInfo] = {}
        self._samples: dict[str, int] = {}
        self._bad: dict[str, int] = {}
        self._ops: dict[str, list[float]] = {}  # op -> [count, total seconds]
        self._queue_depth = 0
        self._workers = 0
        self._utilisation = 0.0
        self._http: _ThreadingServer | None = None
        self._http_thread: threading.Thread | None = None
        self._refresh: Callable[[Metrics], None] | None = None
        self._refresh_lock = threading.Lock()
        # sync_daemon_stats state: stream -> (batches, samples, wait_us, age_s); dataset -> samples
        self._synced: dict[str, tuple[int, int, int, float]] = {}
        self._synced_ds: dict[str, int] = {}
        self._synced_bad: dict[str, int] = {}
        self._synced_ops: dict[str, tuple[float, int]] = {}

        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._m_batches = Counter(
            "beton_stream_batches",
            "Batches delivered to the client of a stream.",
            ["stream", "dataset"],
            registry=r,
        )
        self._m_images = Counter(
            "beton_stream_images",
            "Samples (images) delivered to the client of a stream.",
            ["stream", "dataset"],
            registry=r,
        )
        self._m_op = Histogram(
            "beton_op_seconds",
            "Time one op (decode or augmentation) spent on one batch, in seconds.",
            ["op"],
            buckets=OP_SECONDS_BUCKETS,
            registry=r,
        )
        self._m_op_s = Counter(
            "beton_op_busy_seconds",
            "Seconds an op (decode or augmentation) spent, summed over every run (a run is one "
            "batch or one slice of it); rate(busy seconds) / rate(runs) is the mean time per run.",
            ["op"],
            registry=r,
        )
        self._m_op_n = Counter(
            "beton_op_runs", "Runs of an op (see beton_op_busy_seconds_total).", ["op"], registry=r
        )
        self._m_queue = Gauge(
            "beton_queue_depth", "Batches submitted to the worker pool, not yet done.", registry=r
        )
        self._m_workers = Gauge("beton_workers", "Workers in the shared pool.", registry=r)
        self._m_util = Gauge(
            "beton_worker_utilisation",
            "Share of the pool's worker time spent running batches (0 to 1).",
            registry=r,
        )
        self._m_slots_used = Gauge(
            "beton_slots_in_use",
            "Slots of a stream's ring holding a batch.",
            ["stream"],
            registry=r,
        )
        self._m_slots_total = Gauge(
            "beton_slots_total", "Slots in a stream's ring.", ["stream"], registry=r
        )
        self._m_stall = Gauge(
            "beton_client_stall_ratio",
            "Share of the client's wall time spent waiting for the next batch, over its last "
            "report interval (reported by the client).",
            ["client"],
            registry=r,
        )
        self._m_wait = Counter(
            "beton_client_wait_seconds",
            "Seconds the client spent waiting for the next batch (reported by the client).",
            ["client"],
            registry=r,
        )
        self._m_wall = Counter(
            "beton_client_wall_seconds",
            "Wall seconds covered by the client's stall reports.",
            ["client"],
            registry=r,
        )
        self._m_samples = Counter(
            "beton_samples_decoded",
            "Samples decoded by the worker pool, per dataset (shared streams count once).",
            ["dataset"],
            registry=r,
        )
        self._m_bad = Counter(
            "beton_bad_samples",
            "Samples skipped by the bad-sample policy, per dataset.",
            ["dataset"],
            registry=r,
        )
        self._m_streams = Gauge("beton_streams_active", "Open streams.", registry=r)

    # ----------------------------------------------------------------------------- streams
    def open_stream(self, stream: str, *, dataset: str, client: str | None = None) -> None:
        """Register a stream; its counters start at zero.

        Args:
            stream: the stream id, unique among open streams.
            dataset: the dataset it reads.
            client: the id of the client that opened it (for the Stats view), if known.

        Raises:
            ConfigError: a stream with this id is already open.
        """
        with self._lock:
            if stream in self._streams:
                raise ConfigError(f"stream {stream!r} is already registered in the metrics")
            info = _StreamInfo(dataset=dataset, client=client, opened=self._clock())
            info.points.append((info.opened, 0, 0))
            self._streams[stream] = info
            self._m_streams.set(len(self._streams))
        # Create the label sets now so a scrape shows the stream at 0 before its first batch.
        self._m_batches.labels(stream, dataset)
        self._m_images.labels(stream, dataset)

    def close_stream(self, stream: str) -> None:
        """Forget a stream and remove its label sets. Closing an unknown stream is a no-op."""
        with self._lock:
            info = self._streams.pop(stream, None)
            self._m_streams.set(len(self._streams))
        if info is None:
            return
        for metric, labels in (
            (self._m_batches, (stream, info.dataset)),
            (self._m_images, (stream, info.dataset)),
            (self._m_slots_used, (stream,)),
            (self._m_slots_total, (stream,)),
        ):
            try:
                metric.remove(*labels)
            except KeyError:
                pass

    def batch_delivered(self, stream: str, images: int, batches: int = 1) -> None:
        """Count ``batches`` batches (one by default) of ``images`` samples in all, handed to the
        stream's client.

        Raises:
            ConfigError: the stream was not opened with :meth:`open_stream`.
        """
        now = self._clock()
        with self._lock:
            info = self._streams.get(stream)
            if info is None:
                raise ConfigError(f"stream {stream!r} is not registered; call open_stream first")
            info.batches += int(batches)
            info.images += int(images)
            pts = info.points
            if now - pts[-1][0] >= _RATE_POINT_S:
                pts.append((now, info.batches, info.images))
                self._trim(pts, now)
            dataset = info.dataset
        self._m_batches.labels(stream, dataset).inc(int(batches))
        self._m_images.labels(stream, dataset).inc(int(images))

    def set_slots(self, stream: str, in_use: int, total: int) -> None:
        """Set how many of the stream's ring slots hold a batch (leased or being filled)."""
        with self._lock:
            info = self._streams.get(stream)
            if info is not None:
                info.slots_in_use, info.slots_total = int(in_use), int(total)
        self._m_slots_used.labels(stream).set(in_use)
        self._m_slots_total.labels(stream).set(total)

    # ----------------------------------------------------------------------------- clients
    def report_stall(self, client: str, wait_s: float, wall_s: float) -> None:
        """Record a client's stall report: ``wait_s`` of the last ``wall_s`` seconds were waiting.

        The values come off the wire, so they are clamped rather than trusted: ``wait_s`` is
        capped at ``wall_s`` (clock jitter between the client's wait and a daemon-measured wall
        interval must not publish a share above 100 %).

        Args:
            client: the client's id.
            wait_s: seconds the client's loop spent waiting for batches since its last report.
            wall_s: wall seconds since its last report.

        Raises:
            ConfigError: a negative or NaN value (a caller bug, e.g. swapped clock readings).
        """
        if not (wait_s >= 0 and wall_s >= 0):
            raise ConfigError(f"stall report needs wait_s, wall_s >= 0, got {wait_s!r}, {wall_s!r}")
        wait_s = min(float(wait_s), float(wall_s))
        ratio = wait_s / wall_s if wall_s > 0 else 0.0
        with self._lock:
            info = self._clients.setdefault(client, _ClientInfo())
            info.wait_s += wait_s
            info.wall_s += wall_s
            info.last_ratio = ratio
            info.reports += 1
        self._m_wait.labels(client).inc(wait_s)
        self._m_wall.labels(client).inc(wall_s)
        self._m_stall.labels(client).set(ratio)

    def forget_client(self, client: str) -> None:
        """Remove a departed client's label sets. Unknown clients are a no-op."""
        with self._lock:
            known = self._clients.pop(client, None) is not None
        if not known:
            return
        for metric in (self._m_stall, self._m_wait, self._m_wall):
            try:
                metric.remove(client)
            except KeyError:
                pass

    # ----------------------------------------------------------------------------- engine
    def observe_op(self, op: str, seconds: float) -> None:
        """Record that ``op`` spent ``seconds`` on one batch (decode or augmentation)."""
        with self._lock:
            acc = self._ops.setdefault(op, [0.0, 0.0])
            acc[0] += 1
            acc[1] += float(seconds)
        self._m_op.labels(op).observe(seconds)

    def op_time(self, op: str, seconds: float, runs: int) -> None:
        """Add ``runs`` runs of ``op`` that took ``seconds`` in all (the daemon's plan timers)."""
        with self._lock:
            acc = self._ops.setdefault(op, [0.0, 0.0])
            acc[0] += int(runs)
            acc[1] += float(seconds)
        self._m_op_s.labels(op).inc(max(0.0, float(seconds)))
        self._m_op_n.labels(op).inc(max(0, int(runs)))

    def samples_decoded(self, dataset: str, n: int) -> None:
        """Count ``n`` samples decoded for ``dataset``: once per batch produced, however many
        streams share it."""
        with self._lock:
            self._samples[dataset] = self._samples.get(dataset, 0) + int(n)
        self._m_samples.labels(dataset).inc(int(n))

    def bad_samples(self, dataset: str, n: int = 1) -> None:
        """Count ``n`` samples of ``dataset`` skipped by the bad-sample policy."""
        with self._lock:
            self._bad[dataset] = self._bad.get(dataset, 0) + int(n)
        self._m_bad.labels(dataset).inc(int(n))

    def register_dataset(self, dataset: str) -> None:
        """Make ``dataset`` appear (at 0) in the per-dataset counters before anything is decoded."""
        with self._lock:
            self._samples.setdefault(dataset, 0)
            self._bad.setdefault(dataset, 0)
        self._m_samples.labels(dataset)
        self._m_bad.labels(dataset)

    def set_queue_depth(self, n: int) -> None:
        """Set the number of batches submitted to the pool and not yet done."""
        with self._lock:
            self._queue_depth = int(n)
        self._m_queue.set(n)

    def set_workers(self, n: int) -> None:
        """Set the number of workers in the pool."""
        with self._lock:
            self._workers = int(n)
        self._m_workers.set(n)

    def set_worker_utilisation(self, share: float) -> None:
        """Set the share (0 to 1) of worker time spent running batches, e.g. over the last second.

        Raises:
            ConfigError: ``share`` is outside [0, 1].
        """
        if not 0.0 <= share <= 1.0:
            raise ConfigError(f"worker utilisation is a share in [0, 1], got {share!r}")
        with self._lock:
            self._utilisation = float(share)
        self._m_util.set(share)

    # ----------------------------------------------------------------------------- pulling
    def set_refresh(self, refresh: Callable[[Metrics], None] | None) -> None:
        """Call ``refresh(self)`` before every HTTP scrape and every :meth:`snapshot`.

        For a daemon that keeps its own counters: ``refresh`` fetches them (e.g. the daemon's
        stats, taken on its event loop) and folds them in with :meth:`sync_daemon_stats`. It
        runs on the scraping thread, serialised; an exception is logged, and the scrape serves
        the last values.
        """
        self._refresh = refresh

    def _do_refresh(self) -> None:
        refresh = self._refresh
        if refresh is None:
            return
        with self._refresh_lock:
            try:
                refresh(self)
            except Exception:
                log.warning("metrics refresh failed; serving the previous values", exc_info=True)

    def sync_daemon_stats(self, stats: Any) -> None:
        """Fold a daemon stats snapshot into the metrics.

        ``stats`` has the shape of ``beton_serve.daemon.DaemonStats``: ``workers``; ``streams``,
        each with ``stream_id``, ``dataset``, ``client_name``, ``client_pid``, ``batches_sent``,
        ``samples_sent``, ``slots_leased``, ``slot_count``, ``client_wait_us`` (the sum the
        client reported) and ``age_s``; ``datasets``, ``(name, samples_decoded,
        batches_decoded)`` tuples; optionally ``queue_depth``, ``worker_utilisation``,
        ``bad_samples`` (``(dataset, count)`` tuples) and ``op_seconds`` (``(op, seconds,
        runs)`` tuples, cumulative).

        Streams not seen before are opened, streams gone since the last call are closed (their
        label sets removed); counters advance by the growth since the last call. Each stream is
        one client: its stall report is its wait growth over its age growth, under
        ``client=<stream_id>``.
        """
        seen: set[str] = set()
        for s in stats.streams:
            sid = str(s.stream_id)
            seen.add(sid)
            prev = self._synced.get(sid)
            if prev is None:
                client = f"{s.client_name or 'client'}:{s.client_pid}" if s.client_pid else None
                with contextlib.suppress(ConfigError):
                    self.open_stream(sid, dataset=str(s.dataset), client=client or s.client_name)
                prev = (0, 0, 0, 0.0)
            b0, i0, w0, a0 = prev
            db, di = int(s.batches_sent) - b0, int(s.samples_sent) - i0
            if db > 0 or di > 0:
                self.batch_delivered(sid, max(di, 0), batches=max(db, 0))
            dwall = float(s.age_s) - a0
            if dwall > 0:
                self.report_stall(sid, max(0, int(s.client_wait_us) - w0) / 1e6, dwall)
            self.set_slots(sid, int(s.slots_leased), int(s.slot_count))
            self._synced[sid] = (
                int(s.batches_sent),
                int(s.samples_sent),
                int(s.client_wait_us),
                float(s.age_s),
            )
        for sid in [k for k in self._synced if k not in seen]:
            del self._synced[sid]
            self.close_stream(sid)
            self.forget_client(sid)
        for name, samples, _batches in stats.datasets:
            name = str(name)
            if name not in self._synced_ds:
                self.register_dataset(name)
            delta = int(samples) - self._synced_ds.get(name, 0)
            if delta > 0:
                self.samples_decoded(name, delta)
            self._synced_ds[name] = int(samples)
        for name, n in getattr(stats, "bad_samples", ()) or ():
            delta = int(n) - self._synced_bad.get(str(name), 0)
            if delta > 0:
                self.bad_samples(str(name), delta)
            self._synced_bad[str(name)] = int(n)
        for op, sec, runs in getattr(stats, "op_seconds", ()) or ():
            s0, r0 = self._synced_ops.get(str(op), (0.0, 0))
            if int(runs) > r0:
                self.op_time(str(op), float(sec) - s0, int(runs) - r0)
            self._synced_ops[str(op)] = (float(sec), int(runs))
        self.set_workers(int(stats.workers))
        qd = getattr(stats, "queue_depth", None)
        if qd is not None:
            self.set_queue_depth(int(qd))
        util = getattr(stats, "worker_utilisation", None)
        if util is not None:
            self.set_worker_utilisation(min(1.0, max(0.0, float(util))))

    # ----------------------------------------------------------------------------- views
    def _trim(self, pts: deque[tuple[float, int, int]], now: float) -> None:
        # Keep the newest point at or before the window's start, so the rate spans the window.
        while len(pts) >= 2 and pts[1][0] <= now - self._window:
            pts.popleft()

    def snapshot(self) -> dict[str, Any]:
        """A JSON-safe view of every metric, for the Stats RPC and ``beton-serve stats --json``.

        Returns:
            ``{"time": unix seconds, "workers", "worker_utilisation", "queue_depth",
            "streams": {id: {"dataset", "client", "batches", "images", "batches_per_s",
            "images_per_s", "slots_in_use", "slots_total", "age_s"}},
            "clients": {id: {"stall_ratio", "stall_ratio_total", "wait_s", "wall_s"}},
            "datasets": {name: {"samples_decoded", "bad_samples"}},
            "ops": {name: {"count", "total_s", "mean_s"}}}``. Rates are over the last
            ``rate_window_s`` seconds (0 for a stream that delivered nothing in that window).
        """
        self._do_refresh()
        now = self._clock()
        with self._lock:
            streams: dict[str, Any] = {}
            for sid, info in self._streams.items():
                self._trim(info.points, now)
                t0, b0, i0 = info.points[0]
                span = now - t0
                streams[sid] = {
                    "dataset": info.dataset,
                    "client": info.client,
                    "batches": info.batches,
                    "images": info.images,
                    "batches_per_s": (info.batches - b0) / span if span > 0 else 0.0,
                    "images_per_s": (info.images - i0) / span if span > 0 else 0.0,
                    "slots_in_use": info.slots_in_use,
                    "slots_total": info.slots_total,
                    "age_s": now - info.opened,
                }
            clients = {
                cid: {
                    "stall_ratio": c.last_ratio,
                    "stall_ratio_total": c.wait_s / c.wall_s if c.wall_s > 0 else 0.0,
                    "wait_s": c.wait_s,
                    "wall_s": c.wall_s,
                }
                for cid, c in self._clients.items()
            }
            names = sorted(set(self._samples) | set(self._bad))
            datasets = {
                d: {"samples_decoded": self._samples.get(d, 0), "bad_samples": self._bad.get(d, 0)}
                for d in names
            }
            ops = {
                op: {"count": int(c), "total_s": s, "mean_s": s / c if c else 0.0}
                for op, (c, s) in sorted(self._ops.items())
            }
            return {
                "time": time.time(),
                "workers": self._workers,
                "worker_utilisation": self._utilisation,
                "queue_depth": self._queue_depth,
                "streams": streams,
                "clients": clients,
                "datasets": datasets,
                "ops": ops,
            }

    # ----------------------------------------------------------------------------- HTTP
    def start_http(self, port: int, host: str = "127.0.0.1") -> tuple[WSGIServer, int]:
        """Serve ``/metrics`` (Prometheus text format) on ``host:port`` from a background thread.

        The thread is named ``beton-metrics-http``; :meth:`stop` shuts it down and joins it.

        Args:
            port: the TCP port; 0 picks a free one (the bound port is returned).
            host: the address to bind; loopback by default. An address containing ``:`` is
                bound as IPv6.

        Returns:
            ``(server, port)``: the WSGI server and the port it listens on.

        Raises:
            ConfigError: the exporter is already running, or the address cannot be bound.
        """
        if self._http is not None:
            raise ConfigError("the metrics HTTP server is already running; call stop() first")
        cls = _ThreadingServer6 if ":" in host else _ThreadingServer
        try:
            server = make_server(host, port, self._wsgi_app(), cls, handler_class=_QuietHandler)
        except OSError as exc:
            raise ConfigError(
                f"cannot serve metrics on {host}:{port}: {exc}; pick another --metrics-port"
            ) from exc
        thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="beton-metrics-http",
            daemon=True,
        )
        thread.start()
        self._http, self._http_thread = server, thread
        return server, int(server.server_address[1])

    def _wsgi_app(self) -> Callable[..., Any]:
        app = make_wsgi_app(self.registry)

        def refreshing_app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
            self._do_refresh()
            return app(environ, start_response)

        return refreshing_app

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the HTTP exporter, if running, and join its thread. Idempotent."""
        server, thread = self._http, self._http_thread
        self._http = self._http_thread = None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout)


def serve_daemon_metrics(
    get_stats: Callable[[], Any],
    loop: asyncio.AbstractEventLoop,
    port: int,
    host: str = "127.0.0.1",
    *,
    timeout: float = 2.0,
) -> tuple[Metrics, int]:
    """Export a daemon's stats on ``http://host:port/metrics``, pulled at scrape time.

    Each scrape runs ``get_stats()`` on ``loop`` (the daemon's event loop, where its stats are
    consistent), waits at most ``timeout`` seconds for it, and folds the result in with
    :meth:`Metrics.sync_daemon_stats`. Call from the loop's thread; stop with ``metrics.stop()``.

    Returns:
        ``(metrics, port)``, the port being the bound one (``port=0`` picks a free one).

    Raises:
        ConfigError: the address cannot be bound.
    """

    async def _take() -> Any:
        return get_stats()

    def refresh(m: Metrics) -> None:
        stats = asyncio.run_coroutine_threadsafe(_take(), loop).result(timeout)
        m.sync_daemon_stats(stats)

    metrics = Metrics()
    metrics.set_refresh(refresh)
    _, bound = metrics.start_http(port, host)
    return metrics, bound
