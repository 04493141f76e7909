"""Test-only helpers for the bad-sample tests (``tests/adversarial/test_bad_samples.py``,
``tests/gpu/test_cuda_ipc_served.py``): a file with slow and fast samples, spoiling samples in a
written file, and a client that reads its notices late."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from beton_serve.format import BetonReader

__all__ = ["BigThenSmall", "SlowFirstRead", "write_big_then_small", "zero_samples"]


class BigThenSmall:
    """Samples 0..3 are 800x800 noise (slow to decode), the rest small; labels are ids."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        rng = np.random.default_rng(i)
        shape = (800, 800, 3) if i < 4 else (24, 32, 3)
        return rng.integers(0, 255, shape, dtype=np.uint8), i


def zero_samples(path: Path, ids: list[int]) -> None:
    """Overwrite the first 64 bytes of each of ``ids``' images (field 0) in ``path`` with
    zeros: a JPEG that no longer starts with its marker."""
    r = BetonReader(str(path))
    try:
        ptrs = [int(r.metadata["f0"]["data_ptr"][i]) for i in ids]
    finally:
        r.close()
    with open(path, "r+b") as f:
        for ptr in ptrs:
            f.seek(ptr)
            f.write(b"\0" * 64)


def write_big_then_small(path: Path, bad: list[int]) -> Path:
    """Write :class:`BigThenSmall` to ``path`` (images as JPEG, labels as ints), then spoil the
    images of the samples in ``bad`` (:func:`zero_samples`); returns ``path``."""
    from beton_serve.fields import IntField, RGBImageField
    from beton_serve.writer import DatasetWriter

    DatasetWriter(
        str(path), {"image": RGBImageField(write_mode="jpg"), "label": IntField()}
    ).from_indexed_dataset(BigThenSmall())
    zero_samples(path, bad)
    return path


class SlowFirstRead:
    """Makes each local stream's (shm, cuda_ipc) first look for a batch come ``delay_s`` late
    (then read, or raise :class:`Gone` when ``then_fail``): a client descheduled after it sent
    its epoch's ``Start``, as on a loaded CI machine, by which time the daemon has published the
    epoch's first batch and hit the error at the next one."""

    class Gone(Exception):
        """The patched client stopped before reading (``then_fail``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, delay_s: float, then_fail: bool) -> None:
        import beton_client._stream as client_stream

        real = client_stream._Stream.next_ready
        seen: set[int] = set()

        def next_ready(stream: Any, *args: Any, **kwargs: Any) -> Any:
            if id(stream) not in seen:
                seen.add(id(stream))
                time.sleep(delay_s)
                if then_fail:
                    raise self.Gone("the client stopped before reading")
            return real(stream, *args, **kwargs)

        monkeypatch.setattr(client_stream._Stream, "next_ready", next_ready)
