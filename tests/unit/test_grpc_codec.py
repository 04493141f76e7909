"""Framing of batches for the gRPC transport (beton_wire.framing) and the client buffer pool."""

from __future__ import annotations

import gc
import queue
import struct
import threading
import weakref
from collections.abc import Iterator

import numpy as np
import pytest
from beton_client._transport.grpc_codec import BufferPool, _read_call
from beton_wire import framing
from beton_wire.framing import (
    ALIGN,
    ArraySpec,
    BatchDecoder,
    BatchEncoder,
    Codec,
    Compression,
    FramingError,
    OpenRequest,
    WantRequest,
    parse_header,
    parse_request,
    payload_layout,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

COMPRESSIONS = ["none", "lz4", "zstd:1", "zstd:3"]


def _image_like(n: int = 4, hw: int = 40) -> np.ndarray:
    """Compressible uint8 images: flat 8x8 blocks, with noise in one quarter of each image."""
    rng = np.random.default_rng(1)
    yy, xx = np.mgrid[0:hw, 0:hw] // 8
    base = (yy * 37 + xx * 11)[None, :, :, None] + np.arange(3)[None, None, None, :] * 40
    img = np.repeat(base, n, axis=0) % 256
    q = hw // 2
    img[:, :q, :q] += rng.integers(0, 4, size=(n, q, q, 3))
    return (img % 256).astype(np.uint8)


def _batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "image": _image_like(),
        "label": np.arange(4, dtype=np.int64),
        "mask": rng.random((4, 3)) < 0.5,
        "half": rng.random((4, 5)).astype(np.float16),
        "big_endian": np.arange(7, dtype=">i4"),
        "cplx": (rng.random(3) + 1j).astype(np.complex64),
        "empty": np.zeros((0, 5), np.float32),
    }


def _decode_all(dec: BatchDecoder, msgs: list[bytes]) -> framing.DecodedBatch:
    out = [dec.feed(m) for m in msgs]
    assert all(o is None for o in out[:-1])
    assert out[-1] is not None
    assert not dec.in_batch
    return out[-1]


