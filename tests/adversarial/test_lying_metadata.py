# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""Issue 11 §10: image metadata that lies about a JPEG's size is a bad sample, never garbage.

On an earlier main, a sample whose metadata said 65535x65535 while its JPEG was 32x32 was decoded
by CenterCropRGBImageDecoder without complaint (the height mismatch was taken for a DCT-scaled
decode: the crop was taken from the wrong place), RandomResizedCropRGBImageDecoder did the same,
SimpleRGBImageDecoder refused the whole file, and a file whose every record lied made
SimpleRGBImageDecoder raise numpy's MemoryError. Now every decoder checks each JPEG's header
against its metadata: a mismatch is a ``PipelineError`` naming the sample, which a bad-sample
budget skips; the rest of the file decodes to the right pixels.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from beton_client import Loader as ServedLoader
from beton_client.errors import PipelineError as ClientPipelineError
from beton_serve.errors import PipelineError, SpecError
from beton_serve.fields.decoders import (
    CenterCropRGBImageDecoder,
    IntDecoder,
    RandomResizedCropRGBImageDecoder,
    SimpleRGBImageDecoder,
)
from beton_serve.loader import Loader as InProcessLoader
from helpers.daemon import daemon_factory, short_tmp  # noqa: F401
from helpers.lying_metadata import patch_image_size, pixel_value, write_images

N, BAD, BATCH = 16, 5, 4
#: (height, width) the bad sample's metadata claims; its JPEG is 32x32. 16x16 is a lie a DCT
#: scale (1/2) explains, 65535x65535 one that would size every buffer for 12 GiB images.
LIES = [(65535, 65535), (16, 16)]
DECODERS = {
    "simple": SimpleRGBImageDecoder,
    "center_crop": lambda: CenterCropRGBImageDecoder((16, 16), 0.5),
    "rrc": lambda: RandomResizedCropRGBImageDecoder((16, 16)),
}


def _pipelines(decoder: str) -> dict[str, list[object]]:
    return {"image": [DECODERS[decoder]()], "label": [IntDecoder()]}


@pytest.fixture(params=LIES, ids=lambda hw: f"{hw[0]}x{hw[1]}")
def lying_file(request, tmp_path: Path) -> Path:
    path = write_images(tmp_path / "lying.beton", N)
    patch_image_size(path, BAD, *request.param)
    return path


def _check_contents(images: np.ndarray, labels: np.ndarray) -> None:
    """Every image is its own label's solid colour: nothing decoded from the wrong place."""
    labels = np.asarray(labels).reshape(-1)
    assert BAD not in labels.tolist()
    for img, label in zip(np.asarray(images), labels, strict=True):
        assert np.abs(img.astype(int) - pixel_value(int(label))).max() <= 3, int(label)


def _epoch(loader) -> list[int]:
    seen = []
    for images, labels in loader:
        _check_contents(images, labels)
        seen.extend(np.asarray(labels).reshape(-1).tolist())
    return seen


@pytest.mark.parametrize("decoder", list(DECODERS))
def test_in_process_a_lying_sample_is_a_pipeline_error_naming_it(lying_file, decoder) -> None:
    loader = InProcessLoader(lying_file, BATCH, num_workers=1, pipelines=_pipelines(decoder))
    seen: list[int] = []
    with pytest.raises(PipelineError, match=rf"sample {BAD}\b.*JPEG is 32x32") as info:
        for images, labels in loader:
            _check_contents(images, labels)  # batches before the bad one are right
            seen.extend(np.asarray(labels).reshape(-1).tolist())
    assert info.value.sample_index == BAD
    assert seen == list(range(BAD // BATCH * BATCH))


@pytest.mark.parametrize("decoder", list(DECODERS))
def test_in_process_a_lying_sample_is_skipped_under_a_budget(lying_file, decoder) -> None:
    loader = InProcessLoader(
        lying_file,
        BATCH,
        num_workers=1,
        pipelines=_pipelines(decoder),
        bad_sample_budget=1,
        drop_last=False,
    )
    for _ in range(2):  # per epoch, epoch after epoch
        assert set(_epoch(loader)) == set(range(N)) - {BAD}


def test_every_record_lying_is_a_typed_error_not_memory_error(tmp_path: Path) -> None:
    # SimpleRGBImageDecoder sizes its output from the metadata: 64 x 65535 x 65535 x 3 bytes.
    path = write_images(tmp_path / "all.beton", 4)
    for i in range(4):
        patch_image_size(path, i, 65535, 65535)
    loader = InProcessLoader(path, 64, num_workers=1, pipelines=_pipelines("simple"))
    with pytest.raises((SpecError, PipelineError)) as info:
        for _ in loader:
            pass
    assert not isinstance(info.value, MemoryError)
    assert "65535" in str(info.value)


@pytest.mark.slow
def test_served_a_lying_sample_fails_its_stream_naming_it(daemon_factory, short_tmp: Path) -> None:
    files = []
    for k, (h, w) in enumerate(LIES):
        files.append(write_images(short_tmp / f"lie{k}.beton", N))
        patch_image_size(files[-1], BAD, h, w)
    d = daemon_factory(files)
    for k in range(len(LIES)):
        for decoder in DECODERS:
            loader = ServedLoader(
                f"lie{k}", BATCH, pipelines=_pipelines(decoder), server=d.address, copy=True
            )
            seen: list[int] = []
            try:
                with pytest.raises(ClientPipelineError, match=rf"sample {BAD}\b") as info:
                    for images, labels in loader:
                        _check_contents(images, labels)
                        seen.extend(np.asarray(labels).reshape(-1).tolist())
                assert "JPEG is 32x32" in str(info.value), (decoder, str(info.value))
                assert seen == list(range(BAD // BATCH * BATCH))
            finally:
                loader.close()
    assert d.proc.poll() is None  # the daemon serves on


@pytest.mark.slow
def test_served_a_lying_sample_is_skipped_under_a_budget(daemon_factory, short_tmp: Path) -> None:
    path = write_images(short_tmp / "lie.beton", N)
    patch_image_size(path, BAD, 65535, 65535)
    d = daemon_factory([path], args=["--bad-sample-budget", "1"])
    for decoder in DECODERS:
        loader = ServedLoader(
            "lie",
            BATCH,
            pipelines=_pipelines(decoder),
            server=d.address,
            drop_last=False,
            copy=True,
        )
        try:
            for _ in range(2):
                assert set(_epoch(loader)) == set(range(N)) - {BAD}, decoder
        finally:
            loader.close()
    assert sum(x.bad_samples for x in d.stats().datasets) >= 1
