"""Per-sample CRC32C checksums of a ``.beton``, kept in a sidecar file next to it.

FFCV's format has no checksum, and a JPEG decoder notices only some corruption: most one-bit
flips in entropy-coded data decode without an error into different pixels. A sidecar written by
``beton-serve checksum FILE`` lets a reader detect them. The ``.beton`` itself is unchanged (it
stays FFCV's format); the sidecar is a separate file, ``FILE.crc32c``.

What is summed
--------------
For sample ``j``, CRC32C (Castagnoli, as in iSCSI/ext4; initial value 0) over the concatenation
of:

1. its metadata record: the ``R`` bytes at ``M + j*R`` (every field's fixed-size value, the
   pointers and the record's alignment padding);
2. each of its allocations, ``file[ptr : ptr + size]``, for every allocation-table entry with
   ``sample_id == j``, in increasing ``ptr`` order (which is field order for FFCV's writer and
   ours: a sample's fields are allocated one after another in one page).

Bytes that belong to no sample (the header, descriptors, page padding, allocations a writer
abandoned) are not summed: the header, descriptors and allocation table are bound by the
sidecar's layout digest instead, and the rest is never read.

Sidecar layout (version 1, little-endian)
-----------------------------------------
::

    offset  size  field
    0       8     magic  b"BETONCRC"
    8       4     version (u32) = 1
    12      4     header_size (u32) = 72
    16      8     num_samples (u64) of the .beton
    24      8     file_size (u64) of the .beton
    32      32    layout digest: SHA-256 of the .beton's bytes [0, M) (header and field
                  descriptors) followed by [A, EOF) (the allocation table)
    64      4     CRC32C of the sample table
    68      4     CRC32C of bytes [0, 68) of this header
    72      4*N   the samples' CRC32C values (u32), in sample-id order

Binding. A sidecar is *stale* when ``num_samples``, ``file_size`` or the layout digest differ
from the file's: the file was rewritten since the sidecar was made. A stale, truncated or
damaged sidecar is refused when it is opened (:class:`FormatError`), never used. The digest
leaves out the metadata table and the data on purpose: a flipped bit there is a corrupt
*sample*, reported with its id when that sample is read. The mtime is not bound either, so a
file copied with its sidecar (``cp`` without ``-p``) still verifies, which is the point of
checking a copy.

CRC32C detects accidental corruption (disk, network, a bad copy); it is not a defence against
someone who can write both files.
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from crc32c import crc32c as _crc32c_ext
from numpy.typing import NDArray

from beton_serve.errors import FormatError
from beton_serve.format._files import NotRegularFile, open_regular

__all__ = [
    "SIDECAR_SUFFIX",
    "ChecksumVerifier",
    "SampleRegions",
    "layout_digest",
    "read_sidecar",
    "sidecar_path",
    "write_sidecar",
]

#: The sidecar of ``data.beton`` is ``data.beton.crc32c``.
SIDECAR_SUFFIX = ".crc32c"
_MAGIC = b"BETONCRC"
_VERSION = 1
_HEADER = struct.Struct("<8sIIQQ32sII")
_HEADER_SIZE = _HEADER.size  # 72
_DIGEST_TAG = b"beton-crc32c-layout-v1\0"


def _crc32c(data: Any, value: int = 0) -> int:
    return int(_crc32c_ext(data, value))


def sidecar_path(path: str | os.PathLike[str]) -> str:
    """The sidecar path of ``path``: ``path + ".crc32c"``."""
    return os.fspath(path) + SIDECAR_SUFFIX


def layout_digest(reader: Any) -> bytes:
    """SHA-256 of the file's header + field descriptors and allocation table (module docstring).

    Args:
        reader: an open :class:`~beton_serve.format.BetonReader`.
    """
    mem = reader.storage_state[0]
    h = hashlib.sha256(_DIGEST_TAG)
    h.update(mem[: reader.metadata_offset])
    h.update(mem[reader.header.alloc_table_ptr : reader.file_size])
    return h.digest()


class SampleRegions:
    """Where each sample's summed bytes are in one file: built once per reader (vectorised).

    Attributes:
        num_samples: N.
        starts: ``int64[N + 1]``; sample ``j``'s allocations are ``ptrs[starts[j]:starts[j+1]]``
            (sizes alike), in increasing ``ptr`` order.
        ptrs, sizes: ``int64[K]`` allocation-table entries sorted by (sample id, ptr).
    """

    def __init__(self, reader: Any) -> None:
        self._reader = reader
        self.num_samples = int(reader.num_samples)
        self._meta = int(reader.metadata_offset)
        self._rec = int(reader.record_size)
        sids, ptrs, sizes = reader.allocations  # sorted by ptr
        order = np.argsort(sids, kind="stable")  # stable: ptr order within a sample
        self.ptrs: NDArray[np.int64] = ptrs[order].astype(np.int64)
        self.sizes: NDArray[np.int64] = sizes[order].astype(np.int64)
        self.starts: NDArray[np.int64] = np.searchsorted(
            sids[order].astype(np.int64), np.arange(self.num_samples + 1), side="left"
        ).astype(np.int64)

    def crc(self, ids: Sequence[int] | NDArray[Any]) -> NDArray[np.uint32]:
        """CRC32C of each sample of ``ids`` (sample ids of this file), as defined above.

        Reads the bytes through the reader's mapping (faulting them in if they are not cached).
        Safe to call from several threads at once; the extension releases the GIL on large
        buffers.
        """
        mem = self._reader.storage_state[0]
        ids_l = np.asarray(ids, dtype=np.int64).tolist()
        out = np.empty(len(ids_l), dtype=np.uint32)
        starts, ptrs, sizes, meta, rec = self.starts, self.ptrs, self.sizes, self._meta, self._rec
        ext = _crc32c_ext
        for i, j in enumerate(ids_l):
            lo = meta + j * rec
            c = ext(mem[lo : lo + rec])
            for k in range(int(starts[j]), int(starts[j + 1])):
                p = int(ptrs[k])
                c = ext(mem[p : p + int(sizes[k])], c)
            out[i] = c
        return out

    def disk_order(self) -> NDArray[np.int64]:
        """Every sample id, sorted by the file offset of its first allocation (samples without
        data first): reading in this order is sequential on disk."""
        first = np.full(self.num_samples, -1, dtype=np.int64)
        has = self.starts[1:] > self.starts[:-1]
        first[has] = self.ptrs[self.starts[:-1][has]]
        return np.argsort(first, kind="stable").astype(np.int64)

    def summed_bytes(self) -> int:
        """Total bytes summed over every sample (records + allocations)."""
        return int(self.num_samples * self._rec + int(self.sizes.sum()))


def _all_crcs(
    regions: SampleRegions, progress: Callable[[int], None] | None, chunk: int = 4096
) -> NDArray[np.uint32]:
    order = regions.disk_order()
    crcs = np.empty(regions.num_samples, dtype=np.uint32)
    for lo in range(0, len(order), chunk):
        ids = order[lo : lo + chunk]
        crcs[ids] = regions.crc(ids)
        if progress is not None:
            progress(len(ids))
    return crcs


def write_sidecar(
    reader: Any,
    path: str | os.PathLike[str] | None = None,
    *,
    progress: Callable[[int], None] | None = None,
) -> str:
    """Compute every sample's CRC32C and write the sidecar atomically (temp file + rename).

    Args:
        reader: an open, validated :class:`~beton_serve.format.BetonReader`.
        path: where to write (default :func:`sidecar_path` of the reader's file).
        progress: called with the number of samples done after each chunk.

    Returns:
        The sidecar's path. An existing sidecar is replaced only once the new one is complete
        and flushed; a crash leaves the old one (or none), never a partial one.

    Raises:
        FormatError: the sidecar cannot be written (the message names the directory).
    """
    dest = os.fspath(path) if path is not None else sidecar_path(reader.path)
    regions = SampleRegions(reader)
    table = _all_crcs(regions, progress).astype("<u4").tobytes()
    head = _HEADER.pack(
        _MAGIC,
        _VERSION,
        _HEADER_SIZE,
        int(reader.num_samples),
        int(reader.file_size),
        layout_digest(reader),
        _crc32c(table),
        0,
    )
    head = head[:-4] + struct.pack("<I", _crc32c(head[:-4]))
    directory = os.path.dirname(os.path.abspath(dest))
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(dest) + ".", dir=directory)
        with os.fdopen(fd, "wb") as f:
            f.write(head)
            f.write(table)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
        tmp = None
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as exc:
        raise FormatError(dest, None, f"cannot write the checksum sidecar: {exc}") from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return dest


def read_sidecar(reader: Any, path: str | os.PathLike[str] | None = None) -> NDArray[np.uint32]:
    """Read and check the sidecar of ``reader``'s file; returns ``uint32[N]`` per-sample CRCs.

    Raises:
        FormatError: the sidecar is missing (the message says how to create it), truncated,
            damaged (its own CRCs fail), of another version, or stale (written for another
            version of the file: size, sample count or layout digest differ).
    """
    side = os.fspath(path) if path is not None else sidecar_path(reader.path)
    make = f"run `beton-serve checksum {reader.path}` to create it"
    try:
        with open_regular(side) as f:
            data = f.read()
    except NotRegularFile as exc:
        raise FormatError(side, None, f"the checksum sidecar is {exc}; {make}") from None
    except FileNotFoundError:
        raise FormatError(
            side, None, f"no checksum sidecar for {reader.path} (verification needs one); {make}"
        ) from None
    except OSError as exc:
        raise FormatError(side, None, f"cannot read the checksum sidecar: {exc}") from None
    if len(data) < _HEADER_SIZE or data[:8] != _MAGIC:
        raise FormatError(side, 0, "not a beton-serve checksum sidecar (bad magic or too short)")
    _magic, version, hsize, n, size, digest, table_crc, head_crc = _HEADER.unpack_from(data)
    if version != _VERSION or hsize != _HEADER_SIZE:
        raise FormatError(
            side, 8, f"sidecar version {version} (header {hsize} bytes) is not supported; {make}"
        )
    if _crc32c(data[: _HEADER_SIZE - 4]) != head_crc:
        raise FormatError(side, 68, f"the sidecar's header is damaged; {make}")
    stale = []
    if n != reader.num_samples:
        stale.append(f"it has {n} samples, the file {reader.num_samples}")
    if size != reader.file_size:
        stale.append(f"it was made for a file of {size} bytes, the file has {reader.file_size}")
    if not stale and digest != layout_digest(reader):
        stale.append("the file's header, fields or allocation table changed")
    if stale:
        raise FormatError(
            side,
            None,
            f"stale checksum sidecar (written for another version of {reader.path}): "
            f"{'; '.join(stale)}; {make} again",
        )
    table = data[_HEADER_SIZE:]
    if len(table) != 4 * n:
        raise FormatError(
            side, _HEADER_SIZE, f"the sidecar holds {len(table)} table bytes, expected {4 * n}"
        )
    if _crc32c(table) != table_crc:
        raise FormatError(side, _HEADER_SIZE, f"the sidecar's sample table is damaged; {make}")
    return np.frombuffer(table, dtype="<u4").astype(np.uint32)


class ChecksumVerifier:
    """Checks samples against the sidecars of one file or of shards seen as one index space.

    Args:
        readers: open readers, in index order (one for a plain file; a dataset's shards, whose
            sample ids are numbered consecutively in that order).

    Raises:
        FormatError: a sidecar is missing, stale or damaged (:func:`read_sidecar`).

    Thread-safe: :meth:`check` runs on engine workers, several at once.
    """

    def __init__(self, readers: Sequence[Any]) -> None:
        self.readers = list(readers)
        self._expected = [read_sidecar(r) for r in self.readers]
        self._regions = [SampleRegions(r) for r in self.readers]
        counts = [int(r.num_samples) for r in self.readers]
        self._first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.num_samples = int(self._first[-1])

    def _split(
        self, ids: Sequence[int] | NDArray[Any]
    ) -> list[tuple[int, NDArray[np.int64], NDArray[np.int64]]]:
        """``[(shard, positions in ids, local ids)]`` for the shards that ``ids`` touch."""
        g = np.asarray(ids, dtype=np.int64)
        if len(self.readers) == 1:
            return [(0, np.arange(len(g)), g)]
        shard = np.searchsorted(self._first, g, side="right") - 1
        out = []
        for s in np.unique(shard).tolist():
            pos = np.flatnonzero(shard == s)
            out.append((int(s), pos, g[pos] - self._first[s]))
        return out

    def mismatches(self, ids: Sequence[int] | NDArray[Any] | None = None) -> NDArray[np.int64]:
        """The ids among ``ids`` (default: every sample) whose bytes do not match, ascending."""
        bad: list[NDArray[np.int64]] = []
        if ids is None:
            for s, regions in enumerate(self._regions):
                got = _all_crcs(regions, None)
                bad.append(np.flatnonzero(got != self._expected[s]) + self._first[s])
        else:
            for s, pos, local in self._split(ids):
                got = self._regions[s].crc(local)
                bad.append(np.asarray(ids, dtype=np.int64)[pos[got != self._expected[s][local]]])
        return np.unique(np.concatenate(bad)) if bad else np.empty(0, np.int64)

    def check(self, ids: Sequence[int] | NDArray[Any]) -> None:
        """Raise for the first sample of ``ids`` whose bytes do not match its sidecar CRC.

        Raises:
            FormatError: naming the sample id, the file, the offset of its metadata record and
                both CRCs. (The engine turns it into a bad sample: see ``pipeline._plan``.)
        """
        for s, pos, local in self._split(ids):
            got = self._regions[s].crc(local)
            want = self._expected[s][local]
            wrong = np.flatnonzero(got != want)
            if wrong.size:
                w = int(wrong[0])
                reader, j = self.readers[s], int(local[w])
                raise FormatError(
                    reader.path,
                    int(reader.metadata_offset) + j * int(reader.record_size),
                    f"sample {int(np.asarray(ids)[pos[w]])}: its bytes have CRC32C "
                    f"{int(got[w]):#010x}, the checksum sidecar says {int(want[w]):#010x}; the "
                    "sample is corrupt (it changed after `beton-serve checksum` ran)",
                )
