"""``DatasetWriter``: write a ``.beton`` that FFCV 1.0.2 reads (mirrors ``ffcv.writer``).

How a file is produced (ffcv-format.md §1.8 and §1.10):

1. The output goes to ``.<fname>.<pid>.<random>.tmp`` in the same directory: header (with
   ``alloc_table_ptr = 0``), then the field descriptors.
2. Worker threads (``beton-writer-N``) load samples (``dataset[i]``) and run each field's
   ``prepare`` (conversion, resize, JPEG encode: OpenCV releases the GIL there). Chunks of
   ``chunksize`` samples are submitted in write order, with a bounded number in flight.
3. The calling thread packs the prepared samples strictly in write order, exactly like one FFCV
   worker: greedy byte-granular packing into pages; if a sample's allocation does not fit, a new
   page is started and, when the sample already had allocations on the old page, they are
   abandoned and the whole sample is re-encoded on the new page (so a sample never spans pages).
   Every page is written in full (zero tail); the gap between the metadata and the first page is
   zero.
4. The metadata table, then the allocation table (last, one entry per allocation), then the header
   with ``alloc_table_ptr``; the file is fsync'd and atomically renamed to ``fname``.

Because packing is sequential, the file's bytes do not depend on ``num_workers``: it is laid out
as FFCV lays it out with ``num_workers=1``. With ``seed`` set, random choices (``proportion``
mode, ``shuffle_indices``) are drawn from generators seeded with ``(seed, index[, field])``, so
the content is identical for any ``num_workers`` too. Without a seed, FFCV's global
``np.random`` is used.

Failure: any exception while loading, preparing or encoding sample ``k`` raises
:class:`~beton_serve.errors.WriterError` naming ``k`` (the write position) and its dataset index;
the workers are stopped and joined, the temporary file is removed, ``fname`` is untouched. The
writer never hangs on a failing sample (FFCV does).

Reading the dataset: FFCV's workers are processes, each with its own copy of the dataset, and
each encodes a sample before it loads the next. Here the workers are threads sharing one dataset
object, so by default they call ``dataset[i]`` one at a time (under a lock) and copy what it
returns (:func:`_snapshot`: arrays, tensors, byte buffers, lists and dicts) before the next call:
a dataset that fills and returns one reused buffer, or keeps scratch state, or reads through one
file handle, is written exactly as FFCV writes it. The loading is then serial and the preparing
(resize, JPEG encode) parallel. ``concurrent_reads=True`` lets the workers call ``dataset[i]`` at
once, for datasets whose ``__getitem__`` is thread-safe (``beton-serve convert``'s are); the
snapshot still protects against buffers reused across calls of one thread.

Beyond FFCV, a sample must be a tuple or list with at least one element per field (extra trailing
elements are ignored, as in FFCV); field names must be 1-16 ASCII characters; zero-size
allocations are never made (an empty ``BytesField`` value takes 1 byte).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import operator
import os
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
from beton_wire.limits import usable_cpus, workers_out_of_range
from numpy.typing import NDArray

from beton_serve.errors import WriterError
from beton_serve.fields import type_id_of
from beton_serve.format import (
    ALLOC_ENTRY_DTYPE,
    ARGS_SIZE,
    FIELD_DESC_DTYPE,
    FORMAT_VERSION,
    HEADER_DTYPE,
    MAX_NAME_BYTES,
    MIN_WRITE_PAGE_SIZE,
    align_up,
    metadata_offset,
    record_dtype,
)

__all__ = ["DatasetWriter"]

log = logging.getLogger("beton_serve.writer")

_DEFAULT_PAGE_SIZE = 1 << 23
#: Serial reads that took at least this share of the write's time get a hint (``concurrent_reads``).
_READ_HINT_SHARE = 0.5


def _snapshot(value: Any) -> Any:
    """``value`` with no memory shared with the dataset: a copy of an array, a tensor, a byte
    buffer, a list, a tuple or a dict (deep); other values as they are (immutable scalars and
    strings, or objects the writer cannot copy generically). The dataset may reuse what it
    returned as soon as its next ``__getitem__`` runs."""
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, (list, tuple, dict)):
        return copy.deepcopy(value)
    clone = getattr(value, "clone", None)  # a torch tensor (a copy of its storage)
    if callable(clone) and hasattr(value, "detach"):
        return value.detach().clone()
    return value


def _sweep_stale_tmp(directory: str, stem: str) -> None:
    """Remove this user's temporary files of earlier writes of the same output whose process is
    gone (``.{stem}.{pid}.{8 hex}.tmp``: a writer killed by SIGKILL, or by a signal it did not
    handle, left one the size of the dataset). Best effort: nothing else is touched."""
    prefix = f".{stem}."
    try:
        names = os.listdir(directory or ".")
    except OSError:
        return
    uid = os.geteuid()
    for name in names:
        if not (name.startswith(prefix) and name.endswith(".tmp")):
            continue
        parts = name[len(prefix) : -len(".tmp")].split(".")
        if len(parts) != 2 or not parts[0].isdigit() or len(parts[1]) != 8:
            continue
        pid = int(parts[0])
        if pid == os.getpid():
            continue  # another write of this process, maybe running
        from beton_serve.transport.shm import pid_alive

        if pid_alive(pid):
            continue  # alive (or the pid was reused): leave it
        path = os.path.join(directory, name)
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if st.st_uid == uid and not os.path.islink(path):
                os.unlink(path)
                log.info("removed %s, left by a write that did not finish (pid %d)", path, pid)


def _as_blob(binary: Any, name: str) -> NDArray[np.uint8]:
    raw = binary.tobytes() if hasattr(binary, "tobytes") else bytes(binary)
    if len(raw) != ARGS_SIZE:
        raise WriterError(f"field {name!r}: to_binary() returned {len(raw)} bytes, expected 1024")
    return np.frombuffer(raw, dtype=np.uint8)


def _output_target(fname: str) -> str:
    """The path the file is written to: ``fname``, or the file a symbolic link ``fname`` names
    (written through the link, as FFCV's ``open(fname, 'wb')`` does, not replacing it)."""
    path = os.path.abspath(fname)
    return os.path.realpath(path) if os.path.islink(path) else path


def _check_output(fname: str) -> None:
    """Refuse an output path that cannot be written, before any sample is read or encoded.

    Raises:
        WriterError: ``fname`` is a directory, or its directory is missing or not writable.
    """
    target = _output_target(fname)
    directory = os.path.dirname(target)
    if os.path.isdir(target):
        raise WriterError(f"cannot write {fname}: it is a directory")
    if not os.path.isdir(directory):
        raise WriterError(f"cannot write {fname}: the directory {directory} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise WriterError(f"cannot write {fname}: no permission to create files in {directory}")


@contextlib.contextmanager
def _output_errors(fname: str) -> Iterator[None]:
    """Turn an ``OSError`` on the output file into a :class:`WriterError` naming it."""
    try:
        yield
    except OSError as exc:
        raise WriterError(f"cannot write {fname}: {exc.strerror or exc}") from exc


class _Spill(MemoryError):
    """A sample's allocation did not fit: it must be re-encoded on the fresh page."""


class _Packer:
    """Sequential page packer (one FFCV worker's allocator) writing pages to ``f`` in order."""

    def __init__(self, f: Any, data_start: int, page_size: int) -> None:
        self.f = f
        self.data_start = data_start
        self.page_size = page_size
        self.page = np.zeros(page_size, dtype=np.uint8)
        self.page_no = -1
        self.used = 0
        self.current = -1
        self.entries: list[tuple[int, int, int]] = []

    def malloc(self, size: int) -> tuple[int, NDArray[np.uint8]]:
        size = int(size)
        if size > self.page_size:
            raise WriterError(
                f"an allocation of {size} bytes exceeds the page size {self.page_size}; "
                "raise page_size",
                self.current,
            )
        if self.page_no < 0 or size > self.page_size - self.used:
            self.flush()
            self.page_no += 1
            self.used = 0
            self.page[:] = 0
            if self.entries and self.entries[-1][0] == self.current:
                while self.entries and self.entries[-1][0] == self.current:
                    self.entries.pop()
                raise _Spill
        ptr = self.data_start + self.page_no * self.page_size + self.used
        self.entries.append((self.current, ptr, size))
        view = self.page[self.used : self.used + size]
        self.used += size
        return ptr, view

    def flush(self) -> None:
        if self.page_no < 0:
            return
        if self.page_no == 0:
            here = self.f.tell()
            if here < self.data_start:
                self.f.write(bytes(self.data_start - here))
        self.f.write(self.page.data)


class DatasetWriter:
    """Write an indexed dataset to a ``.beton`` (FFCV's API and file layout).

    Args:
        fname: output path; written atomically (temporary file + rename).
        fields: field name -> field instance, in file order (the sample tuple's order).
        page_size: power of two, ``2 MiB <= page_size < 4 GiB`` (FFCV's limits).
        num_workers: worker threads that load and prepare samples; ``< 1`` means all usable
            CPUs. At most :data:`~beton_wire.limits.MAX_WORKERS` (the writer keeps
            ``2 * num_workers + 1`` samples in flight).
        seed: if set, random write choices are derived from ``(seed, index)`` and the output is
            identical for any ``num_workers``.
        progress: show a tqdm progress bar; default: only when stderr is a terminal.
        concurrent_reads: let the worker threads call ``dataset[i]`` at the same time. Only
            for a dataset whose ``__getitem__`` is thread-safe (no scratch state, no shared
            file handle). The default calls it one at a time, as FFCV's one-dataset-per-process
            workers do (module docstring); preparing and encoding are parallel either way.

    Raises:
        WriterError: invalid fields (names must be 1-16 ASCII characters), page size or
            ``num_workers``.
    """

    #: FFCV's lower page-size limit (2 MiB). Tests lower it in a subclass to write tiny files,
    #: which beton-serve reads (from 4 KiB) but FFCV's writer would not produce.
    _MIN_PAGE_SIZE: int = MIN_WRITE_PAGE_SIZE

    def __init__(
        self,
        fname: str | os.PathLike[str],
        fields: Mapping[str, Any],
        page_size: int = _DEFAULT_PAGE_SIZE,
        num_workers: int = -1,
        *,
        seed: int | None = None,
        progress: bool | None = None,
        concurrent_reads: bool = False,
    ) -> None:
        if not isinstance(fields, Mapping) or not fields:
            raise WriterError("fields must be a non-empty mapping of name -> field")
        for name, field in fields.items():
            if not isinstance(name, str) or not name:
                raise WriterError(f"field names must be non-empty strings, got {name!r}")
            raw = name.encode("ascii", errors="replace")
            if not name.isascii() or any(b < 0x20 or b >= 0x7F for b in raw):
                raise WriterError(f"field name {name!r} must be printable ASCII")
            if len(raw) > MAX_NAME_BYTES:
                raise WriterError(
                    f"field name {name!r} is {len(raw)} characters; the format stores 16, and "
                    "FFCV would truncate it silently: use a name of at most 16 characters"
                )
            for attr in ("metadata_type", "to_binary", "encode"):
                if not hasattr(field, attr):
                    raise WriterError(f"field {name!r} ({type(field).__name__}) has no {attr}")
        page_size = int(page_size)
        if page_size & (page_size - 1) or not self._MIN_PAGE_SIZE <= page_size < 1 << 32:
            raise WriterError(
                f"page_size must be a power of two with {self._MIN_PAGE_SIZE} <= page_size "
                f"< 4 GiB (FFCV's limits), got {page_size}"
            )
        if message := workers_out_of_range(num_workers, "all usable CPUs"):
            raise WriterError(message)
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0
        ):
            # numpy's generators take no negative seed: every sample then failed, blaming a field
            raise WriterError(f"seed must be None or an int >= 0, got {seed!r}")
        self.fname = os.fspath(fname)
        self.fields = dict(fields)
        self.page_size = page_size
        workers = operator.index(num_workers)
        self.num_workers = usable_cpus() if workers < 1 else workers
        self.seed = None if seed is None else int(seed)
        self.progress = sys.stderr.isatty() if progress is None else bool(progress)
        self.concurrent_reads = bool(concurrent_reads)
        #: Serialises ``dataset[i]`` and its snapshot unless ``concurrent_reads``.
        self._read_lock: threading.Lock | None = None
        #: Seconds spent in ``dataset[i]`` under that lock during the current write.
        self._read_s = 0.0

    # -- public API -------------------------------------------------------------------------
    def from_indexed_dataset(
        self,
        dataset: Any,
        indices: Sequence[int] | NDArray[np.integer] | None = None,
        chunksize: int = 100,
        shuffle_indices: bool = False,
    ) -> None:
        """Write ``dataset[indices[k]]`` at position ``k`` for every ``k``.

        Args:
            dataset: supports ``len()`` and ``__getitem__`` returning a tuple/list in field order.
            indices: source indices (default ``range(len(dataset))``).
            chunksize: samples per work item.
            shuffle_indices: shuffle ``indices`` first (in place for an ndarray, as FFCV does);
                with ``seed``, from ``np.random.default_rng(seed)``.

        Raises:
            WriterError: with the failing sample's index; the output file is not created.
        """
        if indices is None:
            idx: np.ndarray = np.arange(len(dataset), dtype=np.int64)
        else:
            idx = indices if isinstance(indices, np.ndarray) else np.asarray(indices)
            if idx.ndim != 1 or (idx.size and idx.dtype.kind not in "iu"):
                raise WriterError(f"indices must be a 1-D sequence of ints, got {idx.dtype}")
            if idx.size and idx.dtype.kind == "u" and int(idx.max()) > np.iinfo(np.int64).max:
                # the int64 cast below would wrap it to a negative index: dataset[-1]
                raise WriterError(f"index {int(idx.max())} is out of range for the dataset")
        if shuffle_indices:
            if self.seed is None:
                np.random.shuffle(idx)
            else:
                np.random.default_rng(self.seed).shuffle(idx)
        if idx.size == 0:
            raise WriterError("the dataset (or indices) is empty: a .beton needs >= 1 sample")
        _check_output(self.fname)
        if chunksize < 1:
            raise WriterError(f"chunksize must be >= 1, got {chunksize}")
        self._write(dataset, np.asarray(idx, dtype=np.int64), int(chunksize))

    # -- implementation ---------------------------------------------------------------------
    def _prepare_chunk(
        self, dataset: Any, dests: NDArray[np.int64], srcs: NDArray[np.int64]
    ) -> list:
        out = []
        nf = len(self.fields)
        fields = list(self.fields.items())
        for dest, src in zip(dests.tolist(), srcs.tolist(), strict=True):
            where = "loading it"
            prepared: list[Any] = []
            try:
                sample = self._load(dataset, src)
                if not isinstance(sample, (tuple, list)):
                    raise WriterError(
                        f"dataset[{src}] returned a {type(sample).__name__}; it must return a "
                        f"tuple with one value per field ({', '.join(self.fields)})",
                        dest,
                    )
                if len(sample) < nf:
                    raise WriterError(
                        f"dataset[{src}] returned {len(sample)} values for {nf} fields "
                        f"({', '.join(self.fields)})",
                        dest,
                    )
                for fi, (name, field) in enumerate(fields):
                    where = f"field {name!r}"
                    rng = (
                        np.random.default_rng([self.seed, dest, fi])
                        if self.seed is not None
                        else None
                    )
                    prep = getattr(field, "prepare", None)
                    prepared.append(prep(sample[fi], rng) if prep is not None else sample[fi])
            except WriterError:
                raise
            except Exception as exc:
                raise WriterError(
                    f"(dataset index {src}, {where}) {type(exc).__name__}: {exc}",
                    dest,
                ) from exc
            out.append((dest, prepared))
        return out

    def _load(self, dataset: Any, src: int) -> Any:
        """``dataset[src]``, snapshotted (:func:`_snapshot`) before any other read can run."""
        lock = self._read_lock
        if lock is None:
            sample = dataset[src]
            return [_snapshot(v) for v in sample] if isinstance(sample, (tuple, list)) else sample
        with lock:
            t0 = time.perf_counter()
            sample = dataset[src]
            if isinstance(sample, (tuple, list)):
                sample = [_snapshot(v) for v in sample]
            self._read_s += time.perf_counter() - t0
        return sample

    def _write(self, dataset: Any, indices: NDArray[np.int64], chunksize: int) -> None:
        serial = not self.concurrent_reads and self.num_workers > 1
        self._read_lock = threading.Lock() if serial else None
        self._read_s = 0.0
        t0 = time.perf_counter()
        self._write_file(dataset, indices, chunksize)
        took = time.perf_counter() - t0
        if serial and took > 0 and self._read_s >= _READ_HINT_SHARE * took:
            log.info(
                "dataset[i] took %.1f s of the write's %.1f s, one call at a time; if the "
                "dataset's __getitem__ is thread-safe, DatasetWriter(concurrent_reads=True) lets "
                "the %d workers read at once",
                self._read_s,
                took,
                self.num_workers,
            )

    def _write_file(self, dataset: Any, indices: NDArray[np.int64], chunksize: int) -> None:
        names = list(self.fields)
        fields = [self.fields[n] for n in names]
        n = int(indices.size)
        rec = record_dtype([np.dtype(f.metadata_type) for f in fields])
        metadata = np.zeros(n, dtype=rec)
        columns = [metadata[f"f{i}"] for i in range(len(fields))]
        m_off = metadata_offset(len(fields))
        data_start = align_up(m_off + n * rec.itemsize, self.page_size)
        descs = np.zeros(len(fields), dtype=FIELD_DESC_DTYPE)
        for i, (name, field) in enumerate(zip(names, fields, strict=True)):
            descs["type_id"][i] = type_id_of(field)
            raw = name.encode("ascii")
            descs["name"][i, : len(raw)] = np.frombuffer(raw, dtype=np.uint8)
            descs["arguments"][i] = _as_blob(field.to_binary(), name)

        target = _output_target(self.fname)
        directory, base = os.path.split(target)
        # The name is cut so that the temporary name fits the 255-byte limit of a file name.
        _sweep_stale_tmp(directory, base[:200])
        tmp = os.path.join(directory, f".{base[:200]}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=n, desc=os.path.basename(self.fname), unit="sample")
        pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix="beton-writer")
        pending: deque[Future] = deque()
        try:
            with _output_errors(self.fname), open(tmp, "xb") as f:
                f.write(self._header(n, 0).tobytes())
                f.write(descs.tobytes())
                packer = _Packer(f, data_start, self.page_size)
                starts = range(0, n, chunksize)
                window = 2 * self.num_workers + 1
                it = iter(starts)
                for s in it:
                    pending.append(self._submit(pool, dataset, indices, s, chunksize))
                    if len(pending) >= window:
                        break
                while pending:
                    chunk = pending.popleft().result()
                    nxt = next(it, None)
                    if nxt is not None:
                        pending.append(self._submit(pool, dataset, indices, nxt, chunksize))
                    for dest, prepared in chunk:
                        self._pack(packer, fields, names, columns, dest, prepared)
                    if bar is not None:
                        bar.update(len(chunk))
                packer.flush()
                if packer.page_no < 0:  # no field allocates: table directly after metadata
                    f.seek(m_off)
                    f.write(metadata.tobytes())
                    table_ptr = f.tell()
                else:
                    table_ptr = f.tell()
                    f.seek(m_off)
                    f.write(metadata.tobytes())
                    f.seek(table_ptr)
                table = np.array(packer.entries, dtype=np.uint64).reshape(-1, 3)
                f.write(np.ascontiguousarray(table).view(ALLOC_ENTRY_DTYPE).tobytes())
                f.seek(0)
                f.write(self._header(n, table_ptr).tobytes())
                with _output_errors(self.fname):
                    f.flush()
                    os.fsync(f.fileno())
            with _output_errors(self.fname):
                os.replace(tmp, target)
        except BaseException:
            for fut in pending:
                fut.cancel()
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            if bar is not None:
                bar.close()

    def _submit(
        self,
        pool: ThreadPoolExecutor,
        dataset: Any,
        indices: NDArray[np.int64],
        start: int,
        chunksize: int,
    ) -> Future:
        stop = min(start + chunksize, indices.size)
        dests = np.arange(start, stop, dtype=np.int64)
        return pool.submit(self._prepare_chunk, dataset, dests, indices[start:stop])

    def _pack(
        self,
        packer: _Packer,
        fields: list[Any],
        names: list[str],
        columns: list[np.ndarray],
        dest: int,
        prepared: list[Any],
    ) -> None:
        packer.current = dest
        i = 0
        for attempt in (0, 1):
            try:
                for i, field in enumerate(fields):
                    destination = columns[i][dest : dest + 1]
                    enc = getattr(field, "encode_prepared", None)
                    if enc is not None:
                        enc(destination, prepared[i], packer.malloc)
                    else:
                        field.encode(destination, prepared[i], packer.malloc)
                return
            except _Spill:
                if attempt == 1:
                    raise WriterError(
                        f"the sample's data does not fit in one page of {self.page_size} bytes; "
                        "raise page_size",
                        dest,
                    ) from None
            except WriterError:
                raise
            except Exception as exc:
                raise WriterError(
                    f"(field {names[i]!r}) encoding failed: {type(exc).__name__}: {exc}", dest
                ) from exc

    def _header(self, n: int, table_ptr: int) -> np.ndarray:
        h = np.zeros(1, dtype=HEADER_DTYPE)
        h["version"] = FORMAT_VERSION
        h["num_fields"] = len(self.fields)
        h["page_size"] = self.page_size
        h["num_samples"] = n
        h["alloc_table_ptr"] = table_ptr
        return h
