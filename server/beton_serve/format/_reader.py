"""``BetonReader``: memory-map a ``.beton`` file and validate every byte other layers will trust.

Validation happens once, in the constructor, and is vectorised numpy (no Python loop over
samples), so a 10-million-sample file opens in seconds. After it, every pointer in the metadata
is known to be an exact allocation-table entry whose ``[ptr, ptr + size)`` lies inside one data
page, so compiled code can read sample bytes through :func:`memory_read` without bounds checks.

Checks, in order (any failure raises :class:`~beton_serve.errors.FormatError` with the file, the
offset and what was expected; never another exception type):

1. header: at least 24 bytes, ``version == 2``, ``num_fields >= 1``, ``page_size`` a power of two
   in ``[4 KiB, 2 GiB]``;
2. descriptors: they fit in the file; type ids in the field type table (built-ins: 0..6) or 255,
   which needs a custom field class; names ASCII, non-empty, zero-padded after the first NUL,
   unique. Names are stored in 16 bytes: a name of exactly 16 bytes has no NUL and may be a
   truncated longer name; two names that agree on their first 16 bytes collide and are rejected
   (FFCV silently misparses them); the argument blob is valid for its field class;
3. metadata: ``M + N*R`` bytes fit before ``alloc_table_ptr``;
4. allocation table: ``alloc_table_ptr`` between the end of the metadata and EOF, its length a
   multiple of 24; if it has entries, the data region starts page-aligned and holds whole pages;
   every entry has ``sample_id < N``, ``ptr`` in ``[D, A)``, ``ptr + size <= A`` and within the
   pointer's page; non-empty allocations do not overlap; all allocations of a sample are in one
   page;
5. per field: metadata values are valid (e.g. RGB mode 0 or 1) and every pointer they reference
   is a table entry of that sample with the size the field implies (raw RGB ``w*h*3``, NDArray
   ``element_size``, Bytes/JSON the metadata size).

The reader never imports ``beton_serve.fields``, which sits above this layer: the Field class of
each type id comes from the ``field_types`` table it is given, or from
:func:`default_field_types` (the built-in classes, supplied by the package root; see
``beton_serve._field_types``).
"""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
from beton_wire.file_identity import content_fingerprint, dataset_digest, unmappable
from numpy.typing import NDArray

from beton_serve._field_types import FieldTypes, default_field_types
from beton_serve.errors import FormatError
from beton_serve.format._files import NOT_REGULAR, NotRegularFile, open_regular
from beton_serve.format._guard import Region, guard
from beton_serve.format._layout import (
    ALLOC_ENTRY_DTYPE,
    DESC_OFFSET,
    DESC_SIZE,
    FIELD_DESC_DTYPE,
    FORMAT_VERSION,
    HEADER_DTYPE,
    HEADER_SIZE,
    MAX_NAME_BYTES,
    MIN_READ_PAGE_SIZE,
    TYPE_CUSTOM,
    align_up,
    metadata_offset,
    record_dtype,
)

__all__ = ["BetonReader", "Header", "default_field_types"]

_MAX_READ_PAGE_SIZE = 1 << 31
_NAME_OFFSET = 1
_ARGS_OFFSET = 1 + MAX_NAME_BYTES


def _id_ranges(ids: list[int]) -> list[str]:
    """Sorted ``[0, 1, 2, 4]`` -> ``["0-2", "4"]``: the known type ids, for an error message."""
    runs: list[list[int]] = []
    for tid in ids:
        if runs and runs[-1][-1] == tid - 1:
            runs[-1].append(tid)
        else:
            runs.append([tid])
    return [str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs]


class Header(NamedTuple):
    """The 24-byte file header."""

    version: int
    num_fields: int
    page_size: int
    num_samples: int
    alloc_table_ptr: int


