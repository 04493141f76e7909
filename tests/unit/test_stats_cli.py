"""``beton-serve stats``: snapshot conversion, rates, rendering, --json, and a real gRPC server."""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import subprocess
import sys
import time
from concurrent import futures

import grpc
import pytest
from beton_serve.cli import build_parser
from beton_serve.cli._stats import render, run, snapshot_dict
from beton_serve.errors import TransportError
from beton_wire.v1 import beton_pb2 as pb
from beton_wire.v1 import beton_pb2_grpc as pb_grpc


def fake_response(
    batches: int = 100, wait_us: int = 2_000_000, decoded: int = 6400
) -> pb.StatsResponse:
    return pb.StatsResponse(
        pid=4242,
        uptime_s=20.0,
        workers=4,
        streams=[
            pb.StreamStats(
                stream_id="a1",
                dataset="cifar",
                client_name="train.py",
                client_pid=77,
                transport="shm",
                batches_sent=batches,
                samples_sent=batches * 64,
                slots_leased=3,
                slot_count=8,
                client_wait_us=wait_us,
                age_s=10.0,
            ),
            pb.StreamStats(
                stream_id="b2",
                dataset="imagenet",
                client_name="",
                transport="grpc",
                batches_sent=0,
                age_s=0.0,
            ),
        ],
        datasets=[
            pb.DatasetStats(name="cifar", samples_decoded=decoded, batches_decoded=decoded // 64),
            pb.DatasetStats(name="imagenet", samples_decoded=0, batches_decoded=0),
        ],
        shm_bytes=3 * 1024 * 1024,
        compiled_plans=2,
        streams_opened=5,
    )


def args_for(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["stats", *argv])


def test_lifetime_snapshot() -> None:
    d = snapshot_dict(fake_response(), now=50.0)
    assert d["rate_basis"] == "lifetime" and d["taken_at"] == 50.0
    a = next(s for s in d["streams"] if s["stream_id"] == "a1")
    assert a["batches_sent"] == 100 and isinstance(a["batches_sent"], int)
    assert a["batches_per_s"] == pytest.approx(10.0)  # 100 batches over 10 s
    assert a["images_per_s"] == pytest.approx(640.0)
    assert a["stall_pct"] == pytest.approx(20.0)  # 2 s of 10 s waiting
    b = next(s for s in d["streams"] if s["stream_id"] == "b2")
    assert b["batches_per_s"] == 0.0 and b["stall_pct"] == 0.0  # age 0: no division by zero
    assert b["client_pid"] == 0 and b["slots_leased"] == 0  # default fields are present
    ds = {x["name"]: x for x in d["datasets"]}
    assert ds["cifar"]["samples_decoded"] == 6400
    assert ds["cifar"]["samples_per_s"] == pytest.approx(320.0)  # over the 20 s uptime
    assert d["shm_bytes"] == 3 * 1024 * 1024 and d["streams_opened"] == 5
    json.dumps(d)  # JSON-safe


def test_interval_rates_from_two_snapshots() -> None:
    first = snapshot_dict(fake_response(batches=100, wait_us=2_000_000, decoded=6400), now=50.0)
    second = snapshot_dict(
        fake_response(batches=130, wait_us=2_500_000, decoded=8320), first, now=52.0
    )
    assert second["rate_basis"] == "interval"
    a = next(s for s in second["streams"] if s["stream_id"] == "a1")
    assert a["batches_per_s"] == pytest.approx(15.0)  # 30 batches in 2 s
    assert a["images_per_s"] == pytest.approx(960.0)
    assert a["stall_pct"] == pytest.approx(25.0)  # 0.5 s of 2 s
    ds = {x["name"]: x for x in second["datasets"]}
    assert ds["cifar"]["samples_per_s"] == pytest.approx(960.0)


def test_a_restarted_daemon_gets_lifetime_rates_not_negative_ones() -> None:
    """``stats --interval`` across a daemon restart on the same socket showed -222 samples/s:
    the new daemon's counters started again."""
    first = snapshot_dict(fake_response(batches=100, decoded=6400), now=50.0)
    restarted = fake_response(batches=3, wait_us=0, decoded=192)
    restarted.pid, restarted.uptime_s = 5151, 2.0
    second = snapshot_dict(restarted, first, now=52.0)
    assert second["rate_basis"] == "lifetime"
    ds = {x["name"]: x for x in second["datasets"]}
    assert ds["cifar"]["samples_per_s"] == pytest.approx(96.0)  # 192 over its 2 s
    assert all(s["batches_per_s"] >= 0 for s in second["streams"])
    # The same daemon, a dataset closed and opened again (its counter restarted): lifetime.
    again = fake_response(batches=130, decoded=100)
    third = snapshot_dict(again, first, now=52.0)
    assert {x["name"]: x for x in third["datasets"]}["cifar"]["samples_per_s"] == pytest.approx(5.0)


def test_render_table() -> None:
    from rich.console import Console

    buf = io.StringIO()
    console = Console(file=buf, width=160, color_system=None)
    console.print(render(snapshot_dict(fake_response(), now=1.0), target="unix:///x.sock"))
    text = buf.getvalue()
    assert "pid 4242" in text and "workers 4" in text and "unix:///x.sock" in text
    assert "3.0 MiB" in text
    row = next(line for line in text.splitlines() if "a1" in line)
    for cell in ("cifar", "train.py (77)", "shm", "10.0", "640", "20.0", "3/8", "100"):
        assert cell in row, (cell, row)
    drow = next(line for line in text.splitlines() if "cifar" in line and "a1" not in line)
    assert "6,400" in drow and "320" in drow
    assert "REFUSED" not in text
    reply = fake_response()
    reply.datasets[0].refused = "/d/cifar.beton: changed while dataset 'cifar' is served"
    gone = io.StringIO()
    Console(file=gone, width=160, color_system=None).print(render(snapshot_dict(reply, now=1.0)))
    assert "cifar (REFUSED)" in gone.getvalue()
    assert snapshot_dict(reply, now=1.0)["datasets"][0]["refused"].startswith("/d/cifar.beton")
    empty = io.StringIO()
    Console(file=empty, width=160).print(render(snapshot_dict(pb.StatsResponse(pid=1), now=1.0)))
    assert "(no open streams)" in empty.getvalue()


def test_decode_groups_show_their_work_in_json_and_in_the_table() -> None:
    """Issue 16 §3 where a user looks: samples decoded per group against samples delivered."""
    from rich.console import Console

    resp = fake_response()
    resp.decode_groups.append(
        pb.DecodeGroupStats(
            dataset="imagenet.beton",
            field="image",
            order="ab12cd34ef56",
            decode="min_side=160",
            members=4,
            detached=1,
            delivered=8000,
            decoded=2100,
            hits=5900,
            evicted=3,
            live_bytes=5 * 1024 * 1024,
            waits=7,
        )
    )
    d = snapshot_dict(resp, now=1.0)
    (g,) = d["decode_groups"]
    for k, v in (("delivered", 8000), ("decoded", 2100), ("hits", 5900), ("waits", 7)):
        assert g[k] == v and isinstance(g[k], int), k  # not JSON strings of 64-bit ints
    assert g["decode_epochs_per_epoch"] == pytest.approx(2100 * 4 / 8000)
    json.dumps(d)
    buf = io.StringIO()
    Console(file=buf, width=200, color_system=None).print(render(d))
    row = next(line for line in buf.getvalue().splitlines() if "imagenet.beton" in line)
    for cell in ("image", "min_side=160", "8,000", "2,100", "1.05", "5,900", "5.0 MiB"):
        assert cell in row, (cell, row)
    assert "decode groups" in buf.getvalue()
    assert "decode groups" not in _rendered(fake_response())  # no table without groups


def _rendered(resp: pb.StatsResponse) -> str:
    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=200, color_system=None).print(render(snapshot_dict(resp, now=1.0)))
    return buf.getvalue()


