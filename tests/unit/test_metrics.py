"""Metrics: recorders, the Prometheus exporter scraped over loopback HTTP, and the snapshot."""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest
from beton_serve.errors import ConfigError
from beton_serve.metrics import Metrics
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Fetch /metrics and return {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture
def metrics():
    m = Metrics(clock=FakeClock())
    yield m
    m.stop()


def test_scrape_over_http_reports_every_metric(metrics: Metrics) -> None:
    m = metrics
    m.register_dataset("cifar")
    m.open_stream("s1", dataset="cifar", client="c1")
    for _ in range(3):
        m.batch_delivered("s1", images=32)
    m.samples_decoded("cifar", 96)
    m.bad_samples("cifar", 2)
    m.observe_op("SimpleRGBImageDecoder", 0.002)
    m.observe_op("SimpleRGBImageDecoder", 0.004)
    m.observe_op("RandomHorizontalFlip", 0.0001)
    m.set_queue_depth(5)
    m.set_workers(4)
    m.set_worker_utilisation(0.75)
    m.set_slots("s1", in_use=3, total=8)
    m.report_stall("c1", wait_s=0.5, wall_s=2.0)
    m.report_stall("c1", wait_s=0.1, wall_s=1.0)

    server, port = m.start_http(0)
    assert port > 0 and server.server_address[1] == port
    got = scrape(port)

    s1 = (("dataset", "cifar"), ("stream", "s1"))
    assert got[("beton_stream_batches_total", s1)] == 3
    assert got[("beton_stream_images_total", s1)] == 96
    assert got[("beton_samples_decoded_total", (("dataset", "cifar"),))] == 96
    assert got[("beton_bad_samples_total", (("dataset", "cifar"),))] == 2
    dec = (("op", "SimpleRGBImageDecoder"),)
    assert got[("beton_op_seconds_count", dec)] == 2
    assert got[("beton_op_seconds_sum", dec)] == pytest.approx(0.006)
    # 2 ms and 4 ms both fall in the 10 ms bucket, neither in the 1 ms one.
    assert got[("beton_op_seconds_bucket", (("le", "0.01"), ("op", "SimpleRGBImageDecoder")))] == 2
    assert got[("beton_op_seconds_bucket", (("le", "0.001"), ("op", "SimpleRGBImageDecoder")))] == 0
    assert got[("beton_op_seconds_count", (("op", "RandomHorizontalFlip"),))] == 1
    assert got[("beton_queue_depth", ())] == 5
    assert got[("beton_workers", ())] == 4
    assert got[("beton_worker_utilisation", ())] == 0.75
    assert got[("beton_slots_in_use", (("stream", "s1"),))] == 3
    assert got[("beton_slots_total", (("stream", "s1"),))] == 8
    c1 = (("client", "c1"),)
    assert got[("beton_client_stall_ratio", c1)] == pytest.approx(0.1)  # last interval
    assert got[("beton_client_wait_seconds_total", c1)] == pytest.approx(0.6)
    assert got[("beton_client_wall_seconds_total", c1)] == pytest.approx(3.0)
    assert got[("beton_streams_active", ())] == 1

    # Never the process-global registry.
    assert REGISTRY.get_sample_value("beton_workers") is None


def test_two_instances_do_not_collide() -> None:
    a, b = Metrics(), Metrics()
    a.set_workers(2)
    b.set_workers(7)
    assert a.registry.get_sample_value("beton_workers") == 2
    assert b.registry.get_sample_value("beton_workers") == 7


def test_stop_frees_the_port_and_joins_the_thread(metrics: Metrics) -> None:
    _, port = metrics.start_http(0)
    with pytest.raises(ConfigError, match="already running"):
        metrics.start_http(0)
    metrics.stop()
    assert not any(t.name == "beton-metrics-http" for t in threading.enumerate())
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    metrics.stop()  # idempotent
    _, port2 = metrics.start_http(0)  # restartable
    assert scrape(port2)[("beton_workers", ())] == 0


def test_port_in_use_is_a_config_error(metrics: Metrics) -> None:
    other = Metrics()
    _, port = other.start_http(0)
    try:
        with pytest.raises(ConfigError, match="--metrics-port"):
            metrics.start_http(port)
    finally:
        other.stop()


def test_snapshot_rates_over_the_window() -> None:
    clock = FakeClock()
    m = Metrics(rate_window_s=5.0, clock=clock)
    m.open_stream("s", dataset="imagenet", client="c")
    # 10 batches of 8 images per second for 10 s.
    for _ in range(100):
        clock.t += 0.1
        m.batch_delivered("s", images=8)
    snap = m.snapshot()
    st = snap["streams"]["s"]
    assert st["batches"] == 100 and st["images"] == 800
    assert st["batches_per_s"] == pytest.approx(10.0, rel=0.05)
    assert st["images_per_s"] == pytest.approx(80.0, rel=0.05)
    assert st["dataset"] == "imagenet" and st["client"] == "c"
    # The stream goes quiet: after a full window without batches the rate is 0.
    clock.t += 6.0
    st = m.snapshot()["streams"]["s"]
    assert st["batches_per_s"] == 0.0 and st["batches"] == 100
    # The window is bounded however many batches arrive.
    for _ in range(10_000):
        clock.t += 0.001
        m.batch_delivered("s", images=1)
    assert len(m._streams["s"].points) <= 5.0 / 0.1 + 2


def test_snapshot_is_json_and_has_dataset_totals(metrics: Metrics) -> None:
    m = metrics
    m.register_dataset("a")
    m.register_dataset("b")
    m.samples_decoded("a", 10)
    m.samples_decoded("a", 5)
    m.observe_op("Op", 0.5)
    m.observe_op("Op", 1.5)
    m.report_stall("c", 1.0, 4.0)
    m.report_stall("c", 3.0, 4.0)
    snap = json.loads(json.dumps(m.snapshot()))
    assert snap["datasets"] == {
        "a": {"samples_decoded": 15, "bad_samples": 0},
        "b": {"samples_decoded": 0, "bad_samples": 0},
    }
    assert snap["ops"]["Op"] == {"count": 2, "total_s": 2.0, "mean_s": 1.0}
    c = snap["clients"]["c"]
    assert c["stall_ratio"] == pytest.approx(0.75)
    assert c["stall_ratio_total"] == pytest.approx(0.5)
    assert c["wait_s"] == 4.0 and c["wall_s"] == 8.0


def test_close_stream_and_forget_client_remove_label_sets(metrics: Metrics) -> None:
    m = metrics
    m.open_stream("s", dataset="d")
    m.batch_delivered("s", 4)
    m.set_slots("s", 1, 2)
    m.report_stall("c", 0.0, 1.0)
    reg = m.registry
    assert reg.get_sample_value("beton_stream_batches_total", {"stream": "s", "dataset": "d"}) == 1
    m.close_stream("s")
    m.forget_client("c")
    text = "\n".join(
        s.name + str(s.labels) for fam in reg.collect() for s in fam.samples if s.labels
    )
    assert "'s'" not in text and "'c'" not in text
    assert m.snapshot()["streams"] == {} and m.snapshot()["clients"] == {}
    assert reg.get_sample_value("beton_streams_active") == 0
    m.close_stream("s")  # no-op
    m.forget_client("c")
    with pytest.raises(ConfigError, match="open_stream"):
        m.batch_delivered("s", 1)


def test_validation(metrics: Metrics) -> None:
    m = metrics
    m.open_stream("s", dataset="d")
    with pytest.raises(ConfigError, match="already registered"):
        m.open_stream("s", dataset="d")
    with pytest.raises(ConfigError):
        m.report_stall("c", float("nan"), 1.0)
    with pytest.raises(ConfigError):
        m.report_stall("c", -1.0, 1.0)
    with pytest.raises(ConfigError):
        m.set_worker_utilisation(1.5)
    with pytest.raises(ConfigError):
        Metrics(rate_window_s=0)
    m.report_stall("c", 0.0, 0.0)  # an empty interval is fine: share 0
    assert m.snapshot()["clients"]["c"]["stall_ratio"] == 0.0
    m.report_stall("c", 2.0, 1.0)  # jitter: wait is capped at wall, never above 100 %
    c = m.snapshot()["clients"]["c"]
    assert c["stall_ratio"] == 1.0 and c["wait_s"] == 1.0 and c["wall_s"] == 1.0


def test_recorders_are_thread_safe(metrics: Metrics) -> None:
    m = metrics
    m.open_stream("s", dataset="d")

    def work() -> None:
        for _ in range(2000):
            m.batch_delivered("s", 2)
            m.samples_decoded("d", 2)

    threads = [threading.Thread(target=work, name=f"beton-test-{i}") for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = m.snapshot()
    assert snap["streams"]["s"]["batches"] == 8000
    assert snap["datasets"]["d"]["samples_decoded"] == 16000
    assert m.registry.get_sample_value("beton_samples_decoded_total", {"dataset": "d"}) == 16000


def _stats(streams, datasets, workers=2):
    from beton_serve.daemon import DaemonStats, StreamStats

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
        shm_bytes=0,
        compiled_plans=1,
        streams_opened=len(streams),
    )


def test_sync_daemon_stats_pulls_counters_at_scrape_time(metrics: Metrics) -> None:
    m = metrics
    state = {
        "stats": _stats([("s1", "cifar", 10, 500_000, 2.0)], [("cifar", 40, 10)]),
        "calls": 0,
    }

    def refresh(mm: Metrics) -> None:
        state["calls"] += 1
        mm.sync_daemon_stats(state["stats"])

    m.set_refresh(refresh)
    _, port = m.start_http(0)
    got = scrape(port)
    s1 = (("dataset", "cifar"), ("stream", "s1"))
    assert state["calls"] == 1
    assert got[("beton_stream_batches_total", s1)] == 10
    assert got[("beton_stream_images_total", s1)] == 40
    assert got[("beton_samples_decoded_total", (("dataset", "cifar"),))] == 40
    assert got[("beton_client_stall_ratio", (("client", "s1"),))] == pytest.approx(0.25)
    assert got[("beton_slots_in_use", (("stream", "s1"),))] == 1
    assert got[("beton_workers", ())] == 2

    # The daemon's counters grew; a second stream opened.
    state["stats"] = _stats(
        [("s1", "cifar", 30, 1_500_000, 4.0), ("s2", "cifar", 5, 0, 1.0)], [("cifar", 140, 35)]
    )
    got = scrape(port)
    assert got[("beton_stream_batches_total", s1)] == 30  # advanced by the growth, not re-added
    assert got[("beton_samples_decoded_total", (("dataset", "cifar"),))] == 140
    assert got[("beton_client_stall_ratio", (("client", "s1"),))] == pytest.approx(0.5)
    assert got[("beton_client_wait_seconds_total", (("client", "s1"),))] == pytest.approx(1.5)
    assert got[("beton_stream_batches_total", (("dataset", "cifar"), ("stream", "s2")))] == 5
    assert got[("beton_streams_active", ())] == 2

    # s1 closed: its label sets go; the snapshot (which also refreshes) agrees.
    state["stats"] = _stats([("s2", "cifar", 6, 0, 2.0)], [("cifar", 144, 36)])
    snap = m.snapshot()
    assert list(snap["streams"]) == ["s2"] and snap["datasets"]["cifar"]["samples_decoded"] == 144
    assert snap["streams"]["s2"]["client"] == "train.py:99"
    got = scrape(port)
    assert ("beton_stream_batches_total", s1) not in got
    assert ("beton_client_stall_ratio", (("client", "s1"),)) not in got


def test_failed_refresh_serves_the_last_values(metrics: Metrics, caplog) -> None:
    m = metrics
    m.set_workers(3)

    def broken(_m: Metrics) -> None:
        raise RuntimeError("event loop is gone")

    m.set_refresh(broken)
    _, port = m.start_http(0)
    assert scrape(port)[("beton_workers", ())] == 3
    assert "metrics refresh failed" in caplog.text


def test_serve_daemon_metrics_pulls_from_the_event_loop() -> None:
    import asyncio

    from beton_serve.metrics import serve_daemon_metrics

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
    assert calls == ["beton-test-loop"]  # the stats were taken on the daemon's loop
    s9 = (("dataset", "imagenet"), ("stream", "s9"))
    assert got[("beton_stream_batches_total", s9)] == 3
    assert got[("beton_samples_decoded_total", (("dataset", "imagenet"),))] == 12
