"""A restarted daemon finds its kernels in the persistent compile cache (issue 14).

The daemon and the test share one cache directory (``BETON_SERVE_CACHE_DIR`` under
``tmp_path``). After the first daemon has served the pipeline, a second daemon, started on the
same cache, serves the same bytes without writing a single new entry: every kernel it needed was
loaded from disk (entries are written only after a compile), and its hits touch the entries.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from beton_client import Loader
from beton_serve.fields import IntField, RGBImageField
from beton_serve.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
from beton_serve.transforms import RandomHorizontalFlip
from beton_serve.writer import DatasetWriter
from helpers.daemon import daemon_factory, short_tmp  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


class _Images:
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        rng = np.random.default_rng(i)
        return rng.integers(0, 256, size=(40 + i, 52 + 2 * i, 3), dtype=np.uint8), i


def _digest(d: Any, data: Path) -> str:
    pipes: dict[str, Any] = {
        "image": [RandomResizedCropRGBImageDecoder((24, 24)), RandomHorizontalFlip()],
        "label": [IntDecoder()],
    }
    h = hashlib.sha256()
    with Loader(
        str(data), batch_size=4, seed=3, pipelines=pipes, server=d.address, spawn=False
    ) as ld:
        for img, label in ld:
            h.update(np.ascontiguousarray(img).tobytes())
            h.update(np.ascontiguousarray(label).tobytes())
    return h.hexdigest()


def test_restarted_daemon_compiles_nothing(
    daemon_factory: Any,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache = tmp_path / "cc"
    monkeypatch.setenv("BETON_SERVE_CACHE_DIR", str(cache))
    data = tmp_path / "img.beton"
    DatasetWriter(
        str(data), {"image": RGBImageField(write_mode="jpg"), "label": IntField()}
    ).from_indexed_dataset(_Images())

    first = daemon_factory([data])
    cold = _digest(first, data)
    first.stop()
    entries = {p.name: p.stat().st_mtime for p in (cache / "kernels").glob("*.nbk")}
    assert entries, "the first daemon saved no kernels"

    time.sleep(0.05)
    restarted = daemon_factory([data])
    t0 = time.time()
    warm = _digest(restarted, data)
    after = {p.name: p.stat().st_mtime for p in (cache / "kernels").glob("*.nbk")}
    assert warm == cold
    assert set(after) == set(entries), "the restarted daemon compiled and saved new kernels"
    assert any(after[n] >= t0 - 1 for n in after)  # hits touch their entries (LRU)
    assert (os.stat(cache).st_mode & 0o777) == 0o700
