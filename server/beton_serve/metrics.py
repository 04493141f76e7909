"""The daemon's Prometheus metrics: a pull collector over ``Daemon.stats()`` and its HTTP exporter.

The daemon already keeps every counter it reports (per stream, per dataset, per op) for its
Stats RPC. This module keeps nothing of its own: at each scrape, :class:`DaemonCollector` takes
one :class:`~beton_serve.daemon.DaemonStats` snapshot, the same one the Stats RPC (and so
``beton-serve stats``) returns, and turns it into metric families. So the two views never
disagree, nothing is pushed from the hot path, and a series disappears when its stream or dataset
goes away (a daemon that runs for weeks keeps a bounded set of series).

=========================================  =======  ===============  ==============================
name                                       kind     labels           from ``DaemonStats``
=========================================  =======  ===============  ==============================
``beton_stream_batches_total``             counter  stream, dataset  ``streams[].batches_sent``
``beton_stream_images_total``              counter  stream, dataset  ``streams[].samples_sent``
``beton_slots_in_use``                     gauge    stream           ``streams[].slots_leased``
``beton_slots_total``                      gauge    stream           ``streams[].slot_count``
``beton_client_wait_seconds_total``        counter  client           ``streams[].client_wait_us``
``beton_client_wall_seconds_total``        counter  client           ``streams[].age_s``
``beton_client_stall_ratio``               gauge    client           wait / wall since connecting
``beton_streams_active``                   gauge    -                ``len(streams)``
``beton_streams_opened_total``             counter  -                ``streams_opened``
``beton_samples_decoded_total``            counter  dataset          ``datasets[].samples``
``beton_batches_decoded_total``            counter  dataset          ``datasets[].batches``
``beton_bad_samples_total``                counter  dataset          ``bad_samples``
``beton_dataset_refused``                  gauge    dataset          1 while ``refused`` (a file changed)
``beton_op_busy_seconds_total``            counter  op               ``op_seconds`` (seconds)
``beton_op_runs_total``                    counter  op               ``op_seconds`` (runs)
``beton_queue_depth``                      gauge    -                ``queue_depth``
``beton_workers``                          gauge    -                ``workers``
``beton_worker_utilisation``               gauge    -                ``worker_utilisation``
``beton_workers_replaced_total``           counter  -                ``workers_replaced``
``beton_shm_bytes``                        gauge    -                ``shm_bytes``
``beton_ring_bytes``                       gauge    -                ``ring_bytes``
``beton_max_ring_bytes``                   gauge    -                ``max_ring_bytes`` (0: none)
``beton_buffer_bytes``                     gauge    -                ``buffer_bytes``
``beton_idle_buffer_bytes``                gauge    -                ``idle_buffer_bytes``
``beton_max_idle_buffer_bytes``            gauge    -                ``max_idle_buffer_bytes``
``beton_idle_buffers_freed_total``         counter  -                ``idle_buffers_freed``
``beton_compiled_plans``                   gauge    -                ``compiled_plans``
``beton_uptime_seconds``                   gauge    -                ``uptime_s``
``beton_stats_stale``                      gauge    -                1 when the last snapshot failed
``beton_decode_group_*``                   both     dataset, field,  ``decode_groups`` (issue 16):
                                                    order, decode    members, detached, delivered,
                                                                     decoded, hits, evicted, waits,
                                                                     bytes
=========================================  =======  ===============  ==============================

The ``client`` label is the stream id (one stream is one client's Loader); the client's script
name and pid are on ``beton_stream_info``. Rates are PromQL's job:
``rate(beton_stream_images_total[1m])`` is images/s per stream, and
``rate(beton_client_wait_seconds_total[5m]) / rate(beton_client_wall_seconds_total[5m])`` a
client's data-stall share over five minutes. Per-op time is cumulative busy seconds and runs (a
run is one batch, or one slice of one): ``rate(busy) / rate(runs)`` is the mean time per run.

A snapshot that fails (the event loop is gone, or too slow) is logged; the scrape then serves the
previous snapshot with ``beton_stats_stale 1``.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import threading
from collections.abc import Callable, Iterator
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from beton_serve.errors import ConfigError

__all__ = ["DaemonCollector", "MetricsExporter", "metric_families", "serve_daemon_metrics"]

log = logging.getLogger(__name__)


#: Seconds a metrics connection may take to send its request (and to take the reply): an idle
#: connection held a thread and a descriptor of the daemon for good.
HTTP_TIMEOUT_S = 10.0
#: Metrics connections served at once; more are closed as they arrive (a scraper needs one;
#: this bounds the threads and descriptors that connections can take from the daemon).
MAX_HTTP_CONNECTIONS = 32


class _QuietHandler(WSGIRequestHandler):
    """Request handler that does not write an access log line to stderr for every scrape, with
    a socket timeout (:data:`HTTP_TIMEOUT_S`)."""

    timeout = HTTP_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    """One thread per connection, at most :data:`MAX_HTTP_CONNECTIONS` of them: a local user
    opening hundreds of idle connections took the daemon to hundreds of threads and out of
    descriptors."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(MAX_HTTP_CONNECTIONS)
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # closed at once: the scraper retries
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _ThreadingServer6(_ThreadingServer):
    import socket

    address_family = socket.AF_INET6


