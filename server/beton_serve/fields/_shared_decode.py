"""The per-batch loop of a crop decoder built with ``share_decode=True`` (issue 16).

Per sample: the *shared decode* of the image from the stream's decode group
(:mod:`beton_serve.fields.decode_cache`), decoded here on a miss or when the stream is in no
group; then the decoder's own crop box (``decoder._crops``: its seeded draws, in full-size
pixels, mapped onto the shared decode) and the area/OpenCV resize kernel into ``dst``. Raw
(non-JPEG) samples are cropped straight from the file's bytes, as without sharing.

The shared decode is a pure function of the sample's bytes and of the decoder's
``share_min_side`` (which is part of the group's key): the full image when it is 0, else the
image at the scale :func:`shared_scale` picks from its size. So its pixels never depend on which
member decoded them, and a stream gives the same batches alone as in a group. With
``share_min_side=0`` they are the pixels of the decoder with ``dct_scale=False`` (FFCV's full
decode + resize).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
from numpy.typing import NDArray

from beton_serve._tj3 import scaled
from beton_serve.fields.decode_cache import current_member, decode_key

__all__ = ["make_shared_loop", "scaled_box", "scaled_plan", "shared_scale"]

#: The DCT scales ``M/8`` a shared decode may use, cheapest first (``_tj3.SCALE_DECODE_COST``:
#: 1/8, 1/4 and 1/2 cost 0.56-0.74 of a full decode; 3/8 and 5/8-7/8 cost more than 1/2).
_SHARED_SCALES = (1, 2, 4)


def shared_scale(height: int, width: int, min_side: int) -> int:
    """Numerator ``M`` of the scale ``M/8`` at which an ``height x width`` JPEG is decoded for
    its group: the smallest of 1/8, 1/4, 1/2 whose shorter side ``ceil(min(h, w) * M / 8)`` is
    at least ``min_side``; 8 (full size) when none is, or when ``min_side`` is 0."""
    if min_side > 0:
        short = min(height, width)
        for m in _SHARED_SCALES:
            if scaled(short, m) >= min_side:
                return m
    return 8


def scaled_box(
    top: int, left: int, ch: int, cw: int, m: int, sh: int, sw: int
) -> tuple[int, int, int, int]:
    """The crop ``(top, left, ch, cw)`` of the full-size image, in the pixels of its decode at
    scale ``m/8`` (``sh x sw``): both edges rounded to the nearest scaled pixel, at least one
    pixel, inside the image."""
    if m == 8:
        return top, left, ch, cw
    t = min((top * m + 4) // 8, sh - 1)
    lf = min((left * m + 4) // 8, sw - 1)
    b = max(min(((top + ch) * m + 4) // 8, sh), t + 1)
    r = max(min(((left + cw) * m + 4) // 8, sw), lf + 1)
    return t, lf, b - t, r - lf


def scaled_plan(
    heights: np.ndarray, widths: np.ndarray, boxes: np.ndarray, min_side: int
) -> tuple[list[int], list[int], list[tuple[int, int, int, int]]]:
    """For a batch at once: each sample's scale numerator :func:`shared_scale`, the bytes of
    its decode at that scale, and its crop box (``boxes``: ``(B, 4)`` rows ``top, left, ch,
    cw`` in full-size pixels) mapped by :func:`scaled_box` onto that decode. The same integer
    arithmetic as the per-sample functions, in numpy (those calls, per sample, held the GIL
    for a tenth of a member's time)."""
    h = np.asarray(heights, np.int64)
    w = np.asarray(widths, np.int64)
    bx = np.asarray(boxes, np.int64).reshape(-1, 4)
    m: NDArray[np.int64] = np.full(h.shape, 8, np.int64)
    if min_side > 0:
        short = np.minimum(h, w)
        for num in reversed(_SHARED_SCALES):  # the smallest that covers wins: assigned last
            m = np.where(-((-short * num) // 8) >= min_side, num, m)
    sh = -((-h * m) // 8)
    sw = -((-w * m) // 8)
    top, left, ch, cw = bx[:, 0], bx[:, 1], bx[:, 2], bx[:, 3]
    t = np.minimum((top * m + 4) // 8, sh - 1)
    lf = np.minimum((left * m + 4) // 8, sw - 1)
    b = np.maximum(np.minimum(((top + ch) * m + 4) // 8, sh), t + 1)
    r = np.maximum(np.minimum(((left + cw) * m + 4) // 8, sw), lf + 1)
    full = m == 8
    out = np.where(full[:, None], bx, np.stack([t, lf, b - t, r - lf], axis=1))
    ms: list[int] = m.tolist()
    nbytes: list[int] = (sh * sw * 3).tolist()
    return ms, nbytes, [tuple(row) for row in out.tolist()]


def make_shared_loop(decoder: Any) -> Callable[..., Any]:
    """The batch function ``run(batch_indices, dst, metadata, storage_state, seed_key=None)``
    of a ``_CropDecoder`` with ``share_decode=True``.

    ``dst`` is ``(B, oh, ow, 3)`` uint8; the function writes row ``b`` from sample
    ``batch_indices[b]`` and returns ``dst``. A corrupt JPEG raises ``CorruptJPEGError`` naming
    the sample, as the decoder's own loop does.
    """
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
    min_side = int(decoder.share_min_side)
    dkey = decode_key(min_side)
    bufs = _WorkerBuffers(cols)
    scratch, solo_buffer = bufs.resize_scratch, bufs.jpeg

    def shared_decode(
        data: np.ndarray, sid: int, height: int, width: int, m: int, buf: np.ndarray | None = None
    ) -> np.ndarray:
        """The sample's decode at scale ``m/8``: into ``buf``, or a new array."""
        sh, sw = scaled(height, m), scaled(width, m)
        try:
            check_size(data, height, width)  # metadata that lies is a bad sample (issue 11)
            if buf is None:
                buf = np.empty(sh * sw * 3, np.uint8)
            if m == 8:
                img = decode_into(data, buf, 0, 0, fast_up)
            else:
                img = decode_into(data, buf, sh, sw, fast_up, size=(height, width))
        except CorruptJPEGError as exc:
            raise _corrupt(exc, sid, name) from None
        if img.shape != (sh, sw, 3):
            raise CorruptJPEGError(
                f"JPEG decoded to {img.shape[0]}x{img.shape[1]} at scale {m}/8, expected "
                f"{sh}x{sw} from its metadata ({height}x{width})",
                sample_index=sid,
                op=name,
            )
        return img

    def run(batch_indices, dst, metadata, storage_state, seed_key=None):
        rows = _Rows(dst, method, scratch(dst.shape[2]))
        boxes = crops_of(batch_indices, seed_key)
        bound = current_member(metadata, dkey)
        # the batch's columns, scales and boxes as Python ints, once: per-sample numpy scalar
        # indexing, int() conversions and scale arithmetic were a visible share of a member's
        # time (issue 16)
        ids = np.asarray(batch_indices, np.int64)
        heights = cols.heights[ids]
        widths = cols.widths[ids]
        ms, nbytes, scaled_boxes = scaled_plan(heights, widths, boxes, min_side)
        plan = zip(
            ids.tolist(),
            heights.tolist(),
            widths.tolist(),
            cols.modes[ids].tolist(),
            cols.ptrs[ids].tolist(),
            ms,
            nbytes,
            boxes.tolist(),
            scaled_boxes,
            strict=True,
        )
        samples = [(b, *row) for b, row in enumerate(plan)]
        if bound is not None:
            # what other members have decoded already, taken in one lock round trip
            member, epoch = bound
            jpegs = [s for s in samples if s[4] == 0]
            ready = member.take_ready([s[1] for s in jpegs], epoch)
            for s, img in zip(jpegs, ready, strict=True):
                if img is not None:
                    rows.add(s[0], img, s[9])
            samples = [s for s in samples if s[4] != 0]
            samples += [s for s, img in zip(jpegs, ready, strict=True) if img is None]
        later = []
        for sample in samples:
            if not one(sample, storage_state, rows, bound, False):
                later.append(sample)  # another member is decoding it: do the others first
        for sample in later:
            one(sample, storage_state, rows, bound, True)
        rows.flush()
        return dst

    def one(sample, storage_state, rows, bound, wait) -> bool:
        """Queue row ``b`` of the batch on ``rows`` from ``sample = (b, sid, height, width,
        mode, ptr, m, nbytes, box, scaled box)`` (:func:`scaled_plan`); ``False`` when its
        image is being decoded by another member and ``wait`` is false."""
        b, sid, height, width, mode, ptr, m, nbytes, box, sbox = sample
        if mode != 0:
            data = mem_read(ptr, storage_state)
            rows.add(b, data[: height * width * 3].reshape(height, width, 3), box)
            return True
        if bound is None:
            data = mem_read(ptr, storage_state)
            rows.add(b, shared_decode(data, sid, height, width, m, solo_buffer(nbytes)), sbox)
            rows.flush()  # the buffer is this thread's, reused by the next decode
            return True
        member, epoch = bound
        img = member.get(
            sid,
            epoch,
            nbytes,
            # the file's bytes are read only by the member that decodes them
            partial(read_and_decode, ptr, storage_state, sid, height, width, m),
            wait=wait,
        )
        if img is None:
            return False
        rows.add(b, img, sbox)  # sbox: the box on the decode at scale m/8 (== box at 8/8)
        return True

    def read_and_decode(ptr, storage_state, sid, height, width, m) -> np.ndarray:
        return shared_decode(mem_read(ptr, storage_state), sid, height, width, m)

    return run


#: Bytes of images a batch holds for :class:`_Rows` before it resizes them (more only for one
#: larger image): the private decodes of a member that decodes alone are not kept past this.
ROWS_HOLD_BYTES = 32 << 20


class _Rows:
    """The crops of a batch still to resize into their rows of ``dst``, resized together.

    Made and used by one worker thread for one batch. ``add`` keeps the image alive until
    :meth:`flush`, which runs every crop in one call of the compiled
    :func:`~beton_serve._kernels.crops.resize_crops`, taking no GIL between samples: the same
    kernels, so the same pixels, as :func:`~beton_serve._kernels.resize.resize_crop` with
    ``"area"``, which it falls back to per crop (an image that is not C-contiguous, a batch
    buffer that is not). With ``"cv2"`` each crop goes to OpenCV.
    """

    __slots__ = ("_dst", "_held", "_items", "_kernel", "_method", "_scratch")

    def __init__(self, dst: np.ndarray, method: str, scratch: np.ndarray) -> None:
        self._dst = dst
        self._method = method
        self._scratch = scratch
        self._kernel = method == "area" and bool(dst.flags.c_contiguous)
        self._items: list[tuple[int, np.ndarray, tuple[int, int, int, int]]] = []
        self._held = 0

    def add(self, b: int, img: np.ndarray, box: tuple[int, int, int, int]) -> None:
        """Queue ``img[top:top+h, left:left+w]`` (``box``) for row ``b``."""
        self._items.append((b, img, box))
        self._held += img.nbytes
        if self._held > ROWS_HOLD_BYTES:
            self.flush()

    def flush(self) -> None:
        """Resize every queued crop into its row, then drop the images."""
        from beton_serve._kernels import resize as rz

        items, self._items, self._held = self._items, [], 0
        if not items:
            return
        dst = self._dst
        batch = []
        for b, img, box in items:
            if self._kernel and img.flags.c_contiguous:
                batch.append((b, img, box))
            else:
                rz.resize_crop(img, *box, dst[b], self._scratch, self._method)
        if batch:
            from beton_serve._kernels.crops import resize_crops

            addrs = np.array([img.__array_interface__["data"][0] for _, img, _ in batch], np.int64)
            meta = np.array([(b, *img.shape[:2], *box) for b, img, box in batch], np.int64)
            # ``batch`` holds every image until the call returns: the kernel reads them by address
            scratch = self._scratch
            resize_crops(addrs, meta, dst, dst.reshape(-1), scratch, scratch.view(np.int16))
