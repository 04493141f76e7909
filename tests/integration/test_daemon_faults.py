# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""Faults with a real daemon: killed clients, SIGTERM, SIGKILL and the stale-segment sweep, bad requests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from beton_client import (
    BetonClientError,
    Loader,
    OrderOption,
    ServerUnavailable,
    SpecError,
    TransportError,
)
from beton_serve.fields.decoders import IntDecoder
from beton_serve.transforms import ToTensor
from beton_serve.transport.shm import sweep_stale_segments
from beton_wire.v1 import beton_pb2 as pb
from beton_wire.v1 import beton_pb2_grpc as pb_grpc
from helpers.daemon import (  # noqa: F401
    SHM,
    DaemonProcess,
    daemon,
    daemon_factory,
    short_tmp,
    start_daemon,
    wait_for,
)
from helpers.shm_markers import MarkerHolder, dead_pid

pytestmark = pytest.mark.slow

INT_ONLY = {
    "int": [IntDecoder(), ToTensor()],
    "float": None,
    "array": None,
    "blob": None,
    "meta": None,
}

_CLIENT = """
import sys, time
from beton_client import Loader
from beton_serve.fields.decoders import IntDecoder
pipes = {"int": [IntDecoder()], "float": None, "array": None, "blob": None, "meta": None}
ld = Loader("mixed_fields", batch_size=4, pipelines=pipes, server=sys.argv[1], batches_ahead=2)
it = iter(ld)
next(it)
print("READY", flush=True)
time.sleep(120)
"""


def _wait(pred, timeout: float, step: float = 0.02) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return time.monotonic() - t0
        time.sleep(step)
    raise AssertionError(f"condition not met within {timeout} s")


