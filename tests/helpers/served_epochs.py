"""Served against in-process, bit for bit, on the FFCV fixture ``images_jpg.beton``: the
pipelines, the epochs read as copies, and the comparison that several served tests share."""

from __future__ import annotations

from typing import Any

import numpy as np
from beton_serve.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
from beton_serve.transforms import RandomHorizontalFlip, ToTensor

#: (image, label, sample ids) of one batch, copied out of the Loader's buffers.
Batch = tuple[np.ndarray, np.ndarray, np.ndarray]


def rrc_pipelines(size: int) -> dict[str, Any]:
    """RandomResizedCrop ``size`` + flip + ToTensor for ``image``, the label as a tensor, no
    ``weight``."""
    return {
        "image": [
            RandomResizedCropRGBImageDecoder((size, size)),
            RandomHorizontalFlip(),
            ToTensor(),
        ],
        "label": [IntDecoder(), ToTensor()],
        "weight": None,
    }


def read_epochs(ld: Any, n: int) -> list[Batch]:
    """``n`` epochs of ``ld``: each batch's image and label (copied) and its sample ids."""
    out = []
    for _ in range(n):
        for image, label in ld:
            out.append((image.numpy().copy(), label.numpy().copy(), ld.last_sample_ids.copy()))
    return out


def assert_same_epochs(got: list[Batch], want: list[Batch]) -> None:
    """The same batches, in order: sample ids, labels and pixels, bit for bit."""
    assert len(got) == len(want)
    for (gi, gl, gs), (wi, wl, ws) in zip(got, want, strict=True):
        np.testing.assert_array_equal(gs, ws)
        np.testing.assert_array_equal(gl, wl)
        np.testing.assert_array_equal(gi, wi)
