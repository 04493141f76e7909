"""How bytes_empty_values.beton was made: run with FFCV 1.0.2 (``../peers/ffcv-venv``), not in CI.

``python make_bytes_empty_values.py bytes_empty_values.beton`` writes four BytesField values, the
first and third empty, and prints what FFCV itself reads back. FFCV's allocator records an empty
first value at pointer 0 (the data start minus a page: no page was booked yet), and its reader
returns padding for the empty values and, for ``b"hello"``, the bytes of the zero-size entry
that shares its pointer (it looks sizes up by pointer and finds the empty one first).
"""

import sys

import numpy as np
from ffcv.fields import BytesField, IntField
from ffcv.fields.decoders import BytesDecoder, IntDecoder
from ffcv.loader import Loader, OrderOption
from ffcv.writer import DatasetWriter


class DS:
    def __init__(self, vals):
        self.vals = vals

    def __len__(self):
        return len(self.vals)

    def __getitem__(self, i):
        return (self.vals[i], i)


out = sys.argv[1]
vals = [
    np.zeros(0, np.uint8),
    np.frombuffer(b"abc", np.uint8),
    np.zeros(0, np.uint8),
    np.frombuffer(b"hello", np.uint8),
]
DatasetWriter(
    out, {"b": BytesField(), "label": IntField()}, page_size=1 << 21, num_workers=1
).from_indexed_dataset(DS(vals))

try:
    loader = Loader(
        out,
        batch_size=4,
        num_workers=1,
        order=OrderOption.SEQUENTIAL,
        pipelines={"b": [BytesDecoder()], "label": [IntDecoder()]},
    )
    for b in loader:
        print("ffcv read", [bytes(r).rstrip(b"\0") for r in b[0]], b[1].ravel().tolist())
except Exception as e:
    print("ffcv read failed", type(e).__name__, e)
