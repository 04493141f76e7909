"""The per-batch loop of a crop decoder built with ``share_decode=True`` (issue 16).

Per sample: the *full* decoded image (never DCT-scaled, so the pixels do not depend on which
member decoded them) from the stream's decode group (:mod:`beton_serve.fields.decode_cache`),
decoded here on a miss or when the stream is in no group; then the decoder's own crop box
(``decoder._crops``: its seeded draws) and the area/OpenCV resize kernel into ``dst``. Raw
(non-JPEG) samples are cropped straight from the file's bytes, as without sharing.

So a stream gives the same batches alone as in a group, and the same pixels as the decoder with
``dct_scale=False`` (FFCV's full decode + resize).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from beton_serve.fields.decode_cache import current_member

__all__ = ["make_shared_loop"]


def make_shared_loop(decoder: Any) -> Callable[..., Any]:
    """The batch function ``run(batch_indices, dst, metadata, storage_state, seed_key=None)``
    of a ``_CropDecoder`` with ``share_decode=True``.

    ``dst`` is ``(B, oh, ow, 3)`` uint8; the function writes row ``b`` from sample
    ``batch_indices[b]`` and returns ``dst``. A corrupt JPEG raises ``CorruptJPEGError`` naming
    the sample, as the decoder's own loop does.
    """
    from beton_serve._kernels import resize as rz
    from beton_serve.fields.decoders import (
        _RGB_MEMBERS,
        _corrupt,
        _ImageColumns,
        _require_metadata,
        _WorkerBuffers,
    )
    from beton_serve.jpeg import CorruptJPEGError, check_size, decode_into

    if decoder._cols is None:
        decoder._cols = _ImageColumns(_require_metadata(decoder, _RGB_MEMBERS))
    cols = decoder._cols
    mem_read = decoder.memory_read
    method = decoder.resize
    fast_up = decoder.fast_upsample
    name = type(decoder).__name__
    crops_of = decoder._crops
    bufs = _WorkerBuffers(cols)
    scratch, solo_buffer = bufs.resize_scratch, bufs.jpeg

    def full_decode(
        data: np.ndarray, sid: int, height: int, width: int, buf: np.ndarray | None = None
    ) -> np.ndarray:
        """The sample's full decode, ``(height, width, 3)``: into ``buf``, or a new array."""
        try:
            check_size(data, height, width)  # metadata that lies is a bad sample (issue 11)
            if buf is None:
                buf = np.empty(height * width * 3, np.uint8)
            img = decode_into(data, buf, 0, 0, fast_up)
        except CorruptJPEGError as exc:
            raise _corrupt(exc, sid, name) from None
        if img.shape != (height, width, 3):
            raise CorruptJPEGError(
                f"JPEG is {img.shape[0]}x{img.shape[1]} but metadata says {height}x{width}",
                sample_index=sid,
                op=name,
            )
        return img

    def run(batch_indices, dst, metadata, storage_state, seed_key=None):
        rbuf = scratch(dst.shape[2])
        boxes = crops_of(batch_indices, seed_key).tolist()
        bound = current_member(metadata)
        # the batch's columns as Python ints, once: per-sample numpy scalar indexing and
        # int() conversions were a visible share of a member's time (issue 16)
        ids = np.asarray(batch_indices, np.int64)
        rows = zip(
            ids.tolist(),
            cols.heights[ids].tolist(),
            cols.widths[ids].tolist(),
            cols.modes[ids].tolist(),
            cols.ptrs[ids].tolist(),
            strict=True,
        )
        samples = [(b, *row, boxes[b]) for b, row in enumerate(rows)]
        later = []
        for sample in samples:
            if not one(sample, dst, storage_state, rbuf, bound, False):
                later.append(sample)  # another member is decoding it: do the others first
        for sample in later:
            one(sample, dst, storage_state, rbuf, bound, True)
        return dst

    def one(sample, dst, storage_state, rbuf, bound, wait) -> bool:
        """Write row ``b`` of ``dst`` from ``sample = (b, sid, height, width, mode, ptr,
        box)``; ``False`` when its image is being decoded by another member and ``wait`` is
        false."""
        b, sid, height, width, mode, ptr, (top, left, ch, cw) = sample
        if mode != 0:
            data = mem_read(ptr, storage_state)
            img = data[: height * width * 3].reshape(height, width, 3)
        elif bound is None:
            data = mem_read(ptr, storage_state)
            img = full_decode(data, sid, height, width, solo_buffer(height * width * 3))
        else:
            member, epoch = bound
            img = member.get(
                sid,
                epoch,
                height * width * 3,
                # the file's bytes are read only by the member that decodes them
                partial(read_and_decode, ptr, storage_state, sid, height, width),
                wait=wait,
            )
            if img is None:
                return False
        rz.resize_crop(img, top, left, ch, cw, dst[b], rbuf, method)
        return True

    def read_and_decode(ptr, storage_state, sid, height, width) -> np.ndarray:
        return full_decode(mem_read(ptr, storage_state), sid, height, width)

    return run
