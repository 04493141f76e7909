"""A minimal, test-only reader of FFCV ``.beton`` fixtures (header, metadata, allocation table).

It exists so that the op tests do not depend on ``beton_serve.format``. ``memory_read`` and the
``storage_state`` tuple mimic the reader contract of docs/internal/CONTRACTS.md: ``storage_state
= (file_bytes_uint8, sorted_ptrs_uint64, sorted_sizes_uint64)`` and ``memory_read`` is a plain
function that Numba can compile.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

_HEADER = np.dtype(
    [
        ("version", "<u2"),
        ("num_fields", "<u2"),
        ("page_size", "<u4"),
        ("num_samples", "<u8"),
        ("alloc_table_ptr", "<u8"),
    ]
)
_DESC = np.dtype([("type_id", "<u1"), ("name", ("u1", 16)), ("arguments", ("u1", 1024))])
RGB_META = np.dtype([("mode", "<u1"), ("width", "<u2"), ("height", "<u2"), ("data_ptr", "<u8")])
BYTES_META = np.dtype([("ptr", "<u8"), ("size", "<u8")])
_ALLOC = np.dtype([("sample_id", "<u8"), ("ptr", "<u8"), ("size", "<u8")])


def memory_read(ptr, storage_state):
    data, ptrs, sizes = storage_state
    i = np.searchsorted(ptrs, ptr)
    return data[ptr : ptr + sizes[i]]


class FixtureFile:
    """Parsed fixture: ``fields`` (name -> (type_id, extra)), ``column(name)``, ``storage_state``."""

    def __init__(self, path: str | Path) -> None:
        data = np.fromfile(path, dtype=np.uint8)
        hdr = data[:24].view(_HEADER)[0]
        nf, n = int(hdr["num_fields"]), int(hdr["num_samples"])
        descs = data[24 : 24 + 1041 * nf].view(_DESC)
        self.fields: dict[str, tuple[int, object]] = {}
        dtypes = []
        for d in descs:
            name = bytes(d["name"]).split(b"\0")[0].decode("ascii")
            tid = int(d["type_id"])
            extra: object = None
            if tid in (0,):
                dt = np.dtype("<f8")
            elif tid == 1:
                dt = np.dtype("<i8")
            elif tid == 2:
                dt = RGB_META
            elif tid in (3, 5):
                dt = BYTES_META
            elif tid in (4, 6):
                dt = np.dtype("<u8")
                args = bytes(d["arguments"])
                shape = [int(x) for x in np.frombuffer(args[:256], "<u8") if x != 0]
                length = int(np.frombuffer(args[256:264], "<u8")[0])
                descr = json.loads(args[264 : 264 + length].decode("ascii"))
                extra = (tuple(shape), np.dtype(descr[0][1]))
            else:
                raise ValueError(f"unsupported type id {tid}")
            self.fields[name] = (tid, extra)
            dtypes.append(dt)
        rec = np.dtype([(f"f{i}", dt) for i, dt in enumerate(dtypes)], align=True)
        m = 24 + 1041 * nf
        self.metadata = data[m : m + n * rec.itemsize].view(rec)
        self.names = list(self.fields)
        a = int(hdr["alloc_table_ptr"])
        alloc = data[a:].view(_ALLOC)
        order = np.argsort(alloc["ptr"], kind="stable")
        self.storage_state = (
            data,
            np.ascontiguousarray(alloc["ptr"][order]),
            np.ascontiguousarray(alloc["size"][order]),
        )
        self.num_samples = n

    def column(self, name: str) -> np.ndarray:
        return self.metadata[f"f{self.names.index(name)}"]
