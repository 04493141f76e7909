"""A PlanCache hands compiled functions only to plans over the same file (not the same path).

The generated JPEG decoder closes over its file's columns (each sample's pointer, size, mode),
so functions compiled for one file and reused for another at the same path decoded the second
file's bytes at the first file's offsets: a corrupt-JPEG error where those offsets start no
image in it, and where one starts an image of the expected size (the same images written in
another order), that image instead of the sample's (reasoned from the code, not reproduced).
The raw copy reads its pointers per call, but its choice to copy each image at its pointer
(``SimpleRGBImageDecoder.accept_storage``) was made for the first file. On the old key the JPEG
cases below fail with that corrupt-JPEG error, the raw one on the cache's size (one entry for two files).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from beton_serve.fields.decoders import IntDecoder, SimpleRGBImageDecoder
from beton_serve.format import BetonReader
from beton_serve.loader import Loader, OrderOption
from beton_serve.pipeline import PlanCache, compile_pipelines
from scenarios._spawned import write_images

pytestmark = pytest.mark.timeout(240)


def _pipelines() -> dict:
    return {"image": [SimpleRGBImageDecoder()], "label": [IntDecoder()]}


def _read(path: str | Path, cache: PlanCache | None) -> list[tuple[np.ndarray, np.ndarray]]:
    ld = Loader(
        str(path),
        batch_size=4,
        order=OrderOption.SEQUENTIAL,
        pipelines=_pipelines(),
        num_workers=1,
        plan_cache=cache,
    )
    try:
        return [(np.array(img), np.array(lab)) for img, lab in ld]
    finally:
        ld.close()


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1])
        for x, y in zip(a, b, strict=False)
    )


@pytest.mark.parametrize("mode", ["jpg", "raw"])
def test_two_files_at_one_relative_path_each_decode_their_own_pixels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    write_images(tmp_path / "a" / "d.beton", 12, (24, 24), seed=1, write_mode=mode)
    write_images(tmp_path / "b" / "d.beton", 12, (24, 24), seed=2, write_mode=mode)
    cache = PlanCache()
    monkeypatch.chdir(tmp_path / "a")
    from_a = _read("d.beton", cache)
    monkeypatch.chdir(tmp_path / "b")
    from_b = _read("d.beton", cache)
    fresh_b = _read("d.beton", None)
    assert not _same(from_a, fresh_b)  # the two files differ, so the check below means something
    assert _same(from_b, fresh_b)
    assert len(cache) == 2


def test_a_file_rewritten_at_its_path_is_not_decoded_with_the_old_files_functions(
    tmp_path: Path,
) -> None:
    path = tmp_path / "d.beton"
    write_images(path, 12, (24, 24), seed=1, write_mode="jpg")
    cache = PlanCache()
    before = _read(path, cache)
    write_images(tmp_path / "new.beton", 12, (24, 24), seed=3, write_mode="jpg")
    os.replace(tmp_path / "new.beton", path)
    after = _read(path, cache)
    fresh = _read(path, None)
    assert not _same(before, fresh)
    assert _same(after, fresh)


def test_the_same_file_opened_again_reuses_the_compiled_functions(tmp_path: Path) -> None:
    path = write_images(tmp_path / "d.beton", 8, (16, 16), seed=1, write_mode="raw")
    cache = PlanCache()
    plans = []
    for _ in range(2):
        reader = BetonReader(str(path))
        plans.append(compile_pipelines(reader, _pipelines(), batch_size=4, cache=cache))
    assert len(cache) == 1
    p1, p2 = plans
    assert p1.fn_of(p1.nodes[0].op) is p2.fn_of(p2.nodes[0].op)


def test_a_reader_that_cannot_name_its_file_gets_nothing_cached(tmp_path: Path) -> None:
    path = write_images(tmp_path / "d.beton", 8, (16, 16), seed=1, write_mode="raw")
    reader = BetonReader(str(path))
    del reader.identity
    cache = PlanCache()
    compile_pipelines(reader, _pipelines(), batch_size=4, cache=cache)
    assert len(cache) == 0