#: The paths the exporter answers; anything else gets 404 (it answered every path).
METRICS_PATHS = frozenset({"/metrics", "/"})


def _only_metrics(app: Callable[..., Any]) -> Callable[..., Any]:
    """``app`` on :data:`METRICS_PATHS`, 404 elsewhere (the query string is the app's)."""

    def only(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if environ.get("PATH_INFO", "") in METRICS_PATHS:
            return app(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"not found: beton-serve serves metrics on /metrics\n"]

    return only


def _counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=list(labels))


def _gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def metric_families(stats: Any, *, stale: bool = False) -> list[Metric]:
    """The metric families for one ``DaemonStats`` snapshot (see the module docstring)."""
    batches = _counter(
        "beton_stream_batches",
        "Batches delivered to the client of a stream.",
        ("stream", "dataset"),
    )
    images = _counter(
        "beton_stream_images", "Samples delivered to the client of a stream.", ("stream", "dataset")
    )
    info = _gauge(
        "beton_stream_info",
        "One series per open stream: its client's script name, pid and transport.",
        ("stream", "dataset", "client_name", "client_pid", "transport"),
    )
    in_use = _gauge("beton_slots_in_use", "Slots of a stream leased to its client.", ("stream",))
    total = _gauge("beton_slots_total", "Slots of a stream.", ("stream",))
    wait = _counter(
        "beton_client_wait_seconds",
        "Seconds the client spent waiting inside next(loader), as it reported.",
        ("client",),
    )
    wall = _counter(
        "beton_client_wall_seconds", "Seconds since the client's stream opened.", ("client",)
    )
    stall = _gauge(
        "beton_client_stall_ratio",
        "Share of the client's wall time spent waiting for batches, since it connected.",
        ("client",),
    )
    for s in stats.streams:
        sid, ds = str(s.stream_id), str(s.dataset)
        batches.add_metric([sid, ds], float(s.batches_sent))
        images.add_metric([sid, ds], float(s.samples_sent))
        info.add_metric([sid, ds, str(s.client_name), str(s.client_pid), str(s.transport)], 1.0)
        in_use.add_metric([sid], float(s.slots_leased))
        total.add_metric([sid], float(s.slot_count))
        wait_s, age_s = s.client_wait_us / 1e6, max(0.0, float(s.age_s))
        wait.add_metric([sid], wait_s)
        wall.add_metric([sid], age_s)
        stall.add_metric([sid], min(1.0, wait_s / age_s) if age_s > 0 else 0.0)
    active = _gauge("beton_streams_active", "Streams open now.")
    active.add_metric([], float(len(stats.streams)))
    opened = _counter("beton_streams_opened", "Streams opened since the daemon started.")
    opened.add_metric([], float(stats.streams_opened))

    decoded = _counter(
        "beton_samples_decoded", "Samples decoded from a dataset (all streams).", ("dataset",)
    )
    decoded_b = _counter(
        "beton_batches_decoded", "Batches decoded from a dataset (all streams).", ("dataset",)
    )
    for name, samples, nbatches in stats.datasets:
        decoded.add_metric([str(name)], float(samples))
        decoded_b.add_metric([str(name)], float(nbatches))
    bad = _counter(
        "beton_bad_samples",
        "Samples skipped under the bad-sample budget (corrupt or undecodable).",
        ("dataset",),
    )
    for name, n in stats.bad_samples:
        bad.add_metric([str(name)], float(n))
    refused = _gauge(
        "beton_dataset_refused",
        "1 while the daemon refuses a dataset until a restart (a file changed under it), else 0.",
        ("dataset",),
    )
    gone = {str(name) for name, _ in stats.refused}
    for name, _, _ in stats.datasets:
        refused.add_metric([str(name)], 1.0 if str(name) in gone else 0.0)
    busy = _counter(
        "beton_op_busy_seconds", "Seconds an op spent running, over every batch.", ("op",)
    )
    runs = _counter("beton_op_runs", "Runs of an op (one batch, or one slice of one).", ("op",))
    for op, sec, n in stats.op_seconds:
        busy.add_metric([str(op)], float(sec))
        runs.add_metric([str(op)], float(n))

    labels = ("dataset", "field", "order", "decode")
    g_members = _gauge("beton_decode_group_members", "Streams in a decode group.", labels)
    g_detached = _gauge(
        "beton_decode_group_detached", "Members decoding alone for lagging.", labels
    )
    g_delivered = _counter(
        "beton_decode_group_delivered_samples", "Samples handed to a group's members.", labels
    )
    g_decoded = _counter(
        "beton_decode_group_decoded_samples", "JPEG decodes run for a group's members.", labels
    )
    g_hits = _counter(
        "beton_decode_group_hits", "Samples a member found decoded by another.", labels
    )
    g_evicted = _counter(
        "beton_decode_group_evicted", "Decoded samples dropped by the byte bound.", labels
    )
    g_waits = _counter(
        "beton_decode_group_waits", "Times a member waited for another's decode.", labels
    )
    g_bytes = _gauge("beton_decode_group_live_bytes", "Bytes of a group's cached images.", labels)
    for g in stats.decode_groups:
        key = [str(g.dataset), str(g.field), str(g.order), str(g.decode)]
        for fam, value in (
            (g_members, g.members),
            (g_detached, g.detached),
            (g_delivered, g.delivered),
            (g_decoded, g.decoded),
            (g_hits, g.hits),
            (g_evicted, g.evicted),
            (g_waits, g.waits),
            (g_bytes, g.live_bytes),
        ):
            fam.add_metric(key, float(value))
    groups: list[Metric] = [
        g_members,
        g_detached,
        g_delivered,
        g_decoded,
        g_hits,
        g_evicted,
        g_waits,
        g_bytes,
    ]

    singles: list[Metric] = []
    for fam, value in (
        (
            _gauge("beton_queue_depth", "Batches queued in the worker pool, not yet started."),
            stats.queue_depth,
        ),
        (_gauge("beton_workers", "Decode worker threads."), stats.workers),
        (
            _gauge(
                "beton_worker_utilisation",
                "Share of the workers' time spent running batches since the previous snapshot.",
            ),
            min(1.0, max(0.0, float(stats.worker_utilisation))),
        ),
        (
            _counter("beton_workers_replaced", "Workers that died and were replaced."),
            stats.workers_replaced,
        ),
        (
            _gauge("beton_shm_bytes", "Bytes of shared memory the daemon's rings hold."),
            stats.shm_bytes,
        ),
        (
            _gauge(
                "beton_ring_bytes",
                "Bytes of batch slots the open streams hold, counted against max_ring_bytes.",
            ),
            stats.ring_bytes,
        ),
        (
            _gauge(
                "beton_max_ring_bytes",
                "The stream memory budget: a stream past it is refused (0: no budget).",
            ),
            stats.max_ring_bytes,
        ),
        (
            _gauge(
                "beton_buffer_bytes",
                "Bytes of the ops' buffers the daemon holds, running a batch or kept for the next.",
            ),
            stats.buffer_bytes,
        ),
        (
            _gauge(
                "beton_idle_buffer_bytes",
                "Bytes of the ops' buffers kept for the next batches, within max_idle_buffer_bytes.",
            ),
            stats.idle_buffer_bytes,
        ),
        (
            _gauge(
                "beton_max_idle_buffer_bytes",
                "The bound on idle_buffer_bytes: past it, the buffers of layouts used longest ago "
                "are freed.",
            ),
            stats.max_idle_buffer_bytes,
        ),
        (
            _counter(
                "beton_idle_buffers_freed",
                "Kept buffer sets freed to stay within max_idle_buffer_bytes (reallocated when "
                "their layout runs again).",
            ),
            stats.idle_buffers_freed,
        ),
        (
            _gauge("beton_compiled_plans", "Compiled pipeline plans in the daemon's cache."),
            stats.compiled_plans,
        ),
        (_gauge("beton_uptime_seconds", "Seconds since the daemon started."), stats.uptime_s),
        (
            _gauge("beton_stats_stale", "1 when this scrape serves an older snapshot."),
            1.0 if stale else 0.0,
        ),
    ):
        fam.add_metric([], float(value))
        singles.append(fam)
    return [
        batches, images, info, in_use, total, wait, wall, stall, active, opened,
        decoded, decoded_b, bad, refused, busy, runs, *groups, *singles,
    ]  # fmt: skip


