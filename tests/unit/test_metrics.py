"""Metrics: the pull collector over DaemonStats, and its exporter scraped over loopback HTTP."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.error
import urllib.request

import pytest
from beton_serve.daemon import DaemonStats, StreamStats
from beton_serve.errors import ConfigError
from beton_serve.metrics import DaemonCollector, MetricsExporter, serve_daemon_metrics
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _parse(text: str) -> Samples:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(port: int) -> Samples:
    """Fetch /metrics and return {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        return _parse(resp.read().decode())


def _stats(streams, datasets, workers=2, **extra) -> DaemonStats:
    return DaemonStats(
        pid=1,
        uptime_s=10.0,
        workers=workers,
        streams=tuple(
            StreamStats(
                stream_id=sid,
                dataset=ds,
                client_name="train.py",
                client_pid=99,
                transport="shm",
                batches_sent=b,
                samples_sent=b * 4,
                slots_leased=1,
                slot_count=5,
                client_wait_us=w,
                age_s=age,
            )
            for sid, ds, b, w, age in streams
        ),
        datasets=tuple(datasets),
        shm_bytes=4096,
        compiled_plans=1,
        streams_opened=len(streams),
        **extra,
    )


@pytest.fixture
def exporter_of():
    made: list[MetricsExporter] = []

    def make(get_stats) -> tuple[MetricsExporter, int]:
        e = MetricsExporter(get_stats)
        made.append(e)
        _, port = e.start_http(0)
        return e, port

    yield make
    for e in made:
        e.stop()


def test_every_field_of_a_snapshot_becomes_a_metric(exporter_of) -> None:
    stats = _stats(
        [("s1", "cifar", 3, 500_000, 2.0)],
        [("cifar", 96, 3)],
        queue_depth=5,
        worker_utilisation=0.75,
        workers_replaced=1,
        bad_samples=(("cifar", 2),),
        op_seconds=(("SimpleRGBImageDecoder", 0.006, 2), ("RandomHorizontalFlip", 0.0001, 1)),
        buffer_bytes=7000,
        idle_buffer_bytes=3000,
        max_idle_buffer_bytes=5000,
        idle_buffers_freed=4,
    )
    _, port = exporter_of(lambda: stats)
    got = scrape(port)
    s1 = (("dataset", "cifar"), ("stream", "s1"))
    assert got[("beton_stream_batches_total", s1)] == 3
    assert got[("beton_stream_images_total", s1)] == 12
    assert got[("beton_slots_in_use", (("stream", "s1"),))] == 1
    assert got[("beton_slots_total", (("stream", "s1"),))] == 5
    assert got[("beton_client_wait_seconds_total", (("client", "s1"),))] == pytest.approx(0.5)
    assert got[("beton_client_wall_seconds_total", (("client", "s1"),))] == pytest.approx(2.0)
    assert got[("beton_client_stall_ratio", (("client", "s1"),))] == pytest.approx(0.25)
    info = (
        ("client_name", "train.py"),
        ("client_pid", "99"),
        ("dataset", "cifar"),
        ("stream", "s1"),
        ("transport", "shm"),
    )
    assert got[("beton_stream_info", info)] == 1
    assert got[("beton_streams_active", ())] == 1
    assert got[("beton_streams_opened_total", ())] == 1
    assert got[("beton_samples_decoded_total", (("dataset", "cifar"),))] == 96
    assert got[("beton_batches_decoded_total", (("dataset", "cifar"),))] == 3
    assert got[("beton_bad_samples_total", (("dataset", "cifar"),))] == 2
    op = (("op", "SimpleRGBImageDecoder"),)
    assert got[("beton_op_busy_seconds_total", op)] == pytest.approx(0.006)
    assert got[("beton_op_runs_total", op)] == 2
    assert got[("beton_queue_depth", ())] == 5
    assert got[("beton_workers", ())] == 2
    assert got[("beton_worker_utilisation", ())] == pytest.approx(0.75)
    assert got[("beton_workers_replaced_total", ())] == 1
    assert got[("beton_shm_bytes", ())] == 4096
    assert got[("beton_buffer_bytes", ())] == 7000
    assert got[("beton_idle_buffer_bytes", ())] == 3000
    assert got[("beton_max_idle_buffer_bytes", ())] == 5000
    assert got[("beton_idle_buffers_freed_total", ())] == 4
    assert got[("beton_compiled_plans", ())] == 1
    assert got[("beton_uptime_seconds", ())] == 10
    assert got[("beton_stats_stale", ())] == 0


def test_decode_groups_are_exported(exporter_of) -> None:
    from beton_serve.daemon._messages import DecodeGroupRow

    row = DecodeGroupRow(
        dataset="imagenet", field="image", order="ab12", decode="full", members=4, detached=1,
        delivered=400, decoded=110, hits=290, evicted=3, live_bytes=1 << 20, waits=7,
    )  # fmt: skip
    _, port = exporter_of(lambda: _stats([], [], decode_groups=(row,)))
    got = scrape(port)
    key = (("dataset", "imagenet"), ("decode", "full"), ("field", "image"), ("order", "ab12"))
    assert got[("beton_decode_group_members", key)] == 4
    assert got[("beton_decode_group_detached", key)] == 1
    assert got[("beton_decode_group_delivered_samples_total", key)] == 400
    assert got[("beton_decode_group_decoded_samples_total", key)] == 110
    assert got[("beton_decode_group_hits_total", key)] == 290
    assert got[("beton_decode_group_evicted_total", key)] == 3
    assert got[("beton_decode_group_waits_total", key)] == 7
    assert got[("beton_decode_group_live_bytes", key)] == 1 << 20


def test_each_scrape_reads_a_new_snapshot_and_gone_streams_vanish(exporter_of) -> None:
    state = {"stats": _stats([("s1", "cifar", 10, 500_000, 2.0)], [("cifar", 40, 10)])}
    calls = []

    def get():
        calls.append(1)
        return state["stats"]

    _, port = exporter_of(get)
    s1 = (("dataset", "cifar"), ("stream", "s1"))
    assert scrape(port)[("beton_stream_batches_total", s1)] == 10
    state["stats"] = _stats(
        [("s1", "cifar", 30, 1_500_000, 4.0), ("s2", "cifar", 5, 0, 1.0)], [("cifar", 140, 35)]
    )
    got = scrape(port)
    assert got[("beton_stream_batches_total", s1)] == 30
    assert got[("beton_client_stall_ratio", (("client", "s1"),))] == pytest.approx(0.375)
    assert got[("beton_streams_active", ())] == 2
    state["stats"] = _stats([("s2", "cifar", 6, 0, 2.0)], [("cifar", 144, 36)])
    got = scrape(port)
    assert ("beton_stream_batches_total", s1) not in got
    assert ("beton_client_stall_ratio", (("client", "s1"),)) not in got
    assert got[("beton_samples_decoded_total", (("dataset", "cifar"),))] == 144
    assert len(calls) == 3  # one snapshot per scrape, none at registration


def test_a_failed_snapshot_serves_the_previous_one_marked_stale(exporter_of, caplog) -> None:
    state: dict = {"fail": False}

    def get():
        if state["fail"]:
            raise RuntimeError("event loop is gone")
        return _stats([], [], workers=3)

    _, port = exporter_of(get)
    assert scrape(port)[("beton_workers", ())] == 3
    state["fail"] = True
    got = scrape(port)
    assert got[("beton_workers", ())] == 3
    assert got[("beton_stats_stale", ())] == 1
    assert "daemon stats snapshot failed" in caplog.text


def test_a_collector_that_never_succeeded_serves_nothing() -> None:
    reg = CollectorRegistry(auto_describe=False)

    def broken():
        raise RuntimeError("no daemon yet")

    reg.register(DaemonCollector(broken))
    assert generate_latest(reg).strip() == b""


def test_two_exporters_do_not_collide_or_touch_the_global_registry(exporter_of) -> None:
    _, pa = exporter_of(lambda: _stats([], [], workers=1))
    _, pb = exporter_of(lambda: _stats([], [], workers=4))
    assert scrape(pa)[("beton_workers", ())] == 1
    assert scrape(pb)[("beton_workers", ())] == 4
    assert REGISTRY.get_sample_value("beton_workers") is None


def test_stop_frees_the_port_and_joins_the_thread() -> None:
    e = MetricsExporter(lambda: _stats([], []))
    _, port = e.start_http(0)
    assert any(t.name == "beton-metrics-http" for t in threading.enumerate())
    e.stop()
    e.stop()  # idempotent
    assert not any(t.name == "beton-metrics-http" for t in threading.enumerate())
    again = MetricsExporter(lambda: _stats([], []))
    try:
        again.start_http(port)  # the port is free again
    finally:
        again.stop()


def test_idle_connections_time_out_and_are_bounded(
    exporter_of, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Connections that send nothing held a thread and a descriptor each, for good: 500 of them
    took the daemon to 513 threads. Now each times out, and at most MAX_HTTP_CONNECTIONS are
    served at once (more are closed as they arrive)."""
    import socket

    from beton_serve import metrics

    monkeypatch.setattr(metrics._QuietHandler, "timeout", 0.5)
    _, port = exporter_of(lambda: _stats([], [], workers=3))
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]
    try:
        time.sleep(0.3)
        assert threading.active_count() - before <= metrics.MAX_HTTP_CONNECTIONS
        over = idle[-1]
        over.settimeout(5)
        assert over.recv(1) == b""  # closed by the server, beyond the bound
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 10  # the handlers' timeouts free their threads
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before
    assert scrape(port)[("beton_workers", ())] == 3  # still scraped


def test_port_in_use_and_double_start_are_config_errors(exporter_of) -> None:
    e, port = exporter_of(lambda: _stats([], []))
    with pytest.raises(ConfigError, match="already running"):
        e.start_http(0)
    other = MetricsExporter(lambda: _stats([], []))
    with pytest.raises(ConfigError, match="pick another --metrics-port"):
        other.start_http(port)


def test_an_address_not_of_this_machine_names_the_host_not_the_port() -> None:
    e = MetricsExporter(lambda: _stats([], []))
    with pytest.raises(ConfigError, match="check --metrics-host") as info:
        e.start_http(0, host="192.0.2.1")  # TEST-NET-1: never a local address
    assert "--metrics-port" not in str(info.value)


def test_only_the_metrics_paths_answer(exporter_of) -> None:
    """It answered every path with the metrics (``/admin``, ``/../etc``): now ``/metrics``
    and ``/`` do, with or without a query string, and anything else is a 404."""
    _, port = exporter_of(lambda: _stats([], []))
    with urllib.request.urlopen(
        f"http://127.0.0.1:{port}/metrics?name[]=beton_workers&name[]=beton_uptime_seconds",
        timeout=5,
    ) as resp:  # prometheus_client's name filter (it answered an empty page)
        assert sorted(_parse(resp.read().decode())) == [
            ("beton_uptime_seconds", ()),
            ("beton_workers", ()),
        ]
    for path in ("/metrics", "/", "/metrics?format=text"):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            assert resp.status == 200, path
            assert ("beton_workers", ()) in _parse(resp.read().decode()), path
    for path in ("/admin", "/metrics/x", "/favicon.ico", "/../metrics"):
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5)
        assert info.value.code == 404, path
        assert b"/metrics" in info.value.read()
    assert scrape(port)[("beton_workers", ())] == 2  # and the exporter still serves


def test_serve_daemon_metrics_takes_the_snapshot_on_the_event_loop() -> None:
    calls: list[str] = []

    def get_stats():
        calls.append(threading.current_thread().name)
        return _stats([("s9", "imagenet", 3, 0, 1.0)], [("imagenet", 12, 3)])

    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, name="beton-test-loop")
    t.start()
    try:
        fut = asyncio.run_coroutine_threadsafe(
            asyncio.sleep(0, serve_daemon_metrics(get_stats, loop, 0)), loop
        )
        m, port = fut.result(5)
        try:
            got = scrape(port)
        finally:
            m.stop()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)
        loop.close()
    assert calls == ["beton-test-loop"]
    s9 = (("dataset", "imagenet"), ("stream", "s9"))
    assert got[("beton_stream_batches_total", s9)] == 3
    assert got[("beton_samples_decoded_total", (("dataset", "imagenet"),))] == 12