class BetonReader:
    """A validated, memory-mapped ``.beton`` file (FFCV format version 2).

    Args:
        path: the file.
        custom_fields: field classes by field name. Required for type-255 fields; for a built-in
            type it replaces the built-in class (FFCV's rule).
        field_types: the Field class of each type id the file may use (type id 255 is never
            looked up in it). ``None``: :func:`default_field_types`, the built-in classes
            (``beton_serve.fields.CLASS_BY_TYPE_ID``). A type id absent from the table is
            refused as unknown.

    Raises:
        FormatError: the file is missing, truncated, malformed or inconsistent.

    Attributes:
        path: the file path (``str``).
        field_types: the type id table the file was read with.
        header: the :class:`Header`.
        num_samples, page_size: from the header.
        field_names: field names in file order.
        type_ids: type ids in file order.
        handlers: field name -> field instance (built from its argument blob).
        metadata: structured ``(N,)`` read-only view of the metadata table; members ``f0, f1, ...``.
        record_size: bytes per metadata record (R).
        data_start: offset D of the first data page (equals the end of the metadata when the file
            has no allocations).
        sample_pages: ``int64[N]`` absolute page index of each sample's data, ``-1`` if none.
        storage_state: ``(mem, sorted_ptrs, sorted_sizes)`` for :func:`memory_read`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        custom_fields: Mapping[str, type] | None = None,
        *,
        field_types: FieldTypes | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.field_types: FieldTypes = default_field_types() if field_types is None else field_types
        self._mm: mmap.mmap | None = None
        self._guard: Region | None = None
        try:
            with open_regular(self.path) as f:
                st = os.fstat(f.fileno())
                size = st.st_size
                #: Which file this is (device, inode, size, modification time): two files at
                #: one path, or one rewritten, differ here (``PlanCache`` keys by it).
                self.identity: tuple[int, int, int, int] = (
                    st.st_dev,
                    st.st_ino,
                    st.st_size,
                    st.st_mtime_ns,
                )
                #: Where the mapped file was when it was opened, symlinks resolved, from the
                #: descriptor itself (a path checked and then opened again may name another
                #: file by then: a directory swapped for a symlink in between).
                self.real_path: str = _descriptor_path(f.fileno(), self.path)
                if size < HEADER_SIZE:
                    raise FormatError(
                        self.path, 0, f"file is {size} bytes, shorter than the 24-byte header"
                    )
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except NotRegularFile:
            raise FormatError(self.path, None, unmappable(NOT_REGULAR)) from None
        except OSError as exc:
            raise FormatError(self.path, None, unmappable(exc)) from None
        self.file_size = size
        self._mem: NDArray[np.uint8] = np.frombuffer(self._mm, dtype=np.uint8)
        # A truncation while mapped reads as zeros and is reported by check_mapping (_guard).
        self._guard = guard(self._mm, self._mem.ctypes.data, size)
        try:
            self._validate(dict(custom_fields or {}))
            mm = self._mm
            #: ``FileIdentity.fingerprint`` of the mapped bytes (size and both ends): what a
            #: Loader's state names its dataset by (``beton_wire.file_identity.dataset_digest``).
            self.fingerprint: str = content_fingerprint(lambda n, off: mm[off : off + n], size)
        except BaseException:
            self.close()
            raise

    # -- validation -------------------------------------------------------------------------
    def _fail(self, offset: int | None, reason: str) -> FormatError:
        return FormatError(self.path, offset, reason)

    def _validate(self, custom_fields: dict[str, type]) -> None:
        self._read_header()
        self._read_descriptors(custom_fields)
        self._read_metadata()
        self._read_allocation_table()
        self._check_fields()

    def _read_header(self) -> None:
        h = np.frombuffer(self._mem, dtype=HEADER_DTYPE, count=1)[0]
        self.header = Header(*(int(h[k]) for k in HEADER_DTYPE.names or ()))
        version, num_fields, page_size = self.header[:3]
        if version != FORMAT_VERSION:
            raise self._fail(0, f"format version is {version}, expected {FORMAT_VERSION}")
        if num_fields < 1:
            raise self._fail(2, "num_fields is 0; a .beton has at least one field")
        if (
            page_size & (page_size - 1)
            or not MIN_READ_PAGE_SIZE <= page_size <= _MAX_READ_PAGE_SIZE
        ):
            raise self._fail(
                4, f"page_size {page_size} is not a power of two between 4 KiB and 2 GiB"
            )
        self.num_samples = self.header.num_samples
        self.page_size = page_size
        self._page_shift = page_size.bit_length() - 1

    def _read_descriptors(self, custom_fields: dict[str, type]) -> None:
        table = self.field_types
        known = ", ".join([*_id_ranges(sorted(t for t in table if t != TYPE_CUSTOM)), "255"])
        nf = self.header.num_fields
        end = metadata_offset(nf)
        if end > self.file_size:
            raise self._fail(
                DESC_OFFSET,
                f"{nf} field descriptors need {end} bytes, the file has {self.file_size}",
            )
        descs = np.frombuffer(self._mem, dtype=FIELD_DESC_DTYPE, count=nf, offset=DESC_OFFSET)
        self.field_names: list[str] = []
        self.type_ids: list[int] = []
        self.handlers: dict[str, Any] = {}
        self._arg_blobs: list[bytes] = []
        self._meta_dtypes: list[np.dtype] = []
        seen: dict[str, int] = {}
        for i in range(nf):
            at = DESC_OFFSET + DESC_SIZE * i
            tid = int(descs[i]["type_id"])
            name = self._parse_name(descs[i]["name"], at + _NAME_OFFSET, i)
            if name in seen:
                raise self._fail(
                    at + _NAME_OFFSET,
                    f"fields {seen[name]} and {i} are both named {name!r}: names are stored in "
                    "16 bytes, so names that agree on their first 16 characters collide; rename "
                    "one when writing",
                )
            seen[name] = i
            builtin: Any = None if tid == TYPE_CUSTOM else table.get(tid)
            if builtin is None and tid != TYPE_CUSTOM:
                raise self._fail(at, f"field {name!r} has unknown type id {tid} (known: {known})")
            cls: Any = custom_fields.get(name) or builtin
            if cls is None:
                raise self._fail(
                    at,
                    f"field {name!r} has the custom type id 255; pass "
                    f"custom_fields={{{name!r}: YourFieldClass}}",
                )
            blob = np.array(descs[i]["arguments"], dtype=np.uint8)
            blob.flags.writeable = False
            kind = "custom" if builtin is None else builtin.__name__
            try:
                handler = cls.from_binary(blob)
                meta_dtype = np.dtype(handler.metadata_type)
                stored = meta_dtype
                if builtin is not None and cls is not builtin:
                    stored = np.dtype(builtin.from_binary(blob).metadata_type)
            except Exception as exc:  # a custom field may raise anything: report it as format
                raise self._fail(
                    at + _ARGS_OFFSET,
                    f"arguments of field {name!r} ({kind}) are invalid: {exc}",
                ) from None
            if stored != meta_dtype:
                # The records were written with the built-in's layout: another layout misreads
                # every sample's metadata (and the sizes of every record after this field).
                raise self._fail(
                    at,
                    f"custom_fields[{name!r}] = {getattr(cls, '__name__', cls)} reads metadata "
                    f"{meta_dtype}, but the file stores {name!r} as {builtin.__name__} with "
                    f"metadata {stored}: an override of a built-in field must keep its metadata "
                    "layout (subclass it)",
                )
            self.field_names.append(name)
            self.type_ids.append(tid)
            self.handlers[name] = handler
            self._arg_blobs.append(blob.tobytes())
            self._meta_dtypes.append(meta_dtype)

    def _parse_name(self, raw: NDArray[np.uint8], offset: int, index: int) -> str:
        data = bytes(raw)
        cut = data.find(b"\0")
        name_b = data if cut < 0 else data[:cut]
        if cut >= 0 and any(data[cut:]):
            raise self._fail(offset, f"name of field {index} has non-zero bytes after its NUL")
        if not name_b:
            raise self._fail(offset, f"field {index} has an empty name")
        if any(b >= 0x80 or b < 0x20 for b in name_b):
            raise self._fail(offset, f"name of field {index} is not printable ASCII: {name_b!r}")
        return name_b.decode("ascii")

    def _read_metadata(self) -> None:
        self.record = record_dtype(self._meta_dtypes)
        self.record_size = int(self.record.itemsize)
        self.metadata_offset = metadata_offset(self.header.num_fields)
        n = self.num_samples
        self.metadata_end = self.metadata_offset + n * self.record_size
        if self.metadata_end > self.file_size:
            raise self._fail(
                self.metadata_offset,
                f"{n} metadata records of {self.record_size} bytes end at {self.metadata_end}, "
                f"past the end of the file ({self.file_size}); the file is truncated",
            )
        if self.header.alloc_table_ptr < self.metadata_end:
            raise self._fail(
                16,
                f"alloc_table_ptr {self.header.alloc_table_ptr} lies inside the metadata, which "
                f"ends at {self.metadata_end} (a writer that crashed leaves 0 here)",
            )
        self.metadata: np.ndarray = np.frombuffer(
            self._mem, dtype=self.record, count=n, offset=self.metadata_offset
        )

    def _read_allocation_table(self) -> None:
        a, size, ps = self.header.alloc_table_ptr, self.file_size, self.page_size
        if a > size:
            raise self._fail(
                16, f"alloc_table_ptr {a} is past the end of the file ({size}); it is truncated"
            )
        if (size - a) % ALLOC_ENTRY_DTYPE.itemsize:
            raise self._fail(
                16,
                f"the allocation table [{a}, {size}) is {size - a} bytes, not a multiple of 24; "
                "the file is truncated or has trailing bytes",
            )
        k = (size - a) // ALLOC_ENTRY_DTYPE.itemsize
        d = align_up(self.metadata_end, ps)
        self.data_start = d if k else min(d, a)
        if k and (a < d or (a - d) % ps):
            raise self._fail(
                16,
                f"alloc_table_ptr {a} must be the end of whole data pages starting at {d} "
                f"(page size {ps})",
            )
        if not k and a != self.metadata_end and (a < d or (a - d) % ps):
            raise self._fail(
                16, f"alloc_table_ptr {a} is neither {self.metadata_end} nor a page end"
            )
        table = np.frombuffer(self._mem, dtype=ALLOC_ENTRY_DTYPE, count=k, offset=a)
        sid = table["sample_id"].astype(np.uint64)
        ptr = table["ptr"].astype(np.uint64)
        sz = table["size"].astype(np.uint64)

        def entry_error(mask: NDArray[np.bool_], what: str) -> None:
            bad = np.flatnonzero(mask)
            if bad.size:
                j = int(bad[0])
                raise self._fail(
                    a + 24 * j,
                    f"allocation entry {j} (sample {int(sid[j])}, ptr {int(ptr[j])}, size "
                    f"{int(sz[j])}): {what}",
                )

        entry_error(
            sid >= np.uint64(self.num_samples), f"sample_id is not below {self.num_samples}"
        )
        # A zero-size entry addresses no byte. FFCV 1.0.2 writes one for an empty value (a
        # BytesField's b""), and its pointer is then whatever its allocator held: the data
        # start minus a page when the worker had booked no page yet (0 for a one-page
        # metadata region), or the end of the data region after an exactly full last page.
        nonempty = sz > np.uint64(0)
        entry_error(
            nonempty & ((ptr < np.uint64(d)) | (ptr >= np.uint64(a))), f"ptr is outside [{d}, {a})"
        )
        entry_error(~nonempty & (ptr > np.uint64(a)), f"ptr is past the data region end {a}")
        before_pages = np.uint64(d - ps) if d >= ps else np.uint64(d)
        entry_error(
            ~nonempty & (ptr < np.uint64(d)) & (ptr != before_pages),
            f"a zero-size entry's ptr is before the data region start {d} (and not {d - ps}, "
            "where FFCV's allocator stands before its first page)",
        )
        entry_error(
            nonempty & (sz > np.uint64(a) - ptr), f"ptr + size runs past the data region end {a}"
        )
        entry_error(
            (ptr & np.uint64(ps - 1)) + sz > np.uint64(ps),
            f"the allocation crosses a page boundary (page size {ps})",
        )
        if k > 1 and bool(np.all(ptr[1:] > ptr[:-1])):
            order = None  # already sorted (what one writer worker produces)
            sp, ss, sids = ptr, sz, sid
        else:
            order = np.argsort(ptr)
            sp = ptr[order]
            if k > 1 and bool(np.any(sp[1:] == sp[:-1])):
                # Duplicate pointers (zero-size allocations): larger size first on ties.
                order = np.lexsort((~sz, ptr))
                sp = ptr[order]
            ss, sids = sz[order], sid[order]
        nz = ss > 0
        p_nz, s_nz = sp[nz], ss[nz]
        over = np.flatnonzero(p_nz[:-1] + s_nz[:-1] > p_nz[1:])
        if over.size:
            j = int(over[0])
            raise self._fail(
                int(p_nz[j]),
                f"allocations at {int(p_nz[j])} (size {int(s_nz[j])}) and {int(p_nz[j + 1])} "
                "overlap",
            )
        # The page of each sample's bytes (zero-size entries have none: see above).
        pages = (ptr >> np.uint64(self._page_shift)).astype(np.int64)
        sample_pages = np.full(self.num_samples, -1, dtype=np.int64)
        sample_pages[sid[nonempty].astype(np.int64)] = pages[nonempty]
        entry_error(
            nonempty & (sample_pages[sid.astype(np.int64)] != pages),
            "this sample has allocations in more than one page",
        )
        self.sample_pages: NDArray[np.int64] = sample_pages
        self.num_allocations = k
        self._sorted_ptrs = np.ascontiguousarray(sp)
        self._sorted_sizes = np.ascontiguousarray(ss)
        self._sorted_sids = np.ascontiguousarray(sids)
        self.storage_state = (self._mem, self._sorted_ptrs, self._sorted_sizes)

    def _check_fields(self) -> None:
        n = self.num_samples
        if n == 0:
            return
        sp, ss, ssid = self._sorted_ptrs, self._sorted_sizes, self._sorted_sids
        k = sp.size
        expected_sid = np.arange(n, dtype=np.uint64)
        for i, name in enumerate(self.field_names):
            handler = self.handlers[name]
            column = self.metadata[f"f{i}"]
            member_off = int(self.record.fields[f"f{i}"][1])  # type: ignore[index]

            def record_at(j: int, _off: int = member_off) -> int:
                return self.metadata_offset + j * self.record_size + _off

            try:
                problem = getattr(handler, "metadata_problem", lambda c: None)(column)
                checks: list[Any] = getattr(handler, "allocation_checks", lambda c: [])(column)
            except Exception as exc:
                raise self._fail(None, f"field {name!r}: metadata check failed: {exc}") from None
            if problem is not None:
                j, why = problem
                raise self._fail(record_at(j), f"sample {j}, field {name!r}: {why}")
            for chk in checks:
                ptrs = np.asarray(chk.ptrs, dtype=np.uint64)
                exp = np.asarray(chk.sizes, dtype=np.int64)
                if k == 0:
                    raise self._fail(
                        record_at(0),
                        f"sample 0, field {name!r}: {chk.what} {int(ptrs[0])} is not in the "
                        "allocation table (the table is empty)",
                    )
                left = np.minimum(np.searchsorted(sp, ptrs, side="left"), k - 1)
                right = np.maximum(np.searchsorted(sp, ptrs, side="right") - 1, 0)
                # Expected-empty values may match the zero-size entry of a duplicated pointer.
                ix = np.where(exp == 0, right, left)
                found = sp[ix] == ptrs
                got = ss[ix].astype(np.int64)
                ok_size = (got == exp) | ((exp == -1) & (got >= 1))
                if chk.empty_as_one:
                    ok_size |= (exp == 0) & (got == 1)
                bad = np.flatnonzero(~found)
                if bad.size:
                    j = int(bad[0])
                    raise self._fail(
                        record_at(j),
                        f"sample {j}, field {name!r}: {chk.what} {int(ptrs[j])} is not in the "
                        "allocation table",
                    )
                bad = np.flatnonzero(~ok_size)
                if bad.size:
                    j = int(bad[0])
                    want = "at least 1" if exp[j] == -1 else str(int(exp[j]))
                    raise self._fail(
                        record_at(j),
                        f"sample {j}, field {name!r}: the allocation at {chk.what} {int(ptrs[j])} "
                        f"has size {int(got[j])}, expected {want}",
                    )
                bad = np.flatnonzero(ssid[ix] != expected_sid)
                if bad.size:
                    j = int(bad[0])
                    raise self._fail(
                        record_at(j),
                        f"sample {j}, field {name!r}: the allocation at {int(ptrs[j])} belongs to "
                        f"sample {int(ssid[ix][j])}",
                    )

    # -- access -----------------------------------------------------------------------------
    def field_index(self, name: str) -> int:
        """Position of field ``name`` in file order (``KeyError`` if absent)."""
        try:
            return self.field_names.index(name)
        except ValueError:
            raise KeyError(f"no field {name!r}; fields are {self.field_names}") from None

    def field_metadata(self, name: str) -> np.ndarray:
        """Field ``name``'s metadata column: a read-only ``(N,)`` view, indexable by sample id.

        Its dtype is the field's ``metadata_type`` (e.g. ``<i8`` for IntField, the packed RGB
        struct for RGBImageField). Numba code can index it.
        """
        return self.metadata[f"f{self.field_index(name)}"]

    def sample_bytes(self, sample_id: int, field_name: str) -> NDArray[np.uint8]:
        """The stored bytes of one sample's field, as a zero-copy read-only ``uint8`` view.

        For Bytes/JSON this is the value itself (``metadata['size']`` bytes): an empty value is
        stored as a 1-byte allocation by beton-serve's writer, so decoders of those fields must
        copy ``metadata['size']`` bytes rather than the allocation's length.

        Raises:
            KeyError: no such field.
            IndexError: ``sample_id`` out of range.
            ValueError: the field stores no data bytes (Int/Float).
        """
        handler = self.handlers[self.field_names[self.field_index(field_name)]]
        if not 0 <= sample_id < self.num_samples:
            raise IndexError(f"sample {sample_id} out of range [0, {self.num_samples})")
        checks: list[Any] = getattr(handler, "allocation_checks", lambda c: [])(
            self.field_metadata(field_name)[sample_id : sample_id + 1]
        )
        if not checks:
            raise ValueError(f"field {field_name!r} stores its value inline, not as data bytes")
        from beton_serve.format._memory import memory_read

        chk = checks[0]
        view = memory_read(int(chk.ptrs[0]), self.storage_state)
        if chk.empty_as_one and int(chk.sizes[0]) == 0:
            return view[:0]  # an empty value stored as a 1-byte allocation
        return view

    def schema_key(self) -> str:
        """A stable hex digest of (field names, type ids, argument blobs, record layout)."""
        h = hashlib.sha256(b"beton-schema-v1")
        for name, tid, blob in zip(self.field_names, self.type_ids, self._arg_blobs, strict=True):
            h.update(name.encode("ascii") + b"\0" + bytes([tid]) + blob)
        h.update(str(self.record.descr).encode())
        return h.hexdigest()

    @property
    def allocations(self) -> tuple[NDArray[np.uint64], NDArray[np.uint64], NDArray[np.uint64]]:
        """``(sample_ids, ptrs, sizes)`` of the allocation table, sorted by ``ptr``."""
        return self._sorted_sids, self._sorted_ptrs, self._sorted_sizes

    def close(self) -> None:
        """Release the mapping. Views handed out keep it alive until they are dropped."""
        mm, self._mm = self._mm, None
        if mm is None:
            return
        self._mem = np.empty(0, dtype=np.uint8)
        self.storage_state = (self._mem, np.empty(0, np.uint64), np.empty(0, np.uint64))
        self.metadata = np.empty(0, dtype=getattr(self, "record", np.uint8))
        try:
            mm.close()
        except BufferError:
            pass  # arrays still reference it; the mapping is released when they are freed
        else:  # unmapped: stop guarding it (else the guard ends when the mapping is freed)
            if self._guard is not None:
                self._guard.close()

    def check_mapping(self) -> None:
        """Raise if a read of this file's mapping went past the file's end: it was truncated
        while mapped, and those reads returned zeros instead of crashing the process
        (:mod:`beton_serve.format._guard`). Call after reading a batch (one integer load).

        Raises:
            FormatError: naming the file; it stays raised (the reader no longer reads the file).
        """
        g = self._guard
        hits = 0 if g is None else g.hits()
        if hits:
            raise FormatError(
                self.path,
                None,
                f"the file shrank while it was mapped ({hits} page(s) read past its new end, "
                "as zeros; the batch is discarded). Restore the file and reopen it; never "
                "rewrite a .beton in place",
            )

    def __enter__(self) -> BetonReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"BetonReader({self.path!r}, samples={self.num_samples}, "
            f"fields={dict(zip(self.field_names, self.type_ids, strict=True))})"
        )


def _descriptor_path(fd: int, path: str) -> str:
    """The real path of the file open as ``fd`` (``/proc/self/fd``); ``realpath(path)`` where
    there is no ``/proc``."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return os.path.realpath(path)
    return target if target.startswith("/") else os.path.realpath(path)


def readers_digest(readers: Sequence[Any]) -> str:
    """``beton_wire.file_identity.dataset_digest`` of open readers' files, in shard order
    (``""`` when one has no fingerprint: a test double)."""
    return dataset_digest(
        [(int(getattr(r, "file_size", 0)), str(getattr(r, "fingerprint", ""))) for r in readers]
    )