class DaemonCollector(Collector):
    """A ``prometheus_client`` collector over ``get_stats()`` (a ``DaemonStats`` snapshot).

    Args:
        get_stats: returns the daemon's stats; called once per scrape, on the scraping thread.
            An exception is logged, and the previous snapshot is served with
            ``beton_stats_stale 1`` (nothing at all before the first success).
    """

    def __init__(self, get_stats: Callable[[], Any]) -> None:
        self._get_stats = get_stats
        self._last: Any = None
        self._lock = threading.Lock()

    def describe(self) -> list[Metric]:
        """The families, from an empty snapshot built here: registering must not take a
        snapshot (the daemon may not be running yet). With no names described, the
        ``/metrics?name[]=...`` filter of prometheus_client answered an empty page."""
        from beton_serve.daemon import DaemonStats

        empty = DaemonStats(
            pid=0,
            uptime_s=0.0,
            workers=0,
            streams=(),
            datasets=(),
            shm_bytes=0,
            compiled_plans=0,
            streams_opened=0,
        )
        return metric_families(empty)

    def collect(self) -> Iterator[Metric]:
        with self._lock:  # concurrent scrapes take one snapshot each, in turn
            stale = False
            try:
                self._last = self._get_stats()
            except Exception:
                log.warning("daemon stats snapshot failed; serving the previous one", exc_info=True)
                stale = True
            last = self._last
        if last is not None:
            yield from metric_families(last, stale=stale)