def test_the_ring_budget_shows_in_json_and_in_the_head_line() -> None:
    resp = fake_response()
    resp.max_ring_bytes = 4 << 30
    resp.ring_bytes = 1 << 30
    d = snapshot_dict(resp, now=1.0)
    assert (d["max_ring_bytes"], d["ring_bytes"]) == (4 << 30, 1 << 30)  # ints, not strings
    assert "ring budget 1.0 GiB of 4.0 GiB (25%)" in _rendered(resp)
    assert "ring budget" not in _rendered(fake_response())  # no budget reported: no mention


def test_the_buffer_memory_shows_in_json_and_in_the_head_line() -> None:
    resp = fake_response()
    resp.buffer_bytes = 231 << 20
    resp.idle_buffer_bytes = 154 << 20
    resp.max_idle_buffer_bytes = 3 << 30
    resp.idle_buffers_freed = 12
    d = snapshot_dict(resp, now=1.0)
    assert (
        d["buffer_bytes"],
        d["idle_buffer_bytes"],
        d["max_idle_buffer_bytes"],
        d["idle_buffers_freed"],
    ) == (231 << 20, 154 << 20, 3 << 30, 12)  # ints, not strings
    assert "buffers 231.0 MiB (idle 154.0 MiB of 3.0 GiB)" in _rendered(resp)
    assert "buffers" not in _rendered(fake_response())  # an older daemon: no mention


