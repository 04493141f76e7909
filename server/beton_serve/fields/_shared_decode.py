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
        boxes = crops_of(batch_indices, seed_key)
        bound = current_member(metadata)
        later = []
        for b in range(len(batch_indices)):
            if not one(b, batch_indices, dst, storage_state, boxes, rbuf, bound, False):
                later.append(b)  # another member is decoding it: do the others first
        for b in later:
            one(b, batch_indices, dst, storage_state, boxes, rbuf, bound, True)
        return dst

    def one(b, batch_indices, dst, storage_state, boxes, rbuf, bound, wait) -> bool:
        """Write row ``b``; ``False`` when its image is being decoded by another member and
        ``wait`` is false."""
        sid = int(batch_indices[b])
        top, left, ch, cw = (int(v) for v in boxes[b])
        height, width = int(cols.heights[sid]), int(cols.widths[sid])
        data = mem_read(cols.ptrs[sid], storage_state)
        if cols.modes[sid] != 0:
            img = data[: height * width * 3].reshape(height, width, 3)
        elif bound is None:
            img = full_decode(data, sid, height, width, solo_buffer(height * width * 3))
        else:
            member, epoch = bound
            img = member.get(
                sid,
                epoch,
                height * width * 3,
                partial(full_decode, data, sid, height, width),
                wait=wait,
            )
            if img is None:
                return False
        rz.resize_crop(img, top, left, ch, cw, dst[b], rbuf, method)
        return True

    return run
