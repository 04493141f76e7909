"""Framing of batches on the raw (pass-through) gRPC batch stream, shared by daemon and client.

The remote transport does not put tensors in protobuf messages: a 38.5 MB ``bytes`` field costs a
full serialize and parse on each side (measured ~3x slower than raw bytes, see
``benchmarks/RESULTS.md``). Instead the batch method is registered with pass-through serializers,
so every gRPC message is a plain ``bytes`` object framed by this module.

Server to client, one batch::

    header message   BATCH_MAGIC, version, codec, epoch, batch index, payload size, chunk size,
                     chunk count, then one descriptor per array (name, dtype, shape, offset)
    chunk message 0  payload[0 : chunk_bytes]            (compressed on its own when codec != NONE)
    chunk message 1  payload[chunk_bytes : 2*chunk_bytes]
    ...              exactly ``num_chunks`` of them, then the next batch's header

The *payload* is the batch's arrays laid out back to back, C order, each starting at an offset
aligned to :data:`ALIGN` bytes, zero padding in between. The layout is canonical: the decoder
recomputes it from the shapes and dtypes and rejects a header whose offsets or payload size differ,
so a header cannot make the receiver write outside the arrays it describes. Chunks are cut from the
raw payload; with compression every chunk is an independent lz4 block or zstd frame, so the
receiver decompresses each one straight into its place in the destination buffer.

Client to server (requests on the same bidirectional call)::

    OPEN   (first message only) requested codec and level, chunk size, opaque payload for the
           daemon (e.g. the stream id returned by the control plane)
    WANT   a list of (epoch, batch index): each entry is one credit for that batch. The server
           answers WANTs in the order it received them, and never produces a batch nobody asked
           for, so memory is bounded by the client's credits on both ends (plus HTTP/2's window).
           A server ends a call that has more than ``limits.MAX_WANTS_IN_FLIGHT`` entries asked
           for and not yet sent (``INVALID_ARGUMENT``).

Everything is little-endian. Nothing received is unpickled or evaluated: dtypes are matched against
a fixed pattern, every size is checked against ``max_batch_bytes`` *before* anything is allocated,
and every violation raises :class:`FramingError` (a ``ValueError``) that says what was wrong.

API::

    Codec.NONE | Codec.LZ4 | Codec.ZSTD;  Compression(codec, level)  Compression.parse("zstd:3")
    BatchEncoder(chunk_bytes=DEFAULT_CHUNK_BYTES, compression=Compression())
        .encode(epoch, batch_index, arrays) -> Iterator[bytes]     # header, then chunks
    BatchDecoder(max_batch_bytes, allowed_codecs=ALL_CODECS, allocate=None)
        .feed(message: bytes) -> DecodedBatch | None              # a batch when complete
    payload_layout(specs) -> (offsets, payload_bytes)
    OpenRequest(...).to_bytes() / parse_request(message) -> OpenRequest | WantRequest
    WantRequest(items).to_bytes()

Threading: encoders and decoders hold per-stream state and are used by one thread at a time.
"""

from __future__ import annotations

import enum
import math
import re
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "ALIGN",
    "ALL_CODECS",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_MAX_BATCH_BYTES",
    "MAX_CHUNK_BYTES",
    "MIN_CHUNK_BYTES",
    "ArraySpec",
    "BatchDecoder",
    "BatchEncoder",
    "BatchHeader",
    "Codec",
    "Compression",
    "DecodedBatch",
    "FramingError",
    "OpenRequest",
    "WantRequest",
    "parse_header",
    "parse_request",
    "payload_layout",
]

ALIGN = 64
"""Every array in the payload starts at a multiple of this many bytes."""
MIN_CHUNK_BYTES = 4 * 1024
MAX_CHUNK_BYTES = 64 * 1024 * 1024
DEFAULT_CHUNK_BYTES = 2 * 1024 * 1024
"""Chosen from benchmarks/RESULTS.md ("gRPC transport"): 1 and 2 MiB chunks were the fastest on
loopback (2 MiB slightly ahead in both runs); 256 KiB lost ~35 % and 4-8 MiB 25-50 %."""
DEFAULT_MAX_BATCH_BYTES = 1 << 31
MAX_ARRAYS = 256
MAX_NDIM = 8
MAX_HEADER_BYTES = 64 * 1024
MAX_OPEN_PAYLOAD = 64 * 1024
MAX_WANTS_PER_MESSAGE = 4096

BATCH_MAGIC = b"BTB1"
REQUEST_MAGIC = b"BTR1"
VERSION = 1

