# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""Issue 11 §9: absurd requests are INVALID_ARGUMENT (SpecError in the client), allocating nothing.

Each case was seen on an earlier main: a 100k-deep or 5,000-digit JSON parameter came back
INTERNAL (RecursionError, ValueError); ``world_size=2**32-1`` made the daemon try to allocate
32 GiB; 13 M indices cost 1.1 GB of RSS and opened a stream of 3 M batches; a 1 MB dataset name
came back RESOURCE_EXHAUSTED (the message echoed the name); ``indices=[]``, ``batches_ahead=0``,
``world_size=0`` and ``cuda:99`` opened streams; a distributed RANDOM stream with seed 2**64-1
failed at epoch 1 (torch's manual_seed overflowed). Requests are sent raw, as any gRPC client
could, to a real daemon whose RSS and peak RSS (VmHWM) are read from /proc; the client-side
checks are tested against an address where nothing listens, so a request that was sent would
fail with another error.
"""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import numpy as np
import pytest
from beton_client import Loader as ServedLoader
from beton_client.errors import SpecError as ClientSpecError
from beton_serve.errors import SpecError
from beton_serve.fields.decoders import IntDecoder
from beton_serve.loader import Loader as InProcessLoader
from beton_serve.loader import OrderOption
from beton_serve.transforms import ToDevice, ToTensor
from beton_wire.limits import MAX_INDICES, MAX_REQUEST_BYTES, MAX_WIRE_RECORDS
from beton_wire.v1 import beton_pb2 as pb
from beton_wire.v1 import beton_pb2_grpc as pb_grpc
from helpers.daemon import daemon_factory, short_tmp  # noqa: F401
from helpers.requests import MIXED_SKIPPED, int_only_request

pytestmark = pytest.mark.slow

SKIPPED = MIXED_SKIPPED
INT_ONLY = {"int": [IntDecoder()], **dict.fromkeys(SKIPPED)}
#: A TCP address where nothing listens: a client that sent its request fails another way.
NOWHERE = "127.0.0.1:9"
#: Peak RSS growth allowed for refusing a small request.
RSS_SLACK_KIB = 24 << 10


def _status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])  # KiB
    return out


_request = int_only_request


@pytest.fixture
def served(daemon_factory, fixtures_dir: Path):
    """A daemon serving mixed_fields (50 samples), warmed up, and a raw stub to it."""
    d = daemon_factory([fixtures_dir / "mixed_fields.beton"])
    opts = [("grpc.max_send_message_length", 1 << 30)]
    with grpc.insecure_channel(d.address, options=opts) as ch:
        stub = pb_grpc.BetonServeStub(ch)
        with pytest.raises(grpc.RpcError):  # warm the request path up before measuring
            stub.OpenStream(_request(dataset="no_such_dataset"), timeout=30)
        yield d, stub, ch


def _refused(stub, req: pb.OpenStreamRequest | bytes, ch=None) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        if isinstance(req, bytes):
            ch.unary_unary("/beton_wire.v1.BetonServe/OpenStream")(req, timeout=60)
        else:
            stub.OpenStream(req, timeout=60)
    err = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    assert dict(err.trailing_metadata() or ())["beton-error"] == "SpecError"
    return err


CASES = [
    ("deep_json", {"params_json": "[" * 100_000 + "]" * 100_000}, "nested deeper than 32"),
    ("5000_digits", {"params_json": '{"x": ' + "9" * 5000 + "}"}, "5000 digits"),
    ("nan", {"params_json": '{"x": NaN}'}, "numbers must be finite"),
    ("world_2**32-1", {"distributed": True, "world_size": 2**32 - 1}, "world_size 4294967295"),
    ("world_0", {"distributed": True, "world_size": 0}, "world_size 0 is out of range"),
    ("batches_ahead_0", {"batches_ahead": 0}, "batches_ahead 0 is out of range"),
    ("indices_empty", {"indices": []}, "indices=[] selects no samples"),
    ("cuda_99", {"device": "cuda:99"}, "device 'cuda:99' is not a CUDA device of the client"),
    ("long_name", {"client_name": "n" * 100_000}, "client_name 'nnnn"),
]


@pytest.mark.parametrize(("kw", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_absurd_fields_are_invalid_argument_and_allocate_nothing(served, kw, words) -> None:
    d, stub, _ = served
    before = _status(d.pid)
    err = _refused(stub, _request(**kw))
    after = _status(d.pid)
    assert words in err.details(), err.details()
    assert len(err.details()) < 1000
    assert after["VmHWM"] - before["VmHWM"] < RSS_SLACK_KIB, (before, after)
    assert d.stats().streams_opened == 0  # nothing was opened


def test_13m_indices_are_refused_before_they_are_parsed(served) -> None:
    d, stub, ch = served
    body = _request(indices=np.zeros(13_000_000, np.uint64)).SerializeToString()  # 13 MB
    before = _status(d.pid)
    err = _refused(stub, body, ch)
    after = _status(d.pid)
    assert f"more than {MAX_INDICES} indices" in err.details()
    # What the daemon may hold is the request's own bytes (gRPC's receive buffer, the bytes
    # object: measured 1.5x and 2.8x of them); parsing them would add 8 bytes per index (104 MB)
    # and the old path grew RSS by 1.1 GB.
    kib = len(body) >> 10
    assert after["VmRSS"] - before["VmRSS"] < 3 * kib, (before, after)
    assert after["VmHWM"] - before["VmHWM"] < 5 * kib, (before, after)
    assert d.stats().streams_opened == 0


def test_millions_of_empty_list_entries_are_refused_before_they_are_parsed(served) -> None:
    d, stub, ch = served
    # 10 M empty PipelineSpec entries: 20 MB on the wire, gigabytes once parsed.
    body = _request().SerializeToString() + b"\x12\x00" * 10_000_000
    before = _status(d.pid)
    err = _refused(stub, body, ch)
    after = _status(d.pid)
    assert f"more than {MAX_WIRE_RECORDS} fields and list entries" in err.details()
    kib = len(body) >> 10  # parsed: a message of 48+ bytes per entry, 480+ MB
    assert after["VmRSS"] - before["VmRSS"] < 3 * kib, (before, after)
    assert after["VmHWM"] - before["VmHWM"] < 5 * kib, (before, after)


def test_a_1mb_dataset_name_is_invalid_argument_with_a_short_message(served) -> None:
    _, stub, _ = served
    for call in (
        lambda: stub.OpenStream(_request(dataset="x" * (1 << 20)), timeout=30),
        lambda: stub.DescribeDataset(pb.DescribeDatasetRequest(name="x" * (1 << 20)), timeout=30),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call()
        # It used to be RESOURCE_EXHAUSTED: the echoed name overflowed gRPC's 16 KiB trailers.
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "dataset name 'xxxx" in info.value.details()
        assert "(1048576 characters)" in info.value.details()
        assert len(info.value.details()) < 1000
    # an unknown but plausible name is echoed whole, with what the daemon serves instead
    with pytest.raises(grpc.RpcError) as info:
        stub.OpenStream(_request(dataset="imagenet_val"), timeout=30)
    assert "unknown dataset 'imagenet_val'" in info.value.details()
    assert "mixed_fields" in info.value.details()


def test_a_message_larger_than_any_valid_request_is_refused_by_grpc(served) -> None:
    d, _, ch = served
    # A valid request padded with an unknown field (which protobuf would skip) to just over the
    # limit: gRPC refuses it before it is parsed.
    body = _request().SerializeToString()
    pad = MAX_REQUEST_BYTES - len(body)
    body += _varint(100 << 3 | 2) + _varint(pad) + bytes(pad)
    with pytest.raises(grpc.RpcError) as info:
        ch.unary_unary("/beton_wire.v1.BetonServe/OpenStream")(body, timeout=60)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert d.proc.poll() is None


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


@pytest.mark.parametrize(
    ("kwargs", "env", "words"),
    [
        ({"indices": []}, {}, "indices=[] selects no samples"),
        ({"indices": np.zeros(MAX_INDICES + 1, np.int64)}, {}, f"at most {MAX_INDICES}"),
        ({"batches_ahead": 0}, {}, "batches_ahead 0 is out of range"),
        ({"batches_ahead": 65}, {}, "batches_ahead 65 is out of range"),
        ({"batch_size": 1 << 17}, {}, "batch_size 131072 is out of range"),
        ({"num_workers": 100_000}, {}, "num_workers 100000 is out of range"),
        ({"distributed": True}, {"RANK": "0", "WORLD_SIZE": "0"}, "world_size 0"),
        ({"distributed": True}, {"RANK": "0", "WORLD_SIZE": str(2**32 - 1)}, "world_size"),
        ({"fname_or_dataset": "x" * (1 << 20)}, {}, "(1048576 characters)"),
        ({"pipelines": {"int": [ToTensor(), ToDevice("cuda:99")]}}, {}, "cuda:99"),
    ],
)
def test_the_client_refuses_what_the_daemon_would_before_sending(
    monkeypatch, kwargs, env, words
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    args = {"fname_or_dataset": "mixed_fields", "batch_size": 4, "pipelines": INT_ONLY}
    args.update(kwargs)
    # Nothing listens at NOWHERE: a request that went out would fail with ServerUnavailable.
    with pytest.raises(ClientSpecError) as info:
        ServedLoader(**args, server=NOWHERE, spawn=False, reconnect=False)
    assert words in str(info.value), str(info.value)
    assert len(str(info.value)) < 1000


class _DeepParams:
    """A daemon-side op (it has a spec) whose parameters nest 40 levels deep."""

    spec_name = "IntDecoder"

    def spec_params(self) -> dict[str, object]:
        value: object = 1
        for _ in range(40):
            value = [value]
        return {"x": value}


def test_the_client_checks_op_parameters_with_the_daemons_rules() -> None:
    pipes = {"int": [_DeepParams()], **dict.fromkeys(SKIPPED)}
    with pytest.raises(ClientSpecError, match="nested deeper than 32"):
        ServedLoader("mixed_fields", 4, pipelines=pipes, server=NOWHERE, spawn=False)


def _labels(loader) -> list[list[int]]:
    return [np.asarray(b[0]).reshape(-1).tolist() for b in loader]


def test_seed_2_64_minus_1_works_served_and_in_process_alike(
    daemon_factory, fixtures_dir: Path, monkeypatch
) -> None:
    # seed + epoch reaches 2**64 at epoch 1: torch's manual_seed refused it for a distributed
    # RANDOM order (INTERNAL, in process and served); it now wraps at 2**64, as torch's range.
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    path = fixtures_dir / "mixed_fields.beton"
    d = daemon_factory([path])
    labels = np.load(fixtures_dir / "mixed_fields.expected.npz")["int"].reshape(-1).tolist()
    for order in (OrderOption.RANDOM, OrderOption.QUASI_RANDOM, OrderOption.SEQUENTIAL):
        for distributed in (True, False):
            common = {"batch_size": 4, "order": order, "distributed": distributed}
            common["drop_last"] = False
            served = ServedLoader(
                "mixed_fields", seed=2**64 - 1, pipelines=INT_ONLY, server=d.address, **common
            )
            local = InProcessLoader(path, seed=2**64 - 1, pipelines=INT_ONLY, **common)
            other = InProcessLoader(path, seed=5, pipelines=INT_ONLY, **common)
            try:
                for epoch in range(3):
                    got, want = _labels(served), _labels(local)
                    assert got == want, (order, distributed, epoch)
                    ids = local.sample_order(epoch).tolist()
                    assert len(ids) == (17 if distributed else 50)
                    assert [x for b in want for x in b] == [labels[i] for i in ids]
                    if order is not OrderOption.SEQUENTIAL:
                        assert want != _labels(other)  # the seed does choose the order
            finally:
                served.close()


@pytest.mark.parametrize("seed", [-1, 2**64])
def test_seeds_outside_uint64_are_refused_in_process_as_served(fixtures_dir, seed) -> None:
    with pytest.raises(SpecError, match=r"seed must be an int in \[0, 2\*\*64\)"):
        InProcessLoader(fixtures_dir / "mixed_fields.beton", 4, seed=seed, pipelines=INT_ONLY)
    with pytest.raises(ClientSpecError, match=r"seed must be an int in \[0, 2\*\*64\)"):
        ServedLoader("mixed_fields", 4, seed=seed, server=NOWHERE, spawn=False)


def test_empty_indices_are_refused_in_process_as_served(fixtures_dir) -> None:
    with pytest.raises(SpecError, match=r"indices=\[\] selects no samples"):
        InProcessLoader(fixtures_dir / "mixed_fields.beton", 4, indices=[], pipelines=INT_ONLY)


@pytest.mark.parametrize("indices", [[0, -1], [0, 50], [0.5, 1.0]])
def test_negative_out_of_range_or_fractional_indices_are_refused_in_process(
    fixtures_dir, indices
) -> None:
    # -1 used to become 2**64-1 in the uint64 cast before any range check.
    # The front end refuses negative and fractional ids on every backend; the range is known in
    # process (a daemon checks it against its file).
    with pytest.raises(SpecError, match=r"indices must be integer sample ids"):
        InProcessLoader(fixtures_dir / "mixed_fields.beton", 4, indices=indices, pipelines=INT_ONLY)


@pytest.mark.parametrize(
    ("indices", "words"),
    [
        ({3, 1}, "an ordered sequence of sample ids"),  # "not object values" before
        (np.zeros((2, 2), np.int64), "indices must be 1-D"),  # flattened without a word
        ([1.5, 2.0], "got 1.5 (float)"),
    ],
)
def test_unordered_or_2d_indices_are_refused_in_process_as_served(
    fixtures_dir, indices, words
) -> None:
    with pytest.raises(SpecError, match=re.escape(words)):
        InProcessLoader(fixtures_dir / "mixed_fields.beton", 4, indices=indices, pipelines=INT_ONLY)
    with pytest.raises(ClientSpecError, match=re.escape(words)):
        ServedLoader("mixed_fields", 4, indices=indices, server=NOWHERE, spawn=False)


def test_a_custom_field_that_is_not_a_field_is_a_spec_error_on_both_backends(fixtures_dir):
    """``custom_fields={"int": int}`` was a FormatError in process, blaming the (valid) file."""
    words = "custom_fields['int'] must be a Field class"
    with pytest.raises(SpecError, match=re.escape(words)):
        InProcessLoader(
            fixtures_dir / "mixed_fields.beton", 4, custom_fields={"int": int}, pipelines=INT_ONLY
        )
    with pytest.raises(ClientSpecError, match=re.escape(words)):
        ServedLoader("mixed_fields", 4, custom_fields={"int": int}, server=NOWHERE, spawn=False)


def test_mixed_integer_types_and_generators_are_indices(fixtures_dir) -> None:
    """``[np.uint64(1), 2]`` (numpy makes float64 of the mix) was refused as "float64 values"."""
    path = fixtures_dir / "mixed_fields.beton"
    for indices in ([np.uint64(1), 2, np.int32(7)], (i for i in (1, 2, 7))):
        with InProcessLoader(
            path, 4, indices=indices, pipelines=INT_ONLY, order=OrderOption.SEQUENTIAL
        ) as ld:
            assert ld.indices.tolist() == [1, 2, 7]


def _grpc_stream(stub) -> tuple[str, str]:
    """Open a grpc-transport stream; its id and the batch method's path."""
    req = _request(transport="grpc")
    req.capabilities.transports.append("grpc")
    reply = stub.OpenStream(req, timeout=60)
    return reply.stream_id, reply.transport.grpc.method


def _batch_call(ch, method: str, stream_id: str, wants: list[list[tuple[int, int]]]):
    from beton_wire.framing import Compression, OpenRequest, WantRequest

    def requests():
        yield OpenRequest(Compression.parse("none"), payload=stream_id.encode()).to_bytes()
        for items in wants:
            yield WantRequest(tuple(items)).to_bytes()

    return ch.stream_stream(method, request_serializer=None)(requests(), timeout=60)


def test_a_want_flood_ends_the_call_and_the_daemons_memory_stays_flat(
    served, fixtures_dir: Path
) -> None:
    from beton_wire.framing import MAX_WANTS_PER_MESSAGE

    d, stub, ch = served
    sid, method = _grpc_stream(stub)
    before = _status(d.pid)
    # 200 messages of 4,096 WANTs: 819,200 batches asked for, none read. Each used to cost the
    # daemon ~2 KB (1.6 GB in all); the call now ends at MAX_WANTS_IN_FLIGHT.
    flood = [[(e, 0)] * MAX_WANTS_PER_MESSAGE for e in range(200)]
    with pytest.raises(grpc.RpcError) as info:
        for _ in _batch_call(ch, method, sid, flood):
            pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "batches wanted and not yet received" in info.value.details()
    after = _status(d.pid)
    assert after["VmHWM"] - before["VmHWM"] < RSS_SLACK_KIB, (before, after)
    # The daemon serves the next client, the same ints as in process.
    with ServedLoader(
        "mixed_fields", batch_size=4, pipelines=INT_ONLY, server=d.address, transport="grpc"
    ) as loader:
        served = _labels(loader)
    with InProcessLoader(
        str(fixtures_dir / "mixed_fields.beton"), batch_size=4, pipelines=INT_ONLY, num_workers=1
    ) as loader:
        assert served == _labels(loader)


@pytest.mark.parametrize("epoch", [2**32, 2**64 - 1])
def test_a_want_for_an_epoch_past_the_limit_is_invalid_argument(served, epoch: int) -> None:
    _, stub, ch = served
    sid, method = _grpc_stream(stub)
    with pytest.raises(grpc.RpcError) as info:
        for _ in _batch_call(ch, method, sid, [[(epoch, 0)]]):
            pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"epoch {epoch} is outside 0..{2**32 - 1}" in info.value.details()
