"""JSON values (type 5; mirrors ``ffcv.fields.json.JSONField``).

Stored as a :class:`~beton_serve.fields.bytes.BytesField`: ``json.dumps(value)`` with Python's
defaults (ASCII-escaped), a NUL appended, UTF-8 encoded. It decodes with ``BytesDecoder``, whose
rows are padded to the file-wide maximum size; :meth:`JSONField.unpack` parses rows up to the
first NUL.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from numpy.typing import NDArray

from beton_serve.fields.base import AllocationCheck, Malloc
from beton_serve.fields.bytes import BytesField

__all__ = ["JSONField"]


class JSONField(BytesField):
    """A JSON-serialisable value per sample."""

    @staticmethod
    def from_binary(binary: NDArray[np.uint8]) -> JSONField:
        if np.any(np.asarray(binary)):
            raise ValueError("JSONField stores an all-zero argument blob; this one is not")
        return JSONField()

    @staticmethod
    def encode_value(value: Any) -> NDArray[np.uint8]:
        """The stored bytes for ``value``: ``json.dumps(value) + "\\0"`` in UTF-8."""
        return np.frombuffer((json.dumps(value) + "\0").encode("utf-8"), dtype=np.uint8)

    def prepare(self, value: Any, rng: np.random.Generator | None = None) -> Any:
        return self.encode_value(value)

    def encode(self, destination: np.ndarray, field: Any, malloc: Malloc) -> None:
        data = field if isinstance(field, np.ndarray) and field.dtype == np.uint8 else None
        if data is None:
            data = self.encode_value(field)
        super().encode(destination, data, malloc)

    @staticmethod
    def unpack(batch: Any) -> list[Any] | Any:
        """Parse ``BytesDecoder`` output: one row (1-D) or a batch of rows (2-D, numpy or torch).

        Each row is decoded up to its first NUL byte. Returns one object for a 1-D input, else a
        list.
        """
        arr = batch.numpy() if hasattr(batch, "numpy") else np.asarray(batch)
        if arr.ndim == 1:
            return _parse_row(arr)
        return [_parse_row(row) for row in arr]

    def allocation_checks(self, column: np.ndarray) -> list[AllocationCheck]:
        checks = super().allocation_checks(column)
        return [c._replace(what="JSONField ptr", empty_as_one=False) for c in checks]

    def metadata_problem(self, column: np.ndarray) -> tuple[int, str] | None:
        bad = np.flatnonzero(column["size"] == 0)
        if bad.size:
            return int(bad[0]), "a JSONField value has size 0 (it always ends with a NUL byte)"
        return None


def _parse_row(row: NDArray[np.uint8]) -> Any:
    raw = row.tobytes()
    end = raw.find(b"\0")
    return json.loads(raw[: end if end >= 0 else len(raw)].decode("utf-8"))