_FIXED = struct.Struct(
    "<4sBBHQQQII"
)  # magic, version, codec, n_arrays, epoch, batch, payload, chunk, n_chunks
_ARRAY = struct.Struct("<BBB")  # name_len, dtype_len, ndim
_U64 = struct.Struct("<Q")
_REQ = struct.Struct("<4sBxxxI")  # magic, kind, count or payload length
_OPEN = struct.Struct("<BbxxI")  # codec, level, chunk_bytes
_WANT = struct.Struct("<QQ")
_REQ_OPEN = 1
_REQ_WANT = 2
_U64_MAX = (1 << 64) - 1

# Only plain numeric and bool dtypes cross the wire, written as numpy's canonical ``dtype.str``.
_DTYPE_RE = re.compile(r"\A(\|b1|\|[iu]1|[<>][iuf](2|4|8)|[<>]c(8|16))\Z")


class FramingError(ValueError):
    """A framed message is malformed, inconsistent, or over a declared limit.

    Raised by both sides. The daemon answers it with ``INVALID_ARGUMENT``; the client translates it
    into its own transport error. The message says which field was wrong and what was expected.
    """


class Codec(enum.IntEnum):
    """Per-stream compression of payload chunks."""

    NONE = 0
    LZ4 = 1
    ZSTD = 2


ALL_CODECS = frozenset(Codec)


@dataclass(frozen=True, slots=True)
class Compression:
    """A codec and its level (zstd: 1..19, default 1; ignored for lz4 and none)."""

    codec: Codec = Codec.NONE
    level: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "codec", Codec(self.codec))
        if self.codec is Codec.ZSTD and not 1 <= self.level <= 19:
            raise ValueError(f"zstd level must be in 1..19, got {self.level}")
        if self.codec is not Codec.ZSTD and self.level != 0:
            object.__setattr__(self, "level", 0)

    @classmethod
    def parse(cls, text: str) -> Compression:
        """Parse ``"none"``, ``"lz4"``, ``"zstd"`` (level 1) or ``"zstd:3"``."""
        name, _, level = text.strip().lower().partition(":")
        if name == "none":
            return cls(Codec.NONE)
        if name == "lz4":
            return cls(Codec.LZ4)
        if name == "zstd":
            try:
                lvl = int(level) if level else 1
            except ValueError:
                raise ValueError(f"zstd level must be an integer, got {level!r}") from None
            return cls(Codec.ZSTD, lvl)
        raise ValueError(f"unknown compression {text!r}; use none, lz4, zstd or zstd:LEVEL")

    def __str__(self) -> str:
        return f"zstd:{self.level}" if self.codec is Codec.ZSTD else self.codec.name.lower()


