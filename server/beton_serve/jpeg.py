"""JPEG decoding through libjpeg-turbo (the ``simplejpeg`` wheel, which releases the GIL).

Pixel parity with FFCV: FFCV calls ``tjDecompress2(..., TJPF_RGB, TJFLAG_FASTDCT)`` (the fast
integer IDCT, "fancy" chroma upsampling). ``decode_into`` uses ``fastdct=True,
fastupsample=False``, which reproduces FFCV's pixels bit for bit on the FFCV-written fixtures.

Unlike FFCV, which ignores libjpeg-turbo's return code and hands out garbage pixels for a
truncated or corrupt file, every function here decodes with ``strict=True`` and raises
:class:`CorruptJPEGError` instead.

DCT-domain scaling: libjpeg-turbo can decode at ``M/8`` of the stored size, doing less IDCT work
and producing an area-like downscale. Only factors of 1/2 and below are fast (the 7/8, 3/4 and 5/8
IDCTs have no SIMD path and are *slower* than a full decode), so :func:`decode_into` scales only
by factors >= 2 (``1/2, 3/8, 1/4, 1/8`` of the side), and only when asked for a minimum size that
allows it.

The crop decoders prefer libjpeg-turbo's TurboJPEG 3 API (:mod:`beton_serve._tj3`), which
decodes only a crop's rectangle at any scale ``M/8``; :func:`resolve_backend` picks it, or falls
back to this module's ``simplejpeg`` path with one logged reason (docs/jpeg-decode.md).
"""

from __future__ import annotations

import logging
import threading

import numpy as np
from numpy.typing import NDArray

from beton_serve.errors import PipelineError, SpecError

__all__ = [
    "JPEG_BACKENDS",
    "CorruptJPEGError",
    "check_size",
    "decode_into",
    "read_header",
    "resolve_backend",
    "scaled_size",
]

log = logging.getLogger(__name__)

#: Values of the crop decoders' ``jpeg_backend`` argument.
JPEG_BACKENDS = ("auto", "tj3", "simplejpeg")

_fallback_lock = threading.Lock()
_fallback_logged: set[str] = set()


class CorruptJPEGError(PipelineError):
    """A stored JPEG could not be decoded (truncated, corrupt, or not a JPEG)."""


def resolve_backend(requested: str) -> str:
    """The JPEG backend a crop decoder uses: ``"tj3"`` or ``"simplejpeg"``.

    Args:
        requested: one of :data:`JPEG_BACKENDS`. ``"auto"`` takes TurboJPEG 3 when a library
            is found (see :func:`beton_serve._tj3.load`), else ``simplejpeg``, logging the
            reason once per process (WARNING, naming ``pip install 'beton-serve[tj3]'``).

    Raises:
        SpecError: ``requested`` is unknown, or is ``"tj3"`` and no library is found.
    """
    from beton_serve import _tj3

    if requested not in JPEG_BACKENDS:
        raise SpecError(f"jpeg_backend must be one of {JPEG_BACKENDS}, not {requested!r}")
    if requested == "simplejpeg":
        return "simplejpeg"
    try:
        _tj3.load()
    except _tj3.TJ3Unavailable as exc:
        if requested == "tj3":
            raise SpecError(f"jpeg_backend='tj3': {exc}") from None
        reason = str(exc)
        with _fallback_lock:
            first = reason not in _fallback_logged
            _fallback_logged.add(reason)
        if first:
            log.warning(
                "crop decoders fall back to simplejpeg (full-image decode, slower): %s", reason
            )
        return "simplejpeg"
    return "tj3"


def read_header(data: NDArray[np.uint8] | bytes) -> tuple[int, int]:
    """Return ``(height, width)`` of a JPEG at full size.

    Raises:
        CorruptJPEGError: the header cannot be parsed.
    """
    import simplejpeg

    try:
        h, w, _, _ = simplejpeg.decode_jpeg_header(data, strict=True)
    except ValueError as exc:
        raise CorruptJPEGError(f"cannot read JPEG header: {exc}") from None
    return int(h), int(w)


