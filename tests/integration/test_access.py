# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""Access control with a real daemon (DESIGN.md §8): file modes of the socket, its directory and
the segments; path-like dataset names; unregistered ops; malformed and oversized requests.

The bearer token on TCP is tested in ``test_security_served.py``
(``test_token_required_and_refused_over_tcp``)."""

from __future__ import annotations

import stat
from pathlib import Path

import grpc
import pytest
from beton_client import Loader
from beton_serve.fields.decoders import IntDecoder
from beton_wire.v1 import beton_pb2 as pb
from beton_wire.v1 import beton_pb2_grpc as pb_grpc
from helpers.daemon import SHM, DaemonProcess, daemon_factory, short_tmp  # noqa: F401

pytestmark = pytest.mark.slow

INT_ONLY = {"int": [IntDecoder()], "float": None, "array": None, "blob": None, "meta": None}
SERVICE = "/beton_wire.v1.BetonServe/"
_REJECTED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _mode(path: str | Path) -> int:
    return stat.S_IMODE(Path(path).stat().st_mode)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def test_socket_its_directory_and_segments_are_private(
    daemon_factory, short_tmp: Path, fixtures_dir: Path
) -> None:
    sock = short_tmp / "fresh" / "d.sock"  # the daemon creates the directory itself
    d = daemon_factory([fixtures_dir / "mixed_fields.beton"], socket=str(sock))
    assert _mode(sock.parent) == 0o700
    assert _mode(sock) == 0o600
    assert _mode(str(sock) + ".lock") == 0o600
    with Loader("mixed_fields", batch_size=5, pipelines=INT_ONLY, server=d.address) as ld:
        next(iter(ld))
        segs = d.shm_files()  # the rings and the notice socket
        assert any("-ring-" in s for s in segs) and any("-notice-" in s for s in segs)
        for s in segs:
            assert _mode(SHM / s) == 0o600, s


def test_clients_cannot_name_paths_or_unregistered_ops(daemon_factory, fixtures_dir: Path) -> None:
    d = daemon_factory([fixtures_dir / "mixed_fields.beton"])
    with grpc.insecure_channel(d.address) as ch:
        stub = pb_grpc.BetonServeStub(ch)
        for name in (
            str(fixtures_dir / "images_jpg.beton"),
            "../mixed_fields",
            "/etc/passwd",
            "mixed_fields/../../x",
        ):
            req = pb.OpenStreamRequest(dataset=name, batch_size=4)
            with pytest.raises(grpc.RpcError) as info:
                stub.OpenStream(req, timeout=30)
            assert info.value.code() in (
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.NOT_FOUND,
            ), name
            assert "unknown dataset" in info.value.details()
            assert "mixed_fields" in info.value.details()  # it lists what it serves instead
        for op in ("os.system", "builtins.eval", "beton_serve.cli.main", "NoSuchOp"):
            req = pb.OpenStreamRequest(
                dataset="mixed_fields",
                batch_size=4,
                batches_ahead=3,  # required: 0 is refused (issue 11)
                pipelines=[pb.PipelineSpec(name="int", ops=[pb.OpSpec(name=op, params_json="{}")])],
            )
            with pytest.raises(grpc.RpcError) as info:
                stub.OpenStream(req, timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, op
            assert op in info.value.details()
    # Nothing was opened, and the daemon serves on.
    assert [x.name for x in d.stats().datasets] == ["mixed_fields"]
    assert d.stats().streams_opened == 0


def test_malformed_and_huge_requests_are_rejected_without_allocating(
    daemon_factory, fixtures_dir: Path
) -> None:
    d: DaemonProcess = daemon_factory([fixtures_dir / "mixed_fields.beton"])
    with grpc.insecure_channel(d.address) as ch:
        raw_open = ch.unary_unary(SERVICE + "OpenStream")  # bytes in, bytes out
        raw_batches = ch.stream_stream(SERVICE + "Batches")
        stub = pb_grpc.BetonServeStub(ch)
        stub.Stats(pb.StatsRequest(), timeout=10)  # warm up the daemon before measuring
        before = _rss_kib(d.pid)
        garbage = [
            b"\xff" * 64,  # an invalid tag / varint
            b"\x0a" + _varint(1 << 40) + b"mixed",  # field 1 (dataset) declares 1 TiB
            b"\x12" + _varint((1 << 62) - 1),  # field 2 (pipelines) declares 4 EiB, no bytes
            b"\x0a\x05mix",  # truncated
        ]
        for body in garbage:
            with pytest.raises(grpc.RpcError) as info:
                raw_open(body, timeout=10)
            # grpcio's aio server rejects what it cannot parse before our code runs, with UNKNOWN
            # ("Unexpected DecodeError ... Wire format was corrupt").
            assert info.value.code() in _REJECTED, body[:8]
            with pytest.raises(grpc.RpcError) as info:
                list(raw_batches(iter([body]), timeout=10))
            assert info.value.code() in _REJECTED
        # batch_size = 10**12 on the wire (a uint32 field: what arrives is still absurd).
        body = pb.OpenStreamRequest(dataset="mixed_fields").SerializeToString()
        body += b"\x18" + _varint(10**12)  # field 3 (batch_size), varint
        with pytest.raises(grpc.RpcError) as info:
            raw_open(body, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "batch_size" in info.value.details()
        # A message over the receive limit is refused before it is parsed.
        with pytest.raises(grpc.RpcError) as info:
            raw_open(b"\x0a" + _varint(64 << 20) + b"x" * (64 << 20), timeout=60)
        assert info.value.code() in (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.INTERNAL,
        )
        after = _rss_kib(d.pid)
        # Nothing was allocated for the declared sizes (1 TiB, 4 EiB, 10**12 samples).
        assert after - before < 200 * 1024, (before, after)
        assert stub.Stats(pb.StatsRequest(), timeout=10).streams_opened == 0
