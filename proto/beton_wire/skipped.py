"""The samples a grpc batch skipped, as one more array of the batch (``__skipped__``).

Why: under a bad-sample budget a daemon skips a failing sample (it is replaced by the next good
sample of its batch) and charges it to the stream's budget, in batch order. A client that reads
one epoch from several daemons (``server=[...]``) gets each batch from one of them, so each
daemon charges only its own share: with a budget of N the epoch could skip up to N per daemon.
Each grpc batch that skipped samples therefore carries them, and the client charges them against
the budget the daemons announced (``OpenStreamResponse.bad_sample_budget``), in batch order, as
the in-process Loader does; its error is the in-process one, word for word.

Encoding: UTF-8 JSON, a list of ``[sample_id, op, cause_type, cause]``, in a ``uint8`` array
named :data:`SKIPPED`, after the sample ids. A batch that skipped nothing has no such array.
A cause longer than :data:`MAX_CAUSE_CHARS` is cut, so a record is at most
:data:`MAX_RECORD_BYTES` and a batch's array at most :func:`max_bytes` (the client refuses a
batch header that announces more before it allocates anything).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

__all__ = [
    "MAX_CAUSE_CHARS",
    "MAX_RECORD_BYTES",
    "SKIPPED",
    "Skipped",
    "decode",
    "encode",
    "max_bytes",
]

#: The array's name in a grpc batch.
SKIPPED = "__skipped__"
#: Characters of an op's name and of a cause kept (a record is then at most MAX_RECORD_BYTES:
#: JSON escapes a character in at most 6 bytes, ``ensure_ascii``).
MAX_OP_CHARS = 128
MAX_CAUSE_TYPE_CHARS = 128
MAX_CAUSE_CHARS = 1000
MAX_RECORD_BYTES = 6 * (MAX_OP_CHARS + MAX_CAUSE_TYPE_CHARS + MAX_CAUSE_CHARS) + 64


class Skipped(NamedTuple):
    """One sample a batch skipped: its id, the op that failed, and what it raised."""

    sample_id: int
    op: str
    cause_type: str
    cause: str

    def describe(self) -> str:
        """``"CauseType: cause"``: how the in-process Loader's error names it."""
        return f"{self.cause_type}: {self.cause}"


def max_bytes(batch_size: int) -> int:
    """The largest :data:`SKIPPED` array of a batch of ``batch_size`` rows."""
    return 2 + batch_size * (MAX_RECORD_BYTES + 1)


def encode(found: Iterable[tuple[int, str, BaseException]]) -> np.ndarray:
    """``(sample_id, op, cause)`` of each skipped sample as the :data:`SKIPPED` array."""
    rows = [
        [
            int(sample_id),
            str(op)[:MAX_OP_CHARS],
            type(cause).__name__[:MAX_CAUSE_TYPE_CHARS],
            str(cause)[:MAX_CAUSE_CHARS],
        ]
        for sample_id, op, cause in found
    ]
    raw = json.dumps(rows, ensure_ascii=True, separators=(",", ":")).encode("ascii")
    return np.frombuffer(raw, dtype=np.uint8)


def decode(array: np.ndarray) -> list[Skipped]:
    """The records of a :data:`SKIPPED` array.

    Raises:
        ValueError: the array is not such a list (the message says what is wrong).
    """
    try:
        rows = json.loads(np.asarray(array, dtype=np.uint8).tobytes().decode("ascii"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a JSON list of skipped samples: {exc}") from None
    if not isinstance(rows, list):
        raise ValueError(f"not a list of skipped samples: {type(rows).__name__}")
    out = []
    for row in rows:
        if (
            not isinstance(row, list)
            or len(row) != 4
            or type(row[0]) is not int
            or row[0] < 0
            or not all(isinstance(x, str) for x in row[1:])
        ):
            raise ValueError(f"not a skipped-sample record: {str(row)[:120]}")
        out.append(Skipped(row[0], row[1], row[2], row[3]))
    return out