@pytest.mark.parametrize("comp", COMPRESSIONS)
@pytest.mark.parametrize("chunk", [framing.MIN_CHUNK_BYTES, 5000, 1 << 20])
def test_roundtrip_every_compression_and_chunk_size(comp: str, chunk: int) -> None:
    arrays = _batch()
    enc = BatchEncoder(chunk_bytes=chunk, compression=Compression.parse(comp))
    msgs = list(enc.encode(3, 17, arrays))
    _, payload = payload_layout([framing._spec_of(k, v) for k, v in arrays.items()])
    assert len(msgs) == 1 + -(-payload // chunk)
    got = _decode_all(BatchDecoder(), msgs)
    assert (got.epoch, got.batch_index) == (3, 17)
    assert list(got.arrays) == list(arrays)
    for name, arr in arrays.items():
        assert got.arrays[name].dtype == arr.dtype
        assert got.arrays[name].shape == arr.shape
        np.testing.assert_array_equal(got.arrays[name], arr)


def test_compression_shrinks_image_like_data() -> None:
    arrays = {"image": _image_like(8, 64)}
    sizes = {}
    for comp in COMPRESSIONS:
        enc = BatchEncoder(chunk_bytes=8192, compression=Compression.parse(comp))
        sizes[comp] = sum(len(m) for m in list(enc.encode(0, 0, arrays))[1:])
    assert sizes["none"] == arrays["image"].nbytes
    assert sizes["lz4"] < 0.9 * sizes["none"]
    assert sizes["zstd:3"] < sizes["lz4"]


def test_layout_is_aligned_and_padding_is_zero() -> None:
    arrays = {"a": np.arange(3, dtype=np.uint8), "b": np.arange(5, dtype=np.float64)}
    got = _decode_all(BatchDecoder(), list(BatchEncoder().encode(0, 0, arrays)))
    offsets, payload = payload_layout([framing._spec_of(k, v) for k, v in arrays.items()])
    assert offsets == (0, ALIGN)
    assert payload == ALIGN + 40
    assert not got.buffer[3:ALIGN].any()
    np.testing.assert_array_equal(got.arrays["b"], arrays["b"])


def test_non_contiguous_arrays_are_sent_in_c_order() -> None:
    base = np.arange(60, dtype=np.int16).reshape(6, 10)
    arrays = {"t": base.T, "s": base[::2, 1::3]}
    got = _decode_all(BatchDecoder(), list(BatchEncoder().encode(0, 1, arrays)))
    np.testing.assert_array_equal(got.arrays["t"], base.T)
    np.testing.assert_array_equal(got.arrays["s"], base[::2, 1::3])
    assert got.arrays["t"].flags.c_contiguous


def test_batch_without_payload_is_complete_after_the_header() -> None:
    msgs = list(BatchEncoder().encode(1, 2, {}))
    assert len(msgs) == 1
    got = BatchDecoder().feed(msgs[0])
    assert got is not None and got.arrays == {} and got.batch_index == 2


def test_decodes_into_the_supplied_buffer_without_reallocating() -> None:
    arrays = {"image": _image_like(2, 32), "label": np.arange(2, dtype=np.int32)}
    backing = np.full(1 << 16, 0xAB, np.uint8)
    calls: list[int] = []

    def allocate(n: int) -> np.ndarray:
        calls.append(n)
        return backing

    dec = BatchDecoder(allocate=allocate)
    for b in range(3):
        got = _decode_all(dec, list(BatchEncoder(chunk_bytes=4096).encode(0, b, arrays)))
        assert np.shares_memory(got.arrays["image"], backing)
        assert np.shares_memory(got.arrays["label"], backing)
        np.testing.assert_array_equal(got.arrays["image"], arrays["image"])
    _, payload = payload_layout([framing._spec_of(k, v) for k, v in arrays.items()])
    assert calls == [payload] * 3


def test_allocate_must_return_a_big_enough_uint8_buffer() -> None:
    msgs = list(BatchEncoder().encode(0, 0, {"x": np.zeros(100, np.uint8)}))
    with pytest.raises(ValueError, match="allocate"):
        BatchDecoder(allocate=lambda n: np.empty(n - 1, np.uint8)).feed(msgs[0])


def _header(
    *,
    magic: bytes = framing.BATCH_MAGIC,
    version: int = framing.VERSION,
    codec: int = 0,
    payload: int | None = None,
    chunk: int = framing.DEFAULT_CHUNK_BYTES,
    n_chunks: int | None = None,
    arrays: list[tuple[bytes, bytes, tuple[int, ...], int]] | None = None,
    trailing: bytes = b"",
) -> bytes:
    """Build a header by hand, bypassing the encoder's checks."""
    arrays = arrays if arrays is not None else [(b"x", b"|u1", (10,), 0)]
    if payload is None:
        payload = 10
    if n_chunks is None:
        n_chunks = -(-payload // chunk)
    parts = [
        struct.pack(
            "<4sBBHQQQII", magic, version, codec, len(arrays), 0, 0, payload, chunk, n_chunks
        )
    ]
    for name, dt, shape, off in arrays:
        parts.append(struct.pack("<BBB", len(name), len(dt), len(shape)) + name + dt)
        parts.append(struct.pack(f"<{len(shape)}Q", *shape) + struct.pack("<Q", off))
    return b"".join(parts) + trailing


def test_hand_built_header_matches_the_encoder() -> None:
    enc_msg = next(iter(BatchEncoder().encode(0, 0, {"x": np.zeros(10, np.uint8)})))
    assert enc_msg == _header()
    assert parse_header(enc_msg).arrays == (ArraySpec("x", "|u1", (10,)),)


@pytest.mark.parametrize(
    ("msg", "match"),
    [
        (_header(magic=b"XXXX"), "magic"),
        (_header(version=9), "version"),
        (_header(codec=7), "unknown codec"),
        (_header()[:20], "at least"),
        (_header()[:-3], "truncated"),
        (_header(trailing=b"\0"), "unexpected bytes"),
        (_header(n_chunks=5), "chunks declared"),
        (_header(chunk=100), "chunk size"),
        (_header(payload=11), "layout mismatch"),
        (_header(arrays=[(b"x", b"|u1", (10,), 64)], payload=74), "layout mismatch"),
        (_header(arrays=[(b"x", b"|O8", (1,), 0)], payload=8), "dtype"),
        (_header(arrays=[(b"x", b"<U4", (1,), 0)], payload=16), "dtype"),
        (_header(arrays=[(b"\xff", b"|u1", (10,), 0)]), "valid text"),
        (_header(arrays=[(b"", b"|u1", (10,), 0)]), "empty name"),
        (_header(arrays=[(b"x", b"|u1", (1,) * 9, 0)]), "dimensions"),
        (
            _header(arrays=[(b"x", b"|u1", (5,), 0), (b"x", b"|u1", (5,), 64)], payload=69),
            "twice",
        ),
    ],
)
def test_malformed_headers_are_rejected(msg: bytes, match: str) -> None:
    with pytest.raises(FramingError, match=match):
        BatchDecoder().feed(msg)


def test_huge_declared_sizes_are_rejected_before_allocating() -> None:
    def allocate(n: int) -> np.ndarray:
        raise AssertionError(f"allocated {n} bytes for a hostile header")

    dec = BatchDecoder(max_batch_bytes=1 << 20, allocate=allocate)
    with pytest.raises(FramingError, match="exceeds the limit"):
        dec.feed(_header(payload=1 << 40, arrays=[(b"x", b"|u1", (1 << 40,), 0)]))
    # an array far bigger than the (small, in-limit) declared payload
    huge = (1 << 32, 1 << 32, 1 << 32)
    with pytest.raises(FramingError, match="exceeds the batch limit"):
        dec.feed(_header(payload=10, arrays=[(b"x", b"<f8", huge, 0)]))


def test_codec_must_be_the_negotiated_one() -> None:
    msgs = list(BatchEncoder(compression=Compression.parse("lz4")).encode(0, 0, _batch()))
    with pytest.raises(FramingError, match="not negotiated"):
        BatchDecoder(allowed_codecs={Codec.NONE}).feed(msgs[0])


def _two_chunk_batch(comp: str) -> list[bytes]:
    arrays = {"x": _image_like(1, 64)}
    return list(
        BatchEncoder(chunk_bytes=8192, compression=Compression.parse(comp)).encode(0, 0, arrays)
    )


def test_raw_chunk_of_the_wrong_length_is_rejected() -> None:
    msgs = _two_chunk_batch("none")
    dec = BatchDecoder()
    dec.feed(msgs[0])
    with pytest.raises(FramingError, match="expected 8192"):
        dec.feed(msgs[1][:-1])


@pytest.mark.parametrize("comp", ["lz4", "zstd:1"])
def test_corrupt_compressed_chunks_are_rejected(comp: str) -> None:
    msgs = _two_chunk_batch(comp)
    dec = BatchDecoder()
    dec.feed(msgs[0])
    with pytest.raises(FramingError):
        dec.feed(msgs[1][: len(msgs[1]) // 2])
    dec = BatchDecoder()
    dec.feed(msgs[0])
    with pytest.raises(FramingError, match="compressed chunk"):
        dec.feed(bytes(9000 + 8192 // 64 + 1024))


def test_zstd_chunk_declaring_another_size_is_rejected_before_decompressing() -> None:
    import zstandard

    msgs = _two_chunk_batch("zstd:1")
    dec = BatchDecoder()
    dec.feed(msgs[0])
    bomb = zstandard.ZstdCompressor().compress(bytes(1 << 24))
    assert len(bomb) < 8192
    with pytest.raises(FramingError, match="declares"):
        dec.feed(bomb)


def test_lz4_chunk_expanding_past_its_slot_is_rejected() -> None:
    import lz4.block

    msgs = _two_chunk_batch("lz4")
    dec = BatchDecoder()
    dec.feed(msgs[0])
    with pytest.raises(FramingError, match="decompress"):
        dec.feed(lz4.block.compress(bytes(1 << 20), store_size=False))


@pytest.mark.parametrize(
    ("arrays", "match"),
    [
        ({"o": np.array([object()])}, "dtype"),
        ({"s": np.array(["ab"])}, "dtype"),
        ({"x" * 256: np.zeros(1)}, "1..255"),
        ({"": np.zeros(1)}, "1..255"),
        ({"deep": np.zeros((1,) * 9)}, "dimensions"),
    ],
)
def test_encoder_refuses_what_the_wire_cannot_carry(arrays: dict, match: str) -> None:
    with pytest.raises(FramingError, match=match):
        list(BatchEncoder().encode(0, 0, arrays))


def test_encoder_refuses_duplicate_names_and_bad_positions() -> None:
    a = np.zeros(2)
    with pytest.raises(FramingError, match="twice"):
        list(BatchEncoder().encode(0, 0, [("a", a), ("a", a)]))
    with pytest.raises(FramingError, match="epoch"):
        list(BatchEncoder().encode(-1, 0, {"a": a}))
    with pytest.raises(FramingError, match="chunk size"):
        BatchEncoder(chunk_bytes=10)


def test_compression_parse() -> None:
    assert Compression.parse("none") == Compression()
    assert Compression.parse("LZ4").codec is Codec.LZ4
    assert Compression.parse("zstd") == Compression(Codec.ZSTD, 1)
    assert Compression.parse("zstd:3") == Compression(Codec.ZSTD, 3)
    assert str(Compression.parse("zstd:3")) == "zstd:3"
    for bad in ["gzip", "zstd:x", "zstd:40"]:
        with pytest.raises(ValueError):
            Compression.parse(bad)


def test_requests_roundtrip() -> None:
    req = OpenRequest(Compression.parse("zstd:3"), 2 << 20, b"stream-7")
    assert parse_request(req.to_bytes()) == req
    want = WantRequest(((0, 5), (1, 0), (2**64 - 1, 3)))
    assert parse_request(want.to_bytes()) == want


@pytest.mark.parametrize(
    ("msg", "match"),
    [
        (b"BTR", "too short"),
        (b"XXXX" + bytes(8), "magic"),
        (struct.pack("<4sBxxxI", b"BTR1", 9, 0), "unknown request"),
        (struct.pack("<4sBxxxI", b"BTR1", 2, 3) + bytes(16), "WANT declares"),
        (struct.pack("<4sBxxxI", b"BTR1", 2, 0), "WANT declares"),
        (struct.pack("<4sBxxxI", b"BTR1", 1, 5) + struct.pack("<BbxxI", 0, 0, 1 << 20), "OPEN"),
        (struct.pack("<4sBxxxI", b"BTR1", 1, 0) + struct.pack("<BbxxI", 5, 0, 1 << 20), "invalid"),
        (struct.pack("<4sBxxxI", b"BTR1", 1, 0) + struct.pack("<BbxxI", 2, 99, 1 << 20), "level"),
        (struct.pack("<4sBxxxI", b"BTR1", 1, 0) + struct.pack("<BbxxI", 0, 0, 1 << 30), "chunk"),
    ],
)
def test_malformed_requests_are_rejected(msg: bytes, match: str) -> None:
    with pytest.raises(FramingError, match=match):
        parse_request(msg)


def test_open_payload_is_capped() -> None:
    with pytest.raises(FramingError, match="payload"):
        OpenRequest(payload=bytes(framing.MAX_OPEN_PAYLOAD + 1)).to_bytes()


def test_buffer_pool_recycles_and_bounds_buffers() -> None:
    pool = BufferPool(2)
    a = pool.acquire(100)
    b = pool.acquire(50)
    with pytest.raises(RuntimeError, match="in use"):
        pool.acquire(10)
    pool.give_back(a)
    assert pool.acquire(80) is a
    pool.give_back(b)
    c = pool.acquire(200)  # b is too small: replaced, never more than 2 buffers
    assert c.size == 200 and c is not b
    with pytest.raises(RuntimeError):
        pool.acquire(1)


@pytest.mark.timeout(30)
def test_buffer_pool_give_back_never_waits_for_the_pools_lock() -> None:
    """A batch's ``release`` runs from finalizers too (an epoch dropped without ``close``), and
    the garbage collector may run one inside :meth:`BufferPool.acquire`'s locked section on the
    same thread. The lock is not reentrant, so ``give_back`` must not take it."""
    pool = BufferPool(2)
    a = pool.acquire(100)
    b = pool.acquire(100)
    returned = threading.Event()

    def collector_inside_acquire() -> None:
        with pool._lock:  # as if the collector ran the finalizer here
            pool.give_back(a)
            returned.set()

    t = threading.Thread(target=collector_inside_acquire, daemon=True)
    t.start()
    assert returned.wait(5), "give_back blocked on the pool's own lock"
    t.join(5)
    pool.give_back(a)  # twice: still one free buffer
    assert pool.acquire(50) is a  # taken in by the next acquire
    with pytest.raises(RuntimeError, match="in use"):
        pool.acquire(10)  # still bounded: a and b are both out
    pool.give_back(b)
    assert pool.acquire(100) is b


# ---------------------------------------------------------------------------------------------
# property tests

_DTYPES = ["|u1", "|b1", "<i2", "<f2", "<u4", "<f4", "<i8", "<f8", "<c8", ">i4"]
_array = st.sampled_from(_DTYPES).flatmap(
    lambda dt: hnp.arrays(np.dtype(dt), hnp.array_shapes(min_dims=0, max_dims=4, max_side=7))
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arrays=st.lists(_array, max_size=5),
    chunk=st.integers(framing.MIN_CHUNK_BYTES, framing.MIN_CHUNK_BYTES * 3),
    comp=st.sampled_from(COMPRESSIONS),
    epoch=st.integers(0, 2**64 - 1),
)
def test_roundtrip_property(arrays: list, chunk: int, comp: str, epoch: int) -> None:
    named = [(f"a{i}", a) for i, a in enumerate(arrays)]
    enc = BatchEncoder(chunk_bytes=chunk, compression=Compression.parse(comp))
    got = _decode_all(BatchDecoder(), list(enc.encode(epoch, 3, named)))
    assert got.epoch == epoch
    for name, a in named:
        assert got.arrays[name].dtype == a.dtype and got.arrays[name].shape == a.shape
        np.testing.assert_array_equal(got.arrays[name], a)


_VALID_HEADER = next(iter(BatchEncoder().encode(1, 2, _batch())))


@settings(max_examples=300, deadline=None)
@given(
    edits=st.lists(
        st.tuples(st.integers(0, len(_VALID_HEADER) - 1), st.integers(0, 255)), max_size=6
    ),
    cut=st.integers(0, len(_VALID_HEADER)),
)
def test_corrupted_headers_fail_cleanly_or_stay_consistent(
    edits: list[tuple[int, int]], cut: int
) -> None:
    msg = bytearray(_VALID_HEADER)
    for pos, val in edits:
        msg[pos] = val
    data = bytes(msg[:cut]) if cut < len(msg) else bytes(msg)
    limit = 1 << 20
    allocated: list[int] = []

    def allocate(n: int) -> np.ndarray:
        allocated.append(n)
        return np.empty(n, np.uint8)

    try:
        BatchDecoder(max_batch_bytes=limit, allocate=allocate).feed(data)
    except FramingError:
        assert allocated == []
        return
    # accepted: then it is self-consistent and within the limit
    hdr = parse_header(data, max_batch_bytes=limit)
    assert allocated == [hdr.payload_bytes] and hdr.payload_bytes <= limit
    assert payload_layout(hdr.arrays) == (hdr.offsets, hdr.payload_bytes)


class _BuggyCall:
    """A call whose iteration yields one message, then fails with a bug (not an RpcError)."""

    def __iter__(self) -> Iterator[bytes]:
        yield b"m"
        raise ZeroDivisionError("a bug while reading")


def test_a_bug_while_reading_a_call_keeps_its_traceback_and_no_cycle() -> None:
    """The reader thread hands a bug to the receiving thread with its traceback. That traceback
    keeps the reader's frame, so the frame must not keep the inbox the error waits in: the
    inbox, the error and the call are then freed by reference counting when dropped."""
    inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
    call = _BuggyCall()
    ref = weakref.ref(call)
    gc.collect()
    gc.disable()
    try:
        _read_call(call, inbox, threading.Event())
        assert inbox.get_nowait() == b"m"
        err = inbox.get_nowait()
        assert isinstance(err, ZeroDivisionError) and err.__traceback__ is not None
        inbox.put(err)  # as it waits for the receiving thread
        del err, call, inbox
        assert ref() is None, "the call outlived the inbox that held its error"
    finally:
        gc.enable()