class MetricsExporter:
    """A private registry holding one :class:`DaemonCollector`, served over HTTP on demand.

    The registry is never the process-global one, so two daemons (or tests) in one process never
    collide.

    Args:
        get_stats: see :class:`DaemonCollector`.
    """

    def __init__(self, get_stats: Callable[[], Any]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(DaemonCollector(get_stats))
        self._http: _ThreadingServer | None = None
        self._http_thread: threading.Thread | None = None

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
            server = make_server(
                host,
                port,
                _only_metrics(make_wsgi_app(self.registry)),
                cls,
                handler_class=_QuietHandler,
            )
        except OSError as exc:
            hint = (
                "pick another --metrics-port"
                if exc.errno in (errno.EADDRINUSE, errno.EACCES)
                else "check --metrics-host (an address of this machine, or 0.0.0.0)"
            )
            raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc}; {hint}") from exc
        thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="beton-metrics-http",
            daemon=True,
        )
        thread.start()
        self._http, self._http_thread = server, thread
        return server, int(server.server_address[1])

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
) -> tuple[MetricsExporter, int]:
    """Export a daemon's stats on ``http://host:port/metrics``, pulled at scrape time.

    Each scrape runs ``get_stats()`` on ``loop`` (the daemon's event loop, where its stats are
    consistent) and waits at most ``timeout`` seconds for it. Call from the loop's thread; stop
    with ``exporter.stop()`` from another thread (a scrape in flight waits for the loop).

    Returns:
        ``(exporter, port)``, the port being the bound one (``port=0`` picks a free one).

    Raises:
        ConfigError: the address cannot be bound.
    """

    async def _take() -> Any:
        return get_stats()

    def on_loop() -> Any:
        return asyncio.run_coroutine_threadsafe(_take(), loop).result(timeout)

    exporter = MetricsExporter(on_loop)
    _, bound = exporter.start_http(port, host)
    return exporter, bound