def check_size(data: NDArray[np.uint8] | bytes, height: int, width: int) -> None:
    """Check that a JPEG is ``height x width`` at full size, as its metadata says.

    The metadata decides allocations and crops; a JPEG of another size (a 32x32 JPEG whose
    metadata says 65535x65535) would otherwise be taken for a DCT-scaled decode, or decoded into
    a buffer sized for the wrong image. Parses the header only (``decode_jpeg_header``):
    measured 2.0 us per image on this project's 2-core host, whatever the image size (1.3 % of
    decoding a 256x256 JPEG, 0.5 % of a 500x375 one); the crop decoders pass the size on to
    :func:`decode_into`, which then skips its own header parse.

    Raises:
        CorruptJPEGError: the header cannot be parsed, or gives another size.
    """
    h, w = read_header(data)
    if (h, w) != (height, width):
        raise CorruptJPEGError(
            f"the JPEG is {h}x{w} (HxW) but the sample's metadata says {height}x{width}"
        )


def scaled_size(height: int, width: int, min_height: int, min_width: int) -> tuple[int, int]:
    """Size libjpeg-turbo produces when decoding at the smallest fast scale >= the minimum.

    The factor ``f`` is the largest of ``1/8, 1/4, 3/8, 1/2`` with ``ceil(height * f) >=
    min_height`` and ``ceil(width * f) >= min_width``; if none fits, or both minima are <= 0
    (no minimum given), ``f = 1`` (full size).
    """
    if min_height <= 0 and min_width <= 0:
        return height, width
    for num in (1, 2, 3, 4):
        h = -((-height * num) // 8)
        w = -((-width * num) // 8)
        if h >= min_height and w >= min_width:
            return h, w
    return height, width


def decode_into(
    data: NDArray[np.uint8] | bytes,
    scratch: NDArray[np.uint8],
    min_height: int = 0,
    min_width: int = 0,
    fast_upsample: bool = False,
    *,
    size: tuple[int, int] | None = None,
) -> NDArray[np.uint8]:
    """Decode a JPEG as RGB into ``scratch`` and return the ``(h, w, 3)`` view of the pixels.

    Args:
        data: the JPEG file bytes (a uint8 array view is fine; no copy is made).
        scratch: a writable, C-contiguous uint8 buffer of at least ``h * w * 3`` bytes for the
            size being produced (``max_H * max_W * 3`` of the dataset always suffices).
        min_height: if > 0 together with ``min_width``, decode at the smallest DCT scale of
            :func:`scaled_size` that keeps the output at least this tall.
        min_width: as ``min_height``, for the width.
        fast_upsample: use libjpeg-turbo's plain (not "fancy") chroma upsampling: about 9%
            faster on 4:2:0 files, chroma edges differ from FFCV's pixels by a few levels.
        size: the full ``(height, width)`` when the caller has read the header already
            (:func:`check_size`), so that it is not parsed twice.

    Returns:
        A view into ``scratch`` of shape ``(h, w, 3)``; it is overwritten by the next call.

    Raises:
        CorruptJPEGError: the data is not a decodable JPEG or ``scratch`` is too small.
    """
    import simplejpeg

    try:
        if min_height > 0 or min_width > 0:
            if size is None:
                h, w, _, _ = simplejpeg.decode_jpeg_header(data, strict=True)
            else:
                h, w = size
            sh, sw = scaled_size(int(h), int(w), min_height, min_width)
            if sh < h or sw < w:
                return simplejpeg.decode_jpeg(  # type: ignore[no-any-return]
                    data,
                    colorspace="RGB",
                    fastdct=True,
                    fastupsample=fast_upsample,
                    min_height=sh,
                    min_width=sw,
                    min_factor=2,
                    buffer=scratch,
                    strict=True,
                )
        return simplejpeg.decode_jpeg(  # type: ignore[no-any-return]
            data,
            colorspace="RGB",
            fastdct=True,
            fastupsample=fast_upsample,
            buffer=scratch,
            strict=True,
        )
    except ValueError as exc:
        raise CorruptJPEGError(f"cannot decode JPEG: {exc}") from None