@dataclass(frozen=True, slots=True)
class ArraySpec:
    """One array of a batch: its name, numpy dtype string (``dtype.str``) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True, slots=True)
class BatchHeader:
    """The parsed header of one batch; ``offsets[i]`` is where ``arrays[i]`` starts in the payload."""

    codec: Codec
    epoch: int
    batch_index: int
    payload_bytes: int
    chunk_bytes: int
    num_chunks: int
    arrays: tuple[ArraySpec, ...]
    offsets: tuple[int, ...]


@dataclass(slots=True)
class DecodedBatch:
    """A received batch.

    Attributes:
        epoch, batch_index: the batch's position.
        arrays: name -> array, views into ``buffer`` (C-contiguous, in header order).
        buffer: the 1-D uint8 destination the payload was written into; it came from the
            decoder's ``allocate`` callback and belongs to whoever supplied it.
    """

    epoch: int
    batch_index: int
    arrays: dict[str, NDArray[Any]]
    buffer: NDArray[np.uint8]
    release: Callable[[], None] | None = field(default=None, repr=False)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def payload_layout(specs: Sequence[ArraySpec]) -> tuple[tuple[int, ...], int]:
    """The canonical layout: (offset of each array, total payload bytes)."""
    offsets = []
    end = 0
    for spec in specs:
        start = _align(end)
        offsets.append(start)
        end = start + spec.nbytes
    return tuple(offsets), end


def _num_chunks(payload: int, chunk: int) -> int:
    return (payload + chunk - 1) // chunk


def _check_chunk_bytes(chunk_bytes: int) -> None:
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise FramingError(
            f"chunk size {chunk_bytes} is outside [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}]"
        )


# ---------------------------------------------------------------------------------------------
# Encoding (daemon side)


class BatchEncoder:
    """Turns batches into framed messages for one stream.

    Args:
        chunk_bytes: raw bytes per chunk message, in [MIN_CHUNK_BYTES, MAX_CHUNK_BYTES].
        compression: applied to every chunk on its own.

    ``encode`` copies each chunk once out of the caller's arrays (gRPC only sends ``bytes``), so
    the arrays may be reused as soon as the iterator is exhausted, not before.
    """

    def __init__(
        self, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, compression: Compression | None = None
    ) -> None:
        _check_chunk_bytes(chunk_bytes)
        self.chunk_bytes = chunk_bytes
        self.compression = compression or Compression()
        self._compress: Callable[[Any], bytes] | None = _make_compressor(self.compression)

    def header(
        self, epoch: int, batch_index: int, specs: Sequence[ArraySpec]
    ) -> tuple[bytes, tuple[int, ...], int]:
        """The header message for these arrays, their offsets, and the payload size."""
        if not (0 <= epoch <= _U64_MAX and 0 <= batch_index <= _U64_MAX):
            raise FramingError(f"epoch {epoch} and batch index {batch_index} must be in [0, 2**64)")
        if len(specs) > MAX_ARRAYS:
            raise FramingError(f"{len(specs)} arrays in one batch; at most {MAX_ARRAYS}")
        offsets, payload = payload_layout(specs)
        n_chunks = _num_chunks(payload, self.chunk_bytes)
        parts = [
            _FIXED.pack(
                BATCH_MAGIC,
                VERSION,
                int(self.compression.codec),
                len(specs),
                epoch,
                batch_index,
                payload,
                self.chunk_bytes,
                n_chunks,
            )
        ]
        for spec, off in zip(specs, offsets, strict=True):
            name = spec.name.encode("utf-8")
            dt = spec.dtype.encode("ascii")
            parts.append(_ARRAY.pack(len(name), len(dt), len(spec.shape)))
            parts.append(name)
            parts.append(dt)
            parts.append(struct.pack(f"<{len(spec.shape)}Q", *spec.shape))
            parts.append(_U64.pack(off))
        msg = b"".join(parts)
        if len(msg) > MAX_HEADER_BYTES:
            raise FramingError(f"header of {len(msg)} bytes exceeds {MAX_HEADER_BYTES}")
        return msg, offsets, payload

    def encode(
        self,
        epoch: int,
        batch_index: int,
        arrays: Mapping[str, NDArray[Any]] | Sequence[tuple[str, NDArray[Any]]],
    ) -> Iterator[bytes]:
        """Yield the header message, then every chunk message of one batch.

        Args:
            arrays: name -> numeric array, in the order the client will see them. A
                non-contiguous array is copied once to C order.

        Raises:
            FramingError: a name, dtype, shape or count the wire cannot carry.
        """
        items = list(arrays.items()) if isinstance(arrays, Mapping) else list(arrays)
        views: list[memoryview] = []
        specs: list[ArraySpec] = []
        seen: set[str] = set()
        for name, arr in items:
            spec = _spec_of(name, arr)
            if name in seen:
                raise FramingError(f"array name {name!r} appears twice")
            seen.add(name)
            specs.append(spec)
            views.append(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)
        head, offsets, payload = self.header(epoch, batch_index, specs)
        yield head
        yield from self._chunks(views, offsets, payload)

    def _chunks(
        self, views: list[memoryview], offsets: tuple[int, ...], payload: int
    ) -> Iterator[bytes]:
        chunk = self.chunk_bytes
        compress = self._compress
        i = 0  # index of the first array that may overlap the current chunk
        for lo in range(0, payload, chunk):
            hi = min(lo + chunk, payload)
            pieces: list[Any] = []
            pos = lo
            while pos < hi:
                while i < len(views) and offsets[i] + len(views[i]) <= pos:
                    i += 1
                start = offsets[i] if i < len(views) else payload
                if pos < start:  # alignment padding before array i
                    n = min(start, hi) - pos
                    pieces.append(bytes(n))
                    pos += n
                    continue
                end = min(offsets[i] + len(views[i]), hi)
                pieces.append(views[i][pos - offsets[i] : end - offsets[i]])
                pos = end
            if compress is None:
                yield bytes(pieces[0]) if len(pieces) == 1 else b"".join(pieces)
            else:
                yield compress(pieces[0] if len(pieces) == 1 else b"".join(pieces))


def _spec_of(name: str, arr: NDArray[Any]) -> ArraySpec:
    if not isinstance(arr, np.ndarray):
        raise FramingError(f"array {name!r} is a {type(arr).__name__}, not a numpy array")
    encoded = name.encode("utf-8")
    if not 0 < len(encoded) <= 255:
        raise FramingError(f"array name {name!r} must be 1..255 bytes of UTF-8")
    dt = arr.dtype.str
    if not _DTYPE_RE.match(dt):
        raise FramingError(f"array {name!r} has dtype {arr.dtype}; only bool and numeric dtypes")
    if arr.ndim > MAX_NDIM:
        raise FramingError(f"array {name!r} has {arr.ndim} dimensions; at most {MAX_NDIM}")
    return ArraySpec(name, dt, tuple(int(s) for s in arr.shape))


def _make_compressor(c: Compression) -> Callable[[Any], bytes] | None:
    if c.codec is Codec.NONE:
        return None
    if c.codec is Codec.LZ4:
        import lz4.block

        def lz4_compress(data: Any) -> bytes:
            return lz4.block.compress(data, store_size=False)

        return lz4_compress
    import zstandard

    cctx = zstandard.ZstdCompressor(level=c.level, write_content_size=True)
    return cctx.compress


# ---------------------------------------------------------------------------------------------
# Decoding (client side)


def _take(msg: bytes, pos: int, n: int, what: str) -> tuple[bytes, int]:
    if pos + n > len(msg):
        raise FramingError(f"header truncated while reading {what} ({len(msg)} bytes)")
    return msg[pos : pos + n], pos + n


def parse_header(
    msg: bytes,
    *,
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
    allowed_codecs: Iterable[Codec] = ALL_CODECS,
) -> BatchHeader:
    """Parse and fully validate a batch header message; allocates nothing proportional to sizes.

    Raises:
        FramingError: bad magic or version, unknown or disallowed codec, malformed descriptor,
            a payload over ``max_batch_bytes``, a layout that is not the canonical one, a chunk
            count that does not match, or trailing bytes.
    """
    if len(msg) > MAX_HEADER_BYTES:
        raise FramingError(f"header of {len(msg)} bytes exceeds {MAX_HEADER_BYTES}")
    if len(msg) < _FIXED.size:
        raise FramingError(
            f"expected a batch header of at least {_FIXED.size} bytes, got {len(msg)}"
        )
    magic, version, codec, n_arrays, epoch, batch, payload, chunk, n_chunks = _FIXED.unpack_from(
        msg
    )
    if magic != BATCH_MAGIC:
        raise FramingError(f"expected a batch header (magic {BATCH_MAGIC!r}), got {magic!r}")
    if version != VERSION:
        raise FramingError(f"batch header version {version}; this side speaks {VERSION}")
    try:
        codec_e = Codec(codec)
    except ValueError:
        raise FramingError(f"unknown codec id {codec}") from None
    if codec_e not in frozenset(allowed_codecs):
        raise FramingError(f"codec {codec_e.name} was not negotiated for this stream")
    if payload > max_batch_bytes:
        raise FramingError(f"batch of {payload} bytes exceeds the limit of {max_batch_bytes}")
    _check_chunk_bytes(chunk)
    if n_chunks != _num_chunks(payload, chunk):
        raise FramingError(f"{n_chunks} chunks declared for {payload} bytes in chunks of {chunk}")
    if n_arrays > MAX_ARRAYS:
        raise FramingError(f"{n_arrays} arrays declared; at most {MAX_ARRAYS}")
    pos = _FIXED.size
    specs: list[ArraySpec] = []
    offsets: list[int] = []
    names: set[str] = set()
    for k in range(n_arrays):
        raw, pos = _take(msg, pos, _ARRAY.size, f"array {k}")
        name_len, dt_len, ndim = _ARRAY.unpack(raw)
        if name_len == 0 or ndim > MAX_NDIM:
            raise FramingError(f"array {k}: empty name or {ndim} > {MAX_NDIM} dimensions")
        raw_name, pos = _take(msg, pos, name_len, f"array {k} name")
        raw_dt, pos = _take(msg, pos, dt_len, f"array {k} dtype")
        raw_shape, pos = _take(msg, pos, 8 * ndim, f"array {k} shape")
        raw_off, pos = _take(msg, pos, 8, f"array {k} offset")
        try:
            name = raw_name.decode("utf-8")
            dt = raw_dt.decode("ascii")
        except UnicodeDecodeError:
            raise FramingError(f"array {k}: name or dtype is not valid text") from None
        if name in names:
            raise FramingError(f"array name {name!r} appears twice")
        names.add(name)
        if not _DTYPE_RE.match(dt):
            raise FramingError(f"array {name!r}: dtype {dt!r} is not an allowed numeric dtype")
        shape = struct.unpack(f"<{ndim}Q", raw_shape)
        nbytes = np.dtype(dt).itemsize
        for s in shape:  # python ints: no overflow; bail out as soon as it is too big
            nbytes *= s
            if nbytes > max_batch_bytes:
                raise FramingError(f"array {name!r} of shape {shape} exceeds the batch limit")
        specs.append(ArraySpec(name, dt, tuple(shape)))
        offsets.append(_U64.unpack(raw_off)[0])
    if pos != len(msg):
        raise FramingError(f"{len(msg) - pos} unexpected bytes after the array descriptors")
    want_offsets, want_payload = payload_layout(specs)
    if tuple(offsets) != want_offsets or payload != want_payload:
        raise FramingError(
            f"layout mismatch: offsets {offsets} / payload {payload}, expected "
            f"{list(want_offsets)} / {want_payload} for these shapes and dtypes"
        )
    return BatchHeader(codec_e, epoch, batch, payload, chunk, n_chunks, tuple(specs), want_offsets)


class BatchDecoder:
    """Reassembles framed messages into batches, writing each chunk once into its destination.

    Args:
        max_batch_bytes: a header declaring a larger payload is rejected before any allocation.
        allowed_codecs: codecs negotiated for the stream; others are rejected.
        allocate: ``allocate(nbytes) -> 1-D writable uint8 array`` of at least ``nbytes``
            (for example from a buffer pool bounded by the stream's credits). Called once per
            batch, from the thread that calls :meth:`feed`. Defaults to ``np.empty``.

    After a :class:`FramingError` the decoder is in an undefined state: close the stream.
    """

    def __init__(
        self,
        *,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
        allowed_codecs: Iterable[Codec] = ALL_CODECS,
        allocate: Callable[[int], NDArray[np.uint8]] | None = None,
    ) -> None:
        self.max_batch_bytes = max_batch_bytes
        self.allowed_codecs = frozenset(allowed_codecs)
        self._allocate = allocate or (lambda n: np.empty(n, np.uint8))
        self._header: BatchHeader | None = None
        self._buf: NDArray[np.uint8] | None = None
        self._next_chunk = 0
        self._lz4: Callable[..., bytes] | None = None
        self._zstd: Any = None

    @property
    def in_batch(self) -> bool:
        """True between a header and its last chunk."""
        return self._header is not None

    def feed(self, message: bytes) -> DecodedBatch | None:
        """Consume one message; return the batch when its last chunk arrived, else ``None``."""
        if self._header is None:
            hdr = parse_header(
                message, max_batch_bytes=self.max_batch_bytes, allowed_codecs=self.allowed_codecs
            )
            buf = self._allocate(hdr.payload_bytes)
            if buf.dtype != np.uint8 or buf.ndim != 1 or buf.size < hdr.payload_bytes:
                raise ValueError("allocate() must return a 1-D uint8 array of at least nbytes")
            self._header, self._buf, self._next_chunk = hdr, buf[: hdr.payload_bytes], 0
            if hdr.num_chunks == 0:
                return self._finish()
            return None
        hdr, cur = self._header, self._buf
        if cur is None:  # pragma: no cover - set together with _header
            raise FramingError("decoder state lost")
        buf = cur
        k = self._next_chunk
        lo = k * hdr.chunk_bytes
        hi = min(lo + hdr.chunk_bytes, hdr.payload_bytes)
        self._write_chunk(hdr.codec, message, buf[lo:hi], k)
        self._next_chunk = k + 1
        if self._next_chunk == hdr.num_chunks:
            return self._finish()
        return None

    def _write_chunk(self, codec: Codec, msg: bytes, dest: NDArray[np.uint8], k: int) -> None:
        n = dest.size
        if codec is Codec.NONE:
            if len(msg) != n:
                raise FramingError(f"chunk {k} has {len(msg)} bytes, expected {n}")
            dest.data[:] = msg
            return
        # A compressed chunk is never much larger than its raw size (lz4 and zstd both bound the
        # expansion of incompressible data to well under 1 %); a bigger one is hostile.
        if len(msg) > n + n // 64 + 1024:
            raise FramingError(f"compressed chunk {k} of {len(msg)} bytes for {n} raw bytes")
        try:
            if codec is Codec.LZ4:
                if self._lz4 is None:
                    import lz4.block

                    self._lz4 = lz4.block.decompress
                out = self._lz4(msg, uncompressed_size=n)
            else:
                import zstandard

                if self._zstd is None:
                    self._zstd = zstandard.ZstdDecompressor()
                declared = zstandard.frame_content_size(msg)
                if declared != n:
                    raise FramingError(f"zstd chunk {k} declares {declared} bytes, expected {n}")
                out = self._zstd.decompress(msg, max_output_size=n)
        except FramingError:
            raise
        except Exception as exc:  # lz4.block.LZ4BlockError, zstandard.ZstdError
            raise FramingError(f"chunk {k} does not decompress: {exc}") from None
        if len(out) != n:
            raise FramingError(f"chunk {k} decompressed to {len(out)} bytes, expected {n}")
        dest.data[:] = out

    def _finish(self) -> DecodedBatch:
        hdr, buf = self._header, self._buf
        self._header, self._buf = None, None
        if hdr is None or buf is None:  # pragma: no cover
            raise FramingError("decoder state lost")
        arrays: dict[str, NDArray[Any]] = {}
        for spec, off in zip(hdr.arrays, hdr.offsets, strict=True):
            arrays[spec.name] = (
                buf[off : off + spec.nbytes].view(np.dtype(spec.dtype)).reshape(spec.shape)
            )
        return DecodedBatch(hdr.epoch, hdr.batch_index, arrays, buf)


# ---------------------------------------------------------------------------------------------
# Requests (client to server)


@dataclass(frozen=True, slots=True)
class OpenRequest:
    """The first message of a batch call: what the client wants on this stream.

    Attributes:
        compression: codec for every chunk of this stream.
        chunk_bytes: raw bytes per chunk message.
        payload: opaque bytes for the daemon (at most 64 KiB), e.g. a stream id.
    """

    compression: Compression = Compression()
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    payload: bytes = b""

    def to_bytes(self) -> bytes:
        if len(self.payload) > MAX_OPEN_PAYLOAD:
            raise FramingError(
                f"open payload of {len(self.payload)} bytes; at most {MAX_OPEN_PAYLOAD}"
            )
        _check_chunk_bytes(self.chunk_bytes)
        return (
            _REQ.pack(REQUEST_MAGIC, _REQ_OPEN, len(self.payload))
            + _OPEN.pack(int(self.compression.codec), self.compression.level, self.chunk_bytes)
            + self.payload
        )


@dataclass(frozen=True, slots=True)
class WantRequest:
    """Credits for specific batches: the server answers them in this order."""

    items: tuple[tuple[int, int], ...]

    def to_bytes(self) -> bytes:
        if not 0 < len(self.items) <= MAX_WANTS_PER_MESSAGE:
            raise FramingError(f"a WANT carries 1..{MAX_WANTS_PER_MESSAGE} batches")
        return _REQ.pack(REQUEST_MAGIC, _REQ_WANT, len(self.items)) + b"".join(
            _WANT.pack(e, b) for e, b in self.items
        )


def parse_request(msg: bytes) -> OpenRequest | WantRequest:
    """Parse a client request message.

    Raises:
        FramingError: wrong magic, unknown kind, bad sizes or values.
    """
    if len(msg) < _REQ.size:
        raise FramingError(f"request of {len(msg)} bytes is too short")
    magic, kind, count = _REQ.unpack_from(msg)
    if magic != REQUEST_MAGIC:
        raise FramingError(f"expected a request (magic {REQUEST_MAGIC!r}), got {magic!r}")
    body = msg[_REQ.size :]
    if kind == _REQ_OPEN:
        if count > MAX_OPEN_PAYLOAD or len(body) != _OPEN.size + count:
            raise FramingError(
                f"OPEN declares {count} payload bytes, carries {len(body) - _OPEN.size}"
            )
        codec, level, chunk = _OPEN.unpack_from(body)
        _check_chunk_bytes(chunk)
        try:
            comp = Compression(Codec(codec), level)
        except ValueError as exc:
            raise FramingError(f"OPEN asks for an invalid compression: {exc}") from None
        return OpenRequest(comp, chunk, bytes(body[_OPEN.size :]))
    if kind == _REQ_WANT:
        if not 0 < count <= MAX_WANTS_PER_MESSAGE or len(body) != count * _WANT.size:
            raise FramingError(f"WANT declares {count} entries in {len(body)} bytes")
        return WantRequest(tuple(_WANT.iter_unpack(body)))
    raise FramingError(f"unknown request kind {kind}")
