"""Small image ``.beton`` files whose metadata lies about one sample's image size.

``write_images(path)`` writes ``n`` JPEG images of ``size x size`` pixels with our
``DatasetWriter``; image ``i`` is a solid colour of value :func:`pixel_value` ``(i)`` and its
``label`` is ``i``, so a batch's contents say which samples it holds. ``patch_image_size`` then
overwrites the ``height``/``width`` of one sample's RGB metadata record in place (the packed
``{mode u1, width <u2, height <u2, data_ptr <u8}`` record of ffcv-format.md §1.4, at
``metadata_offset + sample * record_size + member offset``); the JPEG bytes are untouched and the
file stays valid for the reader (a JPEG allocation has no size to check against).
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
from beton_serve.fields import IntField, RGBImageField
from beton_serve.format import BetonReader
from beton_serve.writer import DatasetWriter

__all__ = ["patch_image_size", "pixel_value", "write_images"]


class _SmallPages(DatasetWriter):
    """4 KiB pages, so that a test file is a few tens of KB (beton-serve reads them)."""

    _MIN_PAGE_SIZE = 4096


def pixel_value(i: int) -> int:
    """The grey level of image ``i`` (distinct per sample, exact through JPEG within +-2)."""
    return (i * 13 + 7) % 250


class _Images:
    def __init__(self, n: int, size: int) -> None:
        self.n, self.size = n, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return np.full((self.size, self.size, 3), pixel_value(i), np.uint8), i


def write_images(path: str | Path, n: int = 16, size: int = 32) -> Path:
    """Write ``n`` JPEG images (``image``) with their ids as labels (``label``) to ``path``."""
    fields = {"image": RGBImageField(write_mode="jpg"), "label": IntField()}
    _SmallPages(path, fields, page_size=4096, num_workers=1).from_indexed_dataset(_Images(n, size))
    return Path(path)


def patch_image_size(
    path: str | Path, sample: int, height: int, width: int, field: str = "image"
) -> None:
    """Make sample ``sample``'s metadata say ``height x width`` (its JPEG stays as it was)."""
    with BetonReader(path) as r:
        member = r.record.fields[f"f{r.field_index(field)}"][1]
        record = r.metadata_offset + sample * r.record_size + member
        meta = r.field_metadata(field).dtype
    with open(path, "r+b") as f:
        f.seek(record + meta.fields["width"][1])
        f.write(struct.pack("<H", width))
        f.seek(record + meta.fields["height"][1])
        f.write(struct.pack("<H", height))
    with BetonReader(path) as r:  # the file is still valid, and says what we wrote
        md = r.field_metadata(field)[sample]
        if (int(md["height"]), int(md["width"])) != (height, width):
            raise RuntimeError(f"patching {path} failed: {md}")
