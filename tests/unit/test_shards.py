"""Shards with one schema served as one dataset: one index space, shards in order, diffs named."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from beton_serve.daemon import DatasetTable, EngineBackend
from beton_serve.errors import ConfigError
from beton_serve.fields import BytesField, IntField, NDArrayField, RGBImageField
from beton_serve.fields.decoders import (
    BytesDecoder,
    IntDecoder,
    NDArrayDecoder,
    SimpleRGBImageDecoder,
)
from beton_serve.loader import Loader
from beton_serve.writer import DatasetWriter

pytestmark = pytest.mark.slow  # compiles pipelines (numba)


class _Rows:
    def __init__(self, start: int, n: int, shape: tuple[int, ...] = (2, 3)) -> None:
        self.start, self.n, self.shape = start, n, shape

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        k = self.start + i
        rng = np.random.default_rng(k)
        img = rng.integers(0, 256, (6, 5, 3), dtype=np.uint8)
        return (
            k,
            np.full(self.shape, k, np.float32),
            np.frombuffer(bytes([k % 256]) * (k % 7 + 1), np.uint8),
            img,
        )


def _write(path: Path, start: int, n: int, shape: tuple[int, ...] = (2, 3)) -> Path:
    fields = {
        "id": IntField(),
        "arr": NDArrayField(np.float32, shape),
        "blob": BytesField(),
        "img": RGBImageField(write_mode="raw"),
    }
    DatasetWriter(path, fields, num_workers=1).from_indexed_dataset(_Rows(start, n, shape))
    return path


def _pipes():
    return {
        "id": [IntDecoder()],
        "arr": [NDArrayDecoder()],
        "blob": [BytesDecoder()],
        "img": [SimpleRGBImageDecoder()],
    }


def test_shards_read_as_one_index_space(tmp_path: Path) -> None:
    paths = [
        _write(tmp_path / f"s-{i}.beton", start, n)
        for i, (start, n) in enumerate([(0, 7), (7, 5), (12, 9)])
    ]
    whole = _write(tmp_path / "whole.beton", 0, 21)
    table = DatasetTable({"all": [str(p) for p in paths], "whole": [str(whole)]}, EngineBackend())
    try:
        ds = table.get("all")
        assert ds.num_samples == 21 and ds.reader.num_samples == 21
        outs = []
        for reader in (ds.reader, table.get("whole").reader):
            ld = Loader(
                reader, batch_size=4, pipelines=_pipes(), drop_last=False, num_workers=1, seed=0
            )
            try:
                outs.append([tuple(np.array(x) for x in b) for b in ld])
            finally:
                ld.close()
        a, b = outs
        assert len(a) == len(b) == 6
        for x, y in zip(a, b, strict=True):
            for u, v in zip(x, y, strict=True):
                assert np.array_equal(u, v)
        ids = np.concatenate([x[0].reshape(-1) for x in a])
        assert ids.tolist() == list(range(21))
        # page-aware order works over the combined pages
        assert (ds.reader.sample_pages >= 0).all()
    finally:
        table.close()


def test_shards_with_different_schemas_are_refused_naming_the_field(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.beton", 0, 3)
    b = _write(tmp_path / "b.beton", 3, 3, shape=(3, 2))
    with pytest.raises(ConfigError) as info:
        DatasetTable({"x": [str(a), str(b)]}, EngineBackend())
    assert "'arr'" in str(info.value) and "b.beton" in str(info.value)


def test_a_dataset_served_again_under_its_name_goes_on_from_its_counters(tmp_path: Path) -> None:
    """An on-demand dataset closed when idle and opened again keeps counting from where it was:
    its exported counters (samples, batches, distinct bad samples) never go down."""
    base = _write(tmp_path / "base.beton", 0, 4)
    val = _write(tmp_path / "val.beton", 100, 6)
    table = DatasetTable({"base": [str(base)]}, EngineBackend())
    try:
        ds = table.adopt(table.open_file(str(val)))
        ds.count(batches=2, samples=6)
        ds.note_bad([1, 2])
        ds.note_bad([2])  # distinct ids: still 2
        assert ds.counts() == (6, 2, 2)
        table.remove(ds)
        again = table.adopt(table.open_file(str(val)))
        assert again.name == "val" and again is not ds
        assert again.counts() == (6, 2, 2)
        again.count(batches=1, samples=3)
        again.note_bad([2, 5])  # a new life: its ids counted on top of the 2 before
        assert again.counts() == (9, 3, 4)
        # Another name starts at 0.
        other = table.adopt(table.open_file(str(base)))
        assert other.name == "base@2" and other.counts() == (0, 0, 0)
    finally:
        table.close()