def test_run_json_prints_one_snapshot() -> None:
    out = io.StringIO()
    seen: list[str] = []

    def fetch(target: str) -> pb.StatsResponse:
        seen.append(target)
        return fake_response()

    rc = run(args_for("--json", "--server", "unix:///tmp/d.sock"), {}, fetch=fetch, out=out)
    assert rc == 0 and seen == ["unix:///tmp/d.sock"]
    d = json.loads(out.getvalue())
    assert {x["name"]: x["samples_decoded"] for x in d["datasets"]} == {
        "cifar": 6400,
        "imagenet": 0,
    }
    assert d["pid"] == 4242 and len(d["streams"]) == 2
    # The address comes from the environment when --server is not given.
    run(args_for("--json"), {"BETON_SERVE_ADDRESS": "localhost:1234"}, fetch=fetch, out=out)
    assert seen[-1] == "localhost:1234"


def test_run_live_refreshes_with_interval_rates() -> None:
    responses = iter(
        [fake_response(batches=100), fake_response(batches=110), fake_response(batches=150)]
    )
    sleeps: list[float] = []
    out = io.StringIO()
    rc = run(
        args_for("--interval", "0.25", "--count", "3", "--server", "x:1"),
        {},
        fetch=lambda t: next(responses),
        out=out,
        sleep=sleeps.append,
    )
    assert rc == 0 and sleeps == [0.25, 0.25]
    assert "over the last interval" in out.getvalue()
    with pytest.raises(StopIteration):
        next(responses)  # exactly three fetches


def test_flags_are_validated() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["stats", "--interval", "0"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["stats", "--interval", "abc"])


class _StatsOnly(pb_grpc.BetonServeServicer):
    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        return fake_response()


def test_fetch_over_real_grpc_and_unreachable(tmp_path) -> None:
    pool = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="beton-test-grpc")
    server = grpc.server(pool)
    pb_grpc.add_BetonServeServicer_to_server(_StatsOnly(), server)
    sock = tmp_path / "s.sock"
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    try:
        out = io.StringIO()
        assert run(args_for("--json", "--server", f"unix://{sock}"), {}, out=out) == 0
        assert json.loads(out.getvalue())["workers"] == 4
    finally:
        server.stop(None).wait(5)
        pool.shutdown(wait=True)
    with pytest.raises(TransportError, match="no beton-serve daemon answered"):
        run(
            args_for("--json", "--server", f"unix://{tmp_path}/none.sock", "--timeout", "0.3"),
            {},
            out=io.StringIO(),
        )


@pytest.mark.slow
def test_stats_against_a_real_daemon(tmp_path, fixtures_dir, capsys) -> None:
    """Start ``beton-serve serve`` on a Unix socket and read its stats with the CLI."""
    from beton_serve.cli import main

    sock = tmp_path / "d.sock"
    log = (tmp_path / "daemon.log").open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from beton_serve.cli import main; sys.exit(main())",
            "serve",
            str(fixtures_dir / "images_raw.beton"),
            "--socket",
            str(sock),
            "--workers",
            "1",
            "--metrics-port",
            "0",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "BETON_SERVE_ADDRESS": ""},
    )
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("daemon did not start: " + (tmp_path / "daemon.log").read_text())
            time.sleep(0.1)
        capsys.readouterr()
        assert main(["stats", "--json", "--server", f"unix://{sock}", "--timeout", "30"]) == 0
        snap = json.loads(capsys.readouterr().out)
        assert snap["pid"] == proc.pid
        assert snap["workers"] == 1
        assert snap["streams"] == []
        assert [(d["name"], d["samples_decoded"]) for d in snap["datasets"]] == [("images_raw", 0)]
        assert (
            main(["stats", "--server", f"unix://{sock}", "--count", "2", "--interval", "0.2"]) == 0
        )
        live = capsys.readouterr().out
        assert "images_raw" in live and str(proc.pid) in live
        # --metrics-port: Prometheus text from the same daemon, pulled at scrape time.
        import re
        import urllib.request

        while not (m := re.search(r'metrics url=([^\s"]+)', (tmp_path / "daemon.log").read_text())):
            if time.monotonic() > deadline:
                pytest.fail("no metrics url logged")
            time.sleep(0.1)
        with urllib.request.urlopen(m.group(1), timeout=10) as resp:
            text = resp.read().decode()
        assert "beton_workers 1.0" in text
        assert 'beton_samples_decoded_total{dataset="images_raw"} 0.0' in text
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()
    assert proc.returncode == 0