def test_kill_9_client_mid_epoch_frees_its_slots_and_others_carry_on(daemon) -> None:
    other = Loader("mixed_fields", batch_size=5, pipelines=INT_ONLY, server=daemon.address, seed=3)
    proc = subprocess.Popen(
        [sys.executable, "-c", _CLIENT, daemon.address],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        got = []
        it = iter(other)
        got.append(next(it)[0].clone())
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"READY"
        mine = [s for s in daemon.stats().streams if s.client_pid == proc.pid]
        assert len(mine) == 1 and mine[0].slots_leased >= 1 and mine[0].transport == "shm"
        segs_before = set(daemon.segments())
        assert len(segs_before) == 2  # one ring per stream
        proc.send_signal(signal.SIGKILL)
        took = _wait(lambda: not any(s.client_pid == proc.pid for s in daemon.stats().streams), 3.0)
        assert took < 1.0, f"leases reclaimed after {took:.2f} s"
        assert len(daemon.segments()) == 1
        got.extend(b[0].clone() for b in it)  # the other client finishes its epoch
        assert len(got) == len(other) == 10
        assert sorted(np.concatenate([g.numpy().reshape(-1) for g in got]).tolist()) == sorted(
            np.load(Path(__file__).parents[1] / "data/ffcv/mixed_fields.expected.npz")["int"]
            .reshape(-1)
            .tolist()
        )
    finally:
        proc.kill()
        proc.wait(10)
        other.close()
    _wait(lambda: not daemon.segments(), 3.0)


def _assert_left_nothing(d: DaemonProcess) -> None:
    """A stopped daemon left no ring, no file of its pid under /dev/shm and no socket."""
    assert d.segments() == []
    assert not list(SHM.glob(f"beton-{d.pid}-*"))
    assert not os.path.exists(d.socket)


def test_sigterm_drains_exits_0_and_leaves_no_segment(daemon_factory, fixtures_dir: Path) -> None:
    d = daemon_factory([fixtures_dir / "mixed_fields.beton"])
    ld = Loader("mixed_fields", batch_size=4, pipelines=INT_ONLY, server=d.address)
    try:
        it = iter(ld)
        next(it)
        assert d.segments()
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(20) == 0
        _assert_left_nothing(d)
        assert "draining" in d.log()
        # Batches already published stay readable (the client's mapping outlives the unlink);
        # then the stream's final status, UNAVAILABLE, surfaces as ServerUnavailable.
        with pytest.raises(ServerUnavailable):
            for _ in range(3):
                for _ in it:
                    pass
                it = iter(ld)
    finally:
        ld.close()


@pytest.mark.parametrize("repeated", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_repeated_while_stopping_still_exits_0_and_frees_everything(
    daemon_factory, fixtures_dir: Path, repeated: signal.Signals
) -> None:
    """A supervisor that repeats SIGTERM (or Ctrl-C pressed twice) must not cut the cleanup short.

    Once the event loop closed, its handlers were gone and a second SIGTERM killed the daemon in
    the middle of freeing its rings (exit -15, segments left behind: a CI run caught it through
    the test helper's own SIGTERM). A SIGHUP (a reload from logrotate or systemd's ExecReload
    racing the stop) killed it the same way, with -1."""
    d = daemon_factory([fixtures_dir / "mixed_fields.beton"])
    ld = Loader("mixed_fields", batch_size=4, pipelines=INT_ONLY, server=d.address)
    try:
        next(iter(ld))
        assert d.segments()
        deadline, sent = time.monotonic() + 20, 0
        while d.proc.poll() is None and time.monotonic() < deadline:
            # the first SIGTERM starts the drain, the rest land on it
            d.proc.send_signal(signal.SIGTERM if sent == 0 else repeated)
            sent += 1
            time.sleep(0.005)
        assert d.proc.wait(5) == 0, d.log()
        assert sent > 5  # the stop took long enough for the repeats to land while it ran
        _assert_left_nothing(d)
    finally:
        ld.close()


def test_daemon_after_a_sigkilled_one_sweeps_its_segments(
    daemon_factory, fixtures_dir: Path
) -> None:
    """A daemon sweeps at start, before it serves, so once d2 serves the dead daemon's files are
    gone. Any daemon starting on this host in between may be the one that swept them (its log
    then says so, not d2's), so the test checks only that they are gone, never who swept."""
    d1 = daemon_factory([fixtures_dir / "mixed_fields.beton"])
    ld = Loader("mixed_fields", batch_size=4, pipelines=INT_ONLY, server=d1.address)
    try:
        next(iter(ld))
        stale = d1.shm_files()  # rings, the notice socket and the live marker
        assert any("-notice-" in s for s in stale) and any("-ring-" in s for s in stale)
        assert any(s.endswith("-live") for s in stale)
        d1.proc.send_signal(signal.SIGKILL)
        d1.proc.wait(10)
    finally:
        ld.close()
    d2 = daemon_factory([fixtures_dir / "mixed_fields.beton"], socket=d1.socket)
    assert not any((SHM / s).exists() for s in stale)
    with Loader("mixed_fields", batch_size=4, pipelines=INT_ONLY, server=d2.address) as ld2:
        assert sum(1 for _ in ld2) == 12


def test_a_daemon_sweeps_again_a_group_still_locked_at_its_start(
    daemon_factory, fixtures_dir: Path
) -> None:
    """A daemon started right after ``kill -9`` of its predecessor can find that daemon's live
    marker still locked (its main thread a zombie, its other threads still exiting) and left
    its segments until the next start. It now sweeps again shortly after its start: here the
    lock is held by a stand-in, released once the new daemon serves."""
    holder = MarkerHolder(SHM, dead_pid())
    try:
        d = daemon_factory([fixtures_dir / "mixed_fields.beton"])
        assert holder.ring.exists()  # locked at the daemon's start: left
        holder.release()
        # The whole group goes: its ring, then its live marker (a sweep unlinks markers last,
        # so the group stays visible to a sweep running beside it until then).
        wait_for(lambda: not any(n.startswith(holder.prefix) for n in os.listdir(SHM)), 30.0)
        assert not holder.ring.exists()
        # The daemon swept it (no other daemon starts during this test), and still serves.
        wait_for(lambda: holder.ring.name in d.log(), 5.0)
        with Loader("mixed_fields", batch_size=4, pipelines=INT_ONLY, server=d.address) as ld:
            assert sum(1 for _ in ld) == 12
    finally:
        holder.release()
        sweep_stale_segments()


class _FakeOp:
    """An op as the client sees it: a wire name and parameters (duck typing)."""

    def __init__(self, name: str, params: dict) -> None:
        self.spec_name = name
        self._params = params

    def spec_params(self) -> dict:
        return self._params


@pytest.mark.parametrize(
    ("kwargs", "cls", "words"),
    [
        ({"fname_or_dataset": "nope"}, SpecError, ["unknown dataset 'nope'", "mixed_fields"]),
        ({"pipelines": {"colour": [IntDecoder()]}}, SpecError, ["no field is named 'colour'"]),
        ({"pipelines": {"int": [_FakeOp("NoSuchOp", {})]}}, SpecError, ["NoSuchOp"]),
        (
            {"pipelines": {"int": [_FakeOp("NDArrayDecoder", {"bogus": 1})]}},
            SpecError,
            ["NDArrayDecoder"],
        ),
        ({"batch_size": 10**6}, SpecError, ["batch_size", "out of range"]),
        ({"transport": "cuda_ipc"}, TransportError, ["cuda_ipc"]),
        ({"order": "SIDEWAYS"}, SpecError, ["order"]),
    ],
)
def test_bad_requests_get_typed_errors_and_the_daemon_keeps_serving(
    daemon, kwargs, cls, words
) -> None:
    args = {"fname_or_dataset": "mixed_fields", "batch_size": 4, "server": daemon.address}
    args.update(kwargs)
    with pytest.raises(cls) as info:
        Loader(**args)
    assert isinstance(info.value, BetonClientError)
    assert not isinstance(info.value, grpc.RpcError)
    for w in words:
        assert w in str(info.value)
    with Loader("mixed_fields", batch_size=25, pipelines=INT_ONLY, server=daemon.address) as ok:
        assert [b[0].shape[0] for b in ok] == [25, 25]


def test_malformed_wire_requests_are_invalid_argument(daemon) -> None:
    with grpc.insecure_channel(daemon.address) as ch:
        stub = pb_grpc.BetonServeStub(ch)
        bad = pb.OpenStreamRequest(
            dataset="mixed_fields",
            batch_size=4,
            pipelines=[
                pb.PipelineSpec(name="int", ops=[pb.OpSpec(name="IntDecoder", params_json="[1,")])
            ],
        )
        with pytest.raises(grpc.RpcError) as info:
            stub.OpenStream(bad, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not valid JSON" in info.value.details()
        md = dict(info.value.trailing_metadata())
        assert md["beton-error"] == "SpecError"
        # a Batches call for a stream that does not exist
        call = stub.Batches(iter([pb.ClientMessage(start=pb.Start(stream_id="feed"))]), timeout=10)
        with pytest.raises(grpc.RpcError) as info2:
            list(call)
        assert info2.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "unknown stream" in info2.value.details()
        # reflection and health are served too
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        reply = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="beton_wire.v1.BetonServe"), timeout=5
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        datasets = stub.ListDatasets(pb.ListDatasetsRequest(), timeout=5)
        by_name = {d.name: d for d in datasets.datasets}
        assert by_name["mixed_fields"].num_samples == 50
        assert [f.name for f in by_name["mixed_fields"].fields] == [
            "int",
            "float",
            "array",
            "blob",
            "meta",
        ]


def test_invalid_file_is_refused_with_the_readers_error(short_tmp: Path) -> None:
    bad = short_tmp / "broken.beton"
    bad.write_bytes(b"\x00" * 100)
    d = start_daemon([bad], short_tmp, wait=False)
    rc = d.proc.wait(60)
    assert rc != 0
    assert "broken.beton" in d.log() and "error" in d.log().lower()


def test_two_datasets_with_one_stem_are_an_error(short_tmp: Path, fixtures_dir: Path) -> None:
    (short_tmp / "a").mkdir()
    copy = short_tmp / "a" / "mixed_fields.beton"
    copy.write_bytes((fixtures_dir / "mixed_fields.beton").read_bytes())
    d = start_daemon([fixtures_dir / "mixed_fields.beton", copy], short_tmp, wait=False)
    assert d.proc.wait(60) == 1
    assert "two datasets are named 'mixed_fields'" in d.log()


def test_stats_rpc_reports_streams_and_decoded_samples(daemon) -> None:
    with Loader("mixed_fields", batch_size=10, pipelines=INT_ONLY, server=daemon.address) as ld:
        it = iter(ld)
        next(it)
        st = daemon.stats()
        (mine,) = [s for s in st.streams if s.client_pid == os.getpid()]
        assert mine.dataset == "mixed_fields" and mine.slot_count == 16 and mine.batches_sent >= 1
        for _ in it:
            pass
    after = daemon.stats()
    decoded = {d.name: d.samples_decoded for d in after.datasets}
    assert decoded["mixed_fields"] >= 50
    assert after.workers == 2 and after.compiled_plans >= 1
    assert json.loads(json.dumps({"pid": after.pid}))["pid"] == daemon.pid


def _write_ints(path: Path, start: int, n: int, dtype: type = np.int64) -> None:
    from beton_serve.fields import IntField, NDArrayField
    from beton_serve.writer import DatasetWriter

    class Rows:
        def __len__(self) -> int:
            return n

        def __getitem__(self, i: int):
            return (start + i, np.full((2,), start + i, dtype))

    DatasetWriter(
        path, {"id": IntField(), "arr": NDArrayField(dtype, (2,))}, num_workers=1
    ).from_indexed_dataset(Rows())


def test_dataset_flag_serves_shards_as_one_dataset(daemon_factory, short_tmp: Path) -> None:
    for i, (start, n) in enumerate([(0, 6), (6, 5), (11, 7)]):
        _write_ints(short_tmp / f"train-{i}.beton", start, n)
    d = daemon_factory([], args=["--dataset", f"train={short_tmp}/train-*.beton"])
    assert "dataset name=train samples=18 shards=3" in d.log()
    pipes = {"id": [IntDecoder(), ToTensor()], "arr": None}
    with Loader("train", batch_size=4, drop_last=False, pipelines=pipes, server=d.address) as ld:
        # copies: a batch's buffer is the daemon's again once the next one is asked for
        ids = np.concatenate([b[0].numpy().reshape(-1).copy() for b in ld])
    assert ids.tolist() == list(range(18))
    with Loader(
        "train", batch_size=4, order=OrderOption.RANDOM, seed=5, pipelines=pipes, server=d.address
    ) as ld:
        got = np.concatenate([b[0].numpy().reshape(-1).copy() for b in ld])
    assert len(got) == 16 and len(set(got.tolist())) == 16 and set(got.tolist()) <= set(range(18))
    assert sorted(got.tolist()) != got.tolist()  # shuffled over the whole index space


def test_shards_with_different_schemas_are_refused(short_tmp: Path) -> None:
    _write_ints(short_tmp / "part-0.beton", 0, 3)
    _write_ints(short_tmp / "part-1.beton", 3, 3, dtype=np.float32)
    d = start_daemon([], short_tmp, args=["--dataset", f"x={short_tmp}/part-*.beton"], wait=False)
    assert d.proc.wait(60) == 1
    assert "field 'arr' differs" in d.log() and "part-1.beton" in d.log()
