"""Several ``.beton`` shards with one schema, seen as one reader with one index space.

Data structure. The planner's compiled code reads a sample's bytes with
``memory_read(ptr, (mem, sorted_ptrs, sorted_sizes))``, where ``mem`` is one ``uint8`` array over
a whole file and ``ptr`` an offset into it. To serve shards with that same code, the shards are
mapped back to back into one reserved virtual range::

    base ─┬─ shard 0 file (mapped read-only) ─┬─ pad ─┬─ shard 1 file ─┬─ ... ─┐
          0                                   off_1                  off_2

and every pointer of shard ``i`` (its allocation table and the pointer members of its metadata)
is shifted by ``off_i`` (a multiple of the page size). Sample ids are shifted by the shard's
first id, in shard order. Nothing is copied except the metadata columns and allocation tables.

Pointer members are found by name (``ptr``, ``data_ptr``: FFCV's bytes/RGB layouts) or, for fields
whose whole metadata is one pointer (``NDArrayField`` and its subclasses), by field type.

The mapping is created with ``mmap(MAP_FIXED)`` through ctypes (Python's ``mmap`` cannot place a
mapping) and unmapped by :meth:`ShardedReader.close`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from beton_serve.errors import ConfigError

__all__ = ["ShardedReader"]

_PROT_NONE, _PROT_READ = 0, 1
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANON, _MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc() -> Any:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def _pointer_members(handler: Any, dtype: np.dtype) -> list[str] | None:
    """Names of pointer members of a field's metadata; ``None`` if the whole value is a pointer."""
    if dtype.names:
        return [n for n in dtype.names if "ptr" in n]
    if any(c.__name__ == "NDArrayField" for c in type(handler).__mro__):
        return None
    return []


class ShardedReader:
    """A reader over shards (see the module docstring); the planner uses it like ``BetonReader``.

    Args:
        readers: open readers of the shards, in index order, with equal schema keys.
        name: the dataset name (used as ``path`` for logs and caches).

    Raises:
        ConfigError: the shards cannot be mapped together.
    """

    def __init__(self, readers: Sequence[Any], name: str) -> None:
        self.readers = list(readers)
        first = self.readers[0]
        self.path = f"{name}[{len(self.readers)} shards]"
        self.field_names = list(first.field_names)
        self.handlers = first.handlers
        self.page_size = int(first.page_size)
        self.num_samples = sum(int(r.num_samples) for r in self.readers)
        self._schema_key = str(first.schema_key())
        align = max(self.page_size, mmap.PAGESIZE)
        sizes = [len(r.storage_state[0]) for r in self.readers]
        offsets, pos = [], 0
        for s in sizes:
            offsets.append(pos)
            pos += -(-s // align) * align
        self._total = max(pos, align)
        self._libc = _libc()
        base = self._libc.mmap(
            None, self._total, _PROT_NONE, _MAP_PRIVATE | _MAP_ANON | _MAP_NORESERVE, -1, 0
        )
        if base in (None, _MAP_FAILED):
            raise ConfigError(
                f"cannot reserve {self._total} bytes of address space for {self.path}"
            )
        self._base = base
        try:
            for r, off, size in zip(self.readers, offsets, sizes, strict=True):
                if size == 0:
                    continue
                fd = os.open(r.path, os.O_RDONLY)
                try:
                    got = self._libc.mmap(
                        base + off, size, _PROT_READ, _MAP_SHARED | _MAP_FIXED, fd, 0
                    )
                finally:
                    os.close(fd)
                if got != base + off:
                    raise ConfigError(
                        f"cannot map shard {r.path} ({os.strerror(ctypes.get_errno())})"
                    )
        except BaseException:
            self._libc.munmap(base, self._total)
            raise
        from beton_serve.format import guard_mapping

        # A shard truncated while mapped reads as zeros and is reported by check_mapping.
        self._guard = guard_mapping(None, base, self._total)
        mem = np.ctypeslib.as_array((ctypes.c_uint8 * self._total).from_address(base))
        mem.flags.writeable = False
        ptrs = np.concatenate(
            [r.storage_state[1] + np.uint64(o) for r, o in zip(self.readers, offsets, strict=True)]
        )
        sizes_arr = np.concatenate([r.storage_state[2] for r in self.readers])
        self.storage_state = (mem, ptrs.astype(np.uint64), sizes_arr.astype(np.uint64))
        columns = []
        for r, off in zip(self.readers, offsets, strict=True):
            md = np.array(r.metadata, copy=True)
            for i, fname in enumerate(self.field_names):
                col = f"f{i}"
                members = _pointer_members(self.handlers[fname], md.dtype[col])
                if members is None:
                    md[col] += np.uint64(off)
                else:
                    for m in members:
                        md[col][m] += np.uint64(off)
            columns.append(md)
        self.metadata = np.concatenate(columns)
        self.metadata.flags.writeable = False
        page_shift = [o // self.page_size for o in offsets]
        self.sample_pages = np.concatenate(
            [
                np.where(r.sample_pages >= 0, r.sample_pages + s, -1)
                for r, s in zip(self.readers, page_shift, strict=True)
            ]
        ).astype(np.int64)
        self.shard_starts = np.cumsum([0, *[int(r.num_samples) for r in self.readers]])[:-1]

    def field_index(self, name: str) -> int:
        return self.field_names.index(name)

    def field_metadata(self, name: str) -> np.ndarray:
        """One field's metadata column over every shard (pointers already shifted)."""
        return self.metadata[f"f{self.field_index(name)}"]

    def schema_key(self) -> str:
        return self._schema_key

    def check_mapping(self) -> None:
        """Raise ``FormatError`` if a shard shrank under the combined mapping (reads past its
        end returned zeros; see ``beton_serve.format._guard``)."""
        hits = 0 if self._guard is None else self._guard.hits()
        if hits:
            from beton_serve.errors import FormatError

            raise FormatError(
                self.path,
                None,
                f"a shard shrank while it was mapped ({hits} page(s) read past its new end, as "
                "zeros; the batch is discarded). Restore it and restart; never rewrite a .beton "
                "in place",
            )

    def close(self) -> None:
        """Unmap the combined range (the shards' own readers are closed by their owner)."""
        if self._base is not None:
            self.storage_state = (np.empty(0, np.uint8), *self.storage_state[1:])
            self._libc.munmap(self._base, self._total)
            self._base = None
            if self._guard is not None:
                self._guard.close()
