"""Crop- and scale-aware JPEG decoding through the TurboJPEG 3 API of libjpeg-turbo (ctypes).

The data structure is one TurboJPEG decompressor handle (``tj3Init(TJINIT_DECOMPRESS)``) per
:class:`Decompressor`, used by one thread at a time. A decode is four C calls on that handle:

1. ``tj3DecompressHeader``: size, chroma subsampling and colour space of the JPEG;
2. ``tj3SetScalingFactor(M/8)``: IDCT straight to ``ceil(side * M / 8)`` pixels (M in 1..8);
3. ``tj3SetCroppingRegion(x, y, w, h)`` in *scaled* pixels: ``x`` must be a multiple of the
   scaled iMCU width (:func:`imcu_width`); rows above ``y`` are entropy-decoded but not
   IDCT-ed/upsampled/colour-converted, rows below ``y + h`` are not decoded at all, columns
   outside ``[x, x + w)`` skip IDCT, upsampling and colour conversion;
4. ``tj3Decompress8(..., TJPF_RGB)`` into a caller-owned buffer (HWC uint8, pitch ``w * 3``).

Two ways to drive it, with the same pixels: :class:`Decompressor` (ctypes, which releases the GIL
around every foreign call), and :func:`batch_kernel`, a numba ``nogil`` loop that calls the same
functions for a whole batch (plan, decode, area resize) without taking the GIL at all.
TurboJPEG 3 reports every failure as a ``-1`` return code with a message (``tj3GetErrorStr``)
and never calls ``exit()``; warnings (a truncated file, corrupt entropy data) also return ``-1``
and are errors here, as ``simplejpeg``'s ``strict=True`` makes them in :mod:`beton_serve.jpeg`.

Where the library comes from (:func:`load`, first match wins):

1. the path in the environment variable ``BETON_SERVE_LIBTURBOJPEG`` (read when the library is
   first needed, not at import);
2. the ``libturbojpeg`` bundled by the ``turbojpeg`` wheel (PyPI ``turbojpeg==0.0.2``, the
   ``beton-serve[tj3]`` extra: libjpeg-turbo 2.1.92, the 3.0 beta with the final TurboJPEG 3
   ABI), found on disk without importing that wheel's own extension module;
3. ``ctypes.util.find_library("turbojpeg")`` if that library exports the TurboJPEG 3 symbols
   (Debian 12's libturbojpeg is 2.1.5: it does not).

When none is found the crop decoders fall back to ``simplejpeg`` (see
:mod:`beton_serve.jpeg`) and log the reason once.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import importlib.util
import logging
import os
import threading
import weakref
from math import gcd
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "DECODABLE_COLORSPACES",
    "ENV_VAR",
    "Decompressor",
    "Header",
    "SCALE_ORDER",
    "TJ3Unavailable",
    "batch_kernel",
    "choose_scale",
    "colorspace_name",
    "ends_with_eoi",
    "imcu_width",
    "live_handles",
    "load",
    "plan_crop",
    "plan_region",
    "scaled",
]

log = logging.getLogger(__name__)

#: Environment variable naming a libturbojpeg (>= 3.0 API) shared library to use.
ENV_VAR = "BETON_SERVE_LIBTURBOJPEG"

# turbojpeg.h (3.0.0; identical in 2.1.91/2.1.92): enum TJINIT, TJPARAM, TJPF, TJCS, TJSAMP.
_TJINIT_DECOMPRESS = 1
_TJPARAM_STOPONWARNING = 0
_TJPARAM_SUBSAMP = 4
_TJPARAM_JPEGWIDTH = 5
_TJPARAM_JPEGHEIGHT = 6
_TJPARAM_PRECISION = 7
_TJPARAM_COLORSPACE = 8
_TJPARAM_FASTUPSAMPLE = 9
_TJPARAM_FASTDCT = 10
_TJPARAM_LOSSLESS = 15
_TJPF_RGB = 0
_TJCS_NAMES = {0: "RGB", 1: "YCbCr", 2: "Gray", 3: "CMYK", 4: "YCCK"}
#: ``TJCS_*`` values that decode to RGB (libjpeg-turbo cannot convert CMYK/YCCK to RGB).
DECODABLE_COLORSPACES = (0, 1, 2)
#: tjMCUWidth[] by TJSAMP_* (444, 422, 420, GRAY, 440, 411, 441); -1 (unknown) cannot be cropped.
_MCU_WIDTH = (8, 16, 16, 8, 8, 32, 8)

_SYMBOLS = (
    "tj3Init",
    "tj3Destroy",
    "tj3Set",
    "tj3Get",
    "tj3DecompressHeader",
    "tj3SetScalingFactor",
    "tj3SetCroppingRegion",
    "tj3Decompress8",
    "tj3GetErrorStr",
)


class TJ3Unavailable(RuntimeError):
    """No libturbojpeg with the TurboJPEG 3 API could be loaded; the message says why."""


class _ScalingFactor(ctypes.Structure):
    _fields_ = (("num", ctypes.c_int), ("denom", ctypes.c_int))


class _Region(ctypes.Structure):
    _fields_ = (
        ("x", ctypes.c_int),
        ("y", ctypes.c_int),
        ("w", ctypes.c_int),
        ("h", ctypes.c_int),
    )


_lock = threading.Lock()
_cache: dict[str, ctypes.CDLL | TJ3Unavailable] = {}
_live = [0]  # handles created and not yet destroyed (tests check for leaks)


def live_handles() -> int:
    """Number of TurboJPEG handles created by :class:`Decompressor` and not yet destroyed."""
    return _live[0]


def _bind(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    missing = [s for s in _SYMBOLS if not hasattr(lib, s)]
    if missing:
        raise TJ3Unavailable(f"{path} lacks the TurboJPEG 3 API ({', '.join(missing)})")
    vp, c_int, size_t = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    lib.tj3Init.argtypes, lib.tj3Init.restype = (c_int,), vp
    lib.tj3Destroy.argtypes, lib.tj3Destroy.restype = (vp,), None
    lib.tj3Set.argtypes, lib.tj3Set.restype = (vp, c_int, c_int), c_int
    lib.tj3Get.argtypes, lib.tj3Get.restype = (vp, c_int), c_int
    lib.tj3DecompressHeader.argtypes = (vp, vp, size_t)
    lib.tj3DecompressHeader.restype = c_int
    lib.tj3SetScalingFactor.argtypes = (vp, _ScalingFactor)
    lib.tj3SetScalingFactor.restype = c_int
    lib.tj3SetCroppingRegion.argtypes = (vp, _Region)
    lib.tj3SetCroppingRegion.restype = c_int
    lib.tj3Decompress8.argtypes = (vp, vp, size_t, vp, c_int, c_int)
    lib.tj3Decompress8.restype = c_int
    lib.tj3GetErrorStr.argtypes, lib.tj3GetErrorStr.restype = (vp,), ctypes.c_char_p
    return lib


def _wheel_library() -> str | None:
    """Path of the libturbojpeg bundled by the ``turbojpeg`` wheel, without importing it."""
    try:
        spec = importlib.util.find_spec("turbojpeg")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    libs = Path(spec.origin).parent / "turbojpeg.libs"
    found = sorted(libs.glob("libturbojpeg*.so*")) if libs.is_dir() else []
    return str(found[0]) if found else None


def _candidates(path: str | None) -> list[tuple[str, str]]:
    if path is not None:
        return [(path, "the path given")]
    env = os.environ.get(ENV_VAR)
    if env:
        # an explicit choice: no silent search past it
        return [(env, f"${ENV_VAR}")]
    out = []
    wheel = _wheel_library()
    if wheel is not None:
        out.append((wheel, "the turbojpeg wheel"))
    system = ctypes.util.find_library("turbojpeg")
    if system is not None:
        out.append((system, "the system library"))
    return out


def load(path: str | None = None) -> ctypes.CDLL:
    """Load (once per path; thread-safe) a libturbojpeg with the TurboJPEG 3 API.

    Args:
        path: a shared library to use; ``None`` searches as the module docstring says.

    Raises:
        TJ3Unavailable: nothing usable was found; the message names what was tried and what
            to install (``pip install 'beton-serve[tj3]'``).
    """
    key = path if path is not None else f"${ENV_VAR}={os.environ.get(ENV_VAR, '')}"
    with _lock:
        hit = _cache.get(key)
        if hit is None:
            tried = []
            for cand, where in _candidates(path):
                try:
                    hit = _bind(cand)
                    break
                except (OSError, TJ3Unavailable) as exc:
                    tried.append(f"{where} ({exc})")
            else:
                why = "; ".join(tried) if tried else "no libturbojpeg found"
                hit = TJ3Unavailable(
                    f"no libjpeg-turbo >= 3 (TurboJPEG 3 API): {why}; "
                    "install it with: pip install 'beton-serve[tj3]'"
                )
            _cache[key] = hit
    if isinstance(hit, TJ3Unavailable):
        raise TJ3Unavailable(str(hit))
    return hit


def scaled(size: int, num: int) -> int:
    """``TJSCALED(size, num/8)``: a side of ``size`` pixels decoded at scale ``num/8``."""
    return -((-size * num) // 8)


def imcu_width(subsamp: int, num: int) -> int:
    """Scaled iMCU width: a cropping region's left edge must be a multiple of it."""
    return scaled(_MCU_WIDTH[subsamp], num)


class Header:
    """What ``tj3DecompressHeader`` reports: ``height``, ``width``, ``subsamp``, ``colorspace``."""

    __slots__ = ("colorspace", "height", "subsamp", "width")

    def __init__(self, height: int, width: int, subsamp: int, colorspace: int) -> None:
        self.height, self.width, self.subsamp, self.colorspace = height, width, subsamp, colorspace


def _destroy(lib: ctypes.CDLL, handle: int) -> None:
    lib.tj3Destroy(handle)
    _live[0] -= 1


class Decompressor:
    """One TurboJPEG 3 decompressor handle; use it from one thread at a time.

    The handle is freed by :meth:`close`, or when the object is collected (``weakref.finalize``),
    e.g. when the worker thread whose ``threading.local`` holds it exits.

    Args:
        lib: from :func:`load`.
        fast_upsample: plain rather than "fancy" (triangle) chroma upsampling.
    """

    def __init__(self, lib: ctypes.CDLL, *, fast_upsample: bool = False) -> None:
        self._lib = lib
        self._fast_upsample = fast_upsample
        self._open()
        # tj3SetScalingFactor accepts only the reduced fractions of its table (1/1, 3/4, ...)
        self._sf = {m: _ScalingFactor(m // gcd(m, 8), 8 // gcd(m, 8)) for m in range(1, 9)}
        self._uncropped = _Region(0, 0, 0, 0)

    def _open(self) -> None:
        lib = self._lib
        handle = lib.tj3Init(_TJINIT_DECOMPRESS)
        if not handle:
            raise MemoryError("tj3Init failed")
        _live[0] += 1
        self._h = handle
        self._finalizer = weakref.finalize(self, _destroy, lib, handle)
        # FFCV decodes with TJFLAG_FASTDCT (the fast integer IDCT); warnings are reported
        # (-1) and treated as errors, but do not stop the decode early.
        for param, value in (
            (_TJPARAM_FASTDCT, 1),
            (_TJPARAM_FASTUPSAMPLE, int(self._fast_upsample)),
            (_TJPARAM_STOPONWARNING, 0),
        ):
            if lib.tj3Set(handle, param, value) != 0:
                self.close()
                raise RuntimeError(f"tj3Set({param}, {value}) failed")

    def reset(self) -> None:
        """Replace the handle with a fresh one (same parameters).

        Why: after ``tj3DecompressHeader`` fails on a corrupt JPEG (a bogus Huffman table, for
        one), libjpeg-turbo leaves the handle mid-header, and every later header on it fails
        with the same message, good JPEGs included. A worker's handle then failed every sample
        after one bad one: errors named the wrong samples, a bad-sample budget skipped good ones,
        and in the daemon, whose plans outlive streams, later clients' good batches failed
        (found by a corrupt-JPEG fuzz, session 25). :meth:`header` and :meth:`decode` reset on
        every failure; the batch kernel's caller resets before redoing a sample it handed back.
        """
        self._finalizer()
        self._open()

    @property
    def handle(self) -> int:
        """The ``tjhandle`` address (for :func:`batch_kernel`); valid until :meth:`close`."""
        return int(self._h)

    def close(self) -> None:
        """Free the handle now (idempotent)."""
        self._finalizer()

    def _error(self, what: str) -> str:
        msg = self._lib.tj3GetErrorStr(self._h)
        text = msg.decode("utf-8", "replace").strip() if msg else "unknown error"
        return f"{what}: {' '.join(text.split())}"

    def header(self, data: NDArray[np.uint8]) -> Header:
        """Parse a JPEG's header.

        Args:
            data: the JPEG file bytes, a 1-D uint8 array (contiguous; not copied).

        Raises:
            ValueError: the header is invalid or the JPEG is not 8-bit lossy baseline or
                progressive (the message is libjpeg-turbo's).
        """
        lib, h = self._lib, self._h
        n = data.shape[0]
        if n == 0 or lib.tj3DecompressHeader(h, data.ctypes.data, n) != 0:
            why = self._error("cannot read JPEG header")
            self.reset()  # the handle is left mid-header: see reset()
            raise ValueError(why)
        if lib.tj3Get(h, _TJPARAM_PRECISION) != 8 or lib.tj3Get(h, _TJPARAM_LOSSLESS):
            raise ValueError("only 8-bit lossy JPEGs are supported")
        return Header(
            lib.tj3Get(h, _TJPARAM_JPEGHEIGHT),
            lib.tj3Get(h, _TJPARAM_JPEGWIDTH),
            lib.tj3Get(h, _TJPARAM_SUBSAMP),
            lib.tj3Get(h, _TJPARAM_COLORSPACE),
        )

    def decode(
        self,
        data: NDArray[np.uint8],
        out: NDArray[np.uint8],
        num: int = 8,
        region: tuple[int, int, int, int] | None = None,
    ) -> None:
        """Decode after :meth:`header` (same ``data``) at scale ``num/8`` into ``out``.

        Args:
            data: the JPEG bytes given to :meth:`header` just before.
            out: C-contiguous uint8 ``(h, w, 3)``: the region's size, or the whole scaled image
                (``scaled(height, num) x scaled(width, num)``) when ``region`` is ``None``.
            num: the scale numerator, 1..8.
            region: ``(x, y, w, h)`` in scaled pixels; ``x`` a multiple of
                :func:`imcu_width`. ``None`` decodes the whole image.

        Raises:
            ValueError: libjpeg-turbo reported an error or a warning (corrupt, truncated).
        """
        lib, h = self._lib, self._h
        if lib.tj3SetScalingFactor(h, self._sf[num]) != 0:
            raise ValueError(self._error("bad scaling factor"))
        r = self._uncropped if region is None else _Region(*region)
        if lib.tj3SetCroppingRegion(h, r) != 0:
            raise ValueError(self._error("bad cropping region"))
        rc = lib.tj3Decompress8(
            h, data.ctypes.data, data.shape[0], out.ctypes.data, out.shape[1] * 3, _TJPF_RGB
        )
        if rc != 0:
            why = self._error("cannot decode JPEG")
            self.reset()
            raise ValueError(why)


# -- crop geometry -----------------------------------------------------------------------------
#: Cost of decoding a whole 4:2:0 JPEG (q90, 448-500 px a side, 12 synthetic images) at scale
#: M/8, relative to 8/8 (589 us), on this project's 2-core host; produced by
#: ``python benchmarks/bench_decode_limit.py --scale-table``. The 7/8, 6/8, 5/8 and 3/8 IDCTs are
#: plain C (libjpeg-turbo vectorises 8/8 and has cheap reduced 4/8, 2/8, 1/8 IDCTs): 7/8..5/8
#: cost *more* than a full-size decode, resize included.
SCALE_DECODE_COST = {8: 1.00, 7: 2.97, 6: 2.28, 5: 1.48, 4: 0.74, 3: 0.90, 2: 0.65, 1: 0.56}
#: Area resize of that whole image to 224x224 at 8/8 (259 us), relative to the 8/8 decode; it
#: scales with the decoded area, ``(M/8)**2``.
SCALE_RESIZE_COST = 0.44
#: Scales from cheapest to dearest by the measured model ``decode[M] + resize * (M/8)**2``:
#: 1, 2, 4, 3, 8, 5, 6, 7. A crop is decoded at the first scale that still covers the output,
#: so 5/8..7/8 are never picked (8/8 always covers and costs less), nor is 3/8 (4/8 covers
#: whatever 3/8 covers, for less).
SCALE_ORDER = tuple(
    sorted(range(1, 9), key=lambda m: SCALE_DECODE_COST[m] + SCALE_RESIZE_COST * (m / 8) ** 2)
)


def choose_scale(ch: int, cw: int, oh: int, ow: int, dct_scale: bool) -> int:
    """Numerator ``M`` of the cheapest scale ``M/8`` at which a ``ch x cw`` crop still covers
    an ``oh x ow`` output (``ch * M / 8 >= oh`` and ``cw * M / 8 >= ow``); 8 without
    ``dct_scale``."""
    if dct_scale:
        for m in SCALE_ORDER:
            if ch * m >= 8 * oh and cw * m >= 8 * ow:
                return m
            if m == 8:
                break
    return 8


def plan_crop(
    hd: Header,
    top: int,
    left: int,
    ch: int,
    cw: int,
    oh: int,
    ow: int,
    dct_scale: bool,
    whole_rows: bool,
) -> tuple[int, tuple[int, int, int, int] | None, int, int, int, int, int, int]:
    """Where to decode a crop: scale, cropping region and the crop inside the decoded pixels.

    The crop ``(top, left, ch, cw)`` of the full-size image maps to the scaled image with both
    edges rounded to the nearest scaled pixel (``round(top * M / 8)`` to ``round((top + ch) * M
    / 8)``), at least the output size, kept inside the image. Against a full decode + the same
    area resize, that rounding gave mean |diff| 1.3-2.0 where the simplejpeg path's
    (``int(top * f)``, ``round(ch * f)``) gave 2.6-5.0 (synthetic images, outputs 32 and 64). The region has that crop's rows exactly and its columns
    widened by one pixel each side (then the left edge aligned down to the scaled iMCU width,
    and at least 16 pixels wide):
    libjpeg-turbo upsamples chroma at a region's edges as at an image's edges, and the extra
    pixel keeps the crop's own pixels identical to a whole-image decode's (tested for 4:4:4,
    4:2:2, 4:2:0, 4:4:0, 4:1:1 and grey). ``whole_rows`` decodes down to the last row (so that a
    truncated file is seen). A JPEG of unknown subsampling cannot be cropped: ``region`` is
    ``None`` (the whole scaled image).

    Returns:
        ``(M, region, out_h, out_w, top, left, ch, cw)``: decode at ``M/8`` the region
        ``(x, y, w, h)`` into an ``out_h x out_w`` image, whose ``[top:top+ch, left:left+cw]``
        is the crop to resize.
    """
    m, cropped, x, y, w, h, top, left, ch, cw = _plan(
        hd.height, hd.width, hd.subsamp, top, left, ch, cw, oh, ow, dct_scale, whole_rows
    )
    if not cropped:
        return m, None, h, w, top, left, ch, cw
    return m, (x, y, w, h), h, w, top, left, ch, cw


def plan_region(
    hd: Header, m: int, top: int, left: int, ch: int, cw: int, whole_rows: bool
) -> tuple[int, int, int, int] | None:
    """The cropping region ``(x, y, w, h)`` to decode for the crop ``(top, left, ch, cw)`` of
    the image scaled to ``m/8`` (see :func:`plan_crop`); ``None`` if it cannot be cropped."""
    cropped, x, y, w, h = _region(hd.height, hd.width, hd.subsamp, m, top, left, ch, cw, whole_rows)
    return (x, y, w, h) if cropped else None


# The two functions below are plain integer arithmetic so that the numba batch kernel compiles
# the very same code (one source of truth for the pixels of both loops).
def _region(height, width, subsamp, m, top, left, ch, cw, whole_rows):  # type: ignore[no-untyped-def]
    """``(cropped, x, y, w, h)``: the region for a scaled crop; ``cropped`` False when the
    subsampling is unknown (then ``w x h`` is the whole scaled image)."""
    sh = -((-height * m) // 8)
    sw = -((-width * m) // 8)
    if subsamp < 0 or subsamp >= 7:
        return False, 0, 0, sw, sh
    a = -((-_MCU_WIDTH[subsamp] * m) // 8)
    x = (left - 1) // a * a if left > 0 else 0
    right = min(sw, left + cw + 1)
    if right - x < _MIN_REGION_WIDTH:
        # libjpeg-turbo upsamples chroma "fancily" only where a component is > 2 samples wide
        # (jdsample.c): a narrower region would get plain upsampling, unlike the whole image
        right = min(sw, x + _MIN_REGION_WIDTH)
        x = max(0, (right - _MIN_REGION_WIDTH) // a * a)
    bottom = sh if whole_rows else top + ch
    return True, x, top, right - x, bottom - top


def _make_plan(region: Any) -> Any:
    """:func:`_plan` calling ``region`` (:func:`_region`, or its compiled twin in the kernel)."""

    def plan(height, width, subsamp, top, left, ch, cw, oh, ow, dct_scale, whole_rows):  # type: ignore[no-untyped-def]
        """:func:`plan_crop` on plain ints: ``(M, cropped, x, y, w, h, top, left, ch, cw)``
        with the crop relative to the decoded ``h x w`` pixels."""
        m = 8
        if dct_scale:
            for cand in SCALE_ORDER:
                if cand == 8:
                    break
                if ch * cand >= 8 * oh and cw * cand >= 8 * ow:
                    m = cand
                    break
        if m != 8:
            sh = -((-height * m) // 8)
            sw = -((-width * m) // 8)
            # both edges rounded to the nearest scaled pixel edge (half up)
            t2 = (top * m * 2 + 8) // 16
            l2 = (left * m * 2 + 8) // 16
            ch = max(oh, min(sh - t2, ((top + ch) * m * 2 + 8) // 16 - t2))
            cw = max(ow, min(sw - l2, ((left + cw) * m * 2 + 8) // 16 - l2))
            top = min(t2, sh - ch)
            left = min(l2, sw - cw)
        cropped, x, y, w, h = region(height, width, subsamp, m, top, left, ch, cw, whole_rows)
        return m, cropped, x, y, w, h, top - y, left - x, ch, cw

    return plan


_plan = _make_plan(_region)


#: Narrowest cropping region (scaled pixels): >= 4 chroma samples for 4:2:x, 4:1:1 at 1/2 scale.
_MIN_REGION_WIDTH = 16


def ends_with_eoi(data: NDArray[np.uint8]) -> bool:
    """Whether the JPEG bytes end with the EOI marker ``FF D9`` (a truncated file does not)."""
    n = data.shape[0]
    return n >= 2 and data[n - 2] == 0xFF and data[n - 1] == 0xD9


# -- the batch kernel (numba, nogil) --------------------------------------------------------
# Scale M/8 as tj3SetScalingFactor wants it: the reduced fraction num/denom.
_SF_NUM = (0, 1, 1, 3, 1, 5, 3, 7, 1)
_SF_DEN = (1, 8, 4, 8, 2, 8, 4, 8, 1)

_kernel_lock = threading.Lock()


class _KernelSlot:
    """One library's kernel: ``ready`` is set once ``kernel`` is built (or failed: ``None``)."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.kernel: object | None = None


_kernels: dict[str, _KernelSlot] = {}


def batch_kernel(lib: ctypes.CDLL, *, wait: bool = True, start: bool = True) -> object | None:
    """The compiled crop-decode loop for ``lib`` (built once per process), or ``None``.

    Args:
        lib: from :func:`load`.
        wait: block until the kernel is compiled (about 2 s, once per process). With
            ``False``, the first call starts compiling it in a background thread and every call
            returns ``None`` until it is ready, so that the first batches run the ctypes loop
            (same pixels) instead of waiting for the compiler.
        start: ``False``: do not start compiling it (return it if it exists). The crop decoders
            start it only once a first batch is done: numba compiles under one process-wide
            lock, so a background compile started earlier delays the first batch's own compiles
            (measured: 7.9 s instead of 5.1 s to a cold first batch).

    ``kernel(handle, start, addrs, lens, eoi, heights, widths, boxes, dct_scale, dst, dflat,
    jbuf, jflat, rbuf, arena, atab) -> (b, need_h, need_w)`` runs without the GIL and calls TurboJPEG
    directly: for samples ``start, start+1, ...`` of the batch (JPEG bytes at ``addrs[b]``,
    ``lens[b]`` long, ``eoi[b]`` whether they end with EOI; metadata size ``heights[b] x
    widths[b]``; crop ``boxes[b]``) it decodes the planned region (:func:`plan_crop`) into the
    top-left corner of ``jbuf`` (``(H, W, 3)`` uint8 scratch; ``jflat`` its flat view), or
    straight into ``dst[b]``, and area-resizes it into ``dst[b]`` (``dst``: C-contiguous ``(B,
    oh, ow, 3)`` uint8, ``dflat`` its flat view; ``rbuf``: the resize's float32 scratch). It
    stops at the first sample it does not finish and returns its index ``b`` (``B`` when all are
    done): ``need_h > 0`` means ``jbuf`` must grow to at least ``need_h x need_w``; ``need_h ==
    -1`` that ``arena`` must grow to at least ``need_w`` bytes, keeping its first ``atab[B, 0]``;
    otherwise the caller handles that sample itself (a raw image, unknown subsampling, or any
    TurboJPEG error: the caller's own decode then raises with libjpeg-turbo's message).

    An upscale (a crop smaller than the output, resized after the kernel) is decoded too: its region
    goes to ``arena`` (uint8, flat) at the running offset ``atab[B, 0]`` (``atab``: int64
    ``(B + 1, ARENA_COLUMNS)``), in rows ``rw * 3`` bytes apart, and ``atab[b]`` gets ``(offset,
    rh, rw, t2, l2, c2, w2)``: the caller resizes ``[t2:t2+c2, l2:l2+w2]`` of it into ``dst[b]``
    once the kernel is done (rows it did not decode keep the caller's ``atab[b, 0] = -1``).

    The struct arguments of ``tj3SetScalingFactor`` and ``tj3SetCroppingRegion`` (two and four
    ``int``) are passed as packed 64-bit integers: that is their calling convention on x86-64
    System V and AArch64 (little-endian); elsewhere this returns ``None`` and the caller keeps
    its ctypes loop. ``None`` too (logged once) if numba cannot build the kernel.
    """
    import platform
    import sys

    if sys.byteorder != "little" or platform.machine().lower() not in (
        "x86_64",
        "amd64",
        "aarch64",
        "arm64",
    ):
        return None
    key = str(lib._name)
    with _kernel_lock:
        slot = _kernels.get(key)
        if slot is None and not start and not wait:
            return None
        start = slot is None
        if slot is None:
            slot = _kernels[key] = _KernelSlot()
    if start:
        if wait:
            _fill(slot, lib)
        else:
            t = threading.Thread(
                target=_fill, args=(slot, lib), name="tj3-kernel-compile", daemon=True
            )
            t.start()
            _compiling.append(t)
    if wait:
        slot.ready.wait()
    return slot.kernel if slot.ready.is_set() else None


#: Background compiles still running; joined at exit, since a process must not finalize while
#: numba compiles on another thread (that crashes the interpreter at shutdown).
_compiling: list[threading.Thread] = []


@atexit.register
def _join_compiles() -> None:
    for t in list(_compiling):
        t.join(timeout=60.0)


def _fill(slot: _KernelSlot, lib: ctypes.CDLL) -> None:
    from beton_serve import _prewarm

    try:
        _prewarm.wait("tj3")  # a helper process may be compiling it into the cache
        slot.kernel = _build_kernel(lib)
    except Exception as exc:  # any numba failure: keep the ctypes loop
        log.warning("TurboJPEG batch kernel unavailable, using the ctypes loop: %r", exc)
    finally:
        slot.ready.set()


def _build_kernel(lib: ctypes.CDLL) -> object:
    kernel, args = _kernel_and_args(lib)
    # compile now, for the argument types the decoders pass, so that a numba failure shows
    # here (and the caller keeps its ctypes loop) rather than in the middle of a batch
    kernel(*args)  # type: ignore[operator]
    # and the call that resizes the upscales the kernel leaves in its arena
    for disp, a in _after_kernel_calls():
        disp(*a)
    return kernel


def _after_kernel_calls() -> list[tuple[Any, tuple[Any, ...]]]:
    """What the decoders call after the batch kernel, with arguments of their types: compiled
    (or loaded from the compile cache) together with it."""
    from beton_serve._kernels.crops import example_args, resize_crops

    return [(resize_crops, example_args())]


def kernel_cached(lib: ctypes.CDLL) -> bool:
    """Whether the batch kernel of ``lib`` and the upscale call after it are compiled in this
    process or their machine code is in the compile cache (then :func:`batch_kernel`
    ``(wait=True)`` only loads them, in milliseconds, and the first batch can run it). Never
    raises."""
    try:
        from beton_serve.pipeline.compile_cache import default_store, entry_key

        store = default_store()
        for disp, args in [_kernel_and_args(lib), *_after_kernel_calls()]:
            sig = tuple(disp.typeof_pyval(a) for a in args)  # type: ignore[attr-defined]
            if sig in disp.overloads:  # type: ignore[attr-defined]
                continue
            key = entry_key(disp, args)
            if store is None or key is None or not store.has(key):
                return False
        return True
    except Exception:
        return False


_made: dict[str, tuple[object, tuple[Any, ...]]] = {}

#: Columns of the batch kernel's upscale table: offset, rh, rw, t2, l2, c2, w2.
ARENA_COLUMNS = 7


def _kernel_and_args(lib: ctypes.CDLL) -> tuple[object, tuple[Any, ...]]:
    """The batch kernel's dispatcher (not compiled yet) and arguments of the types the
    decoders pass (an empty batch); made once per library and process (the look-ups of
    :func:`kernel_cached` and ``_prewarm`` and the build share it)."""
    key = str(lib._name)
    with _kernel_lock:
        made = _made.get(key)
        if made is None:
            made = _made[key] = _make_kernel_and_args(lib)
    return made


def _make_kernel_and_args(lib: ctypes.CDLL) -> tuple[object, tuple[Any, ...]]:
    import llvmlite.binding as llvm
    from numba import types

    from beton_serve._kernels.resize import area_resize
    from beton_serve.pipeline.compiler import Compiler

    # The library's symbols are bound by name for LLVM (not as ctypes function pointers, whose
    # addresses numba would bake into the code): the kernel's machine code then holds no
    # address of this process, so the persistent compile cache (issue 14) can keep it. The
    # library must be loaded into LLVM's symbol table before the kernel is built or loaded.
    llvm.load_library_permanently(str(lib._name))
    c_int, ptr, i64 = types.intc, types.uintp, types.int64
    header: Any = types.ExternalFunction("tj3DecompressHeader", c_int(ptr, ptr, ptr))
    get: Any = types.ExternalFunction("tj3Get", c_int(ptr, c_int))
    set_scale: Any = types.ExternalFunction("tj3SetScalingFactor", c_int(ptr, i64))
    set_crop: Any = types.ExternalFunction("tj3SetCroppingRegion", c_int(ptr, i64, i64))
    decompress: Any = types.ExternalFunction(
        "tj3Decompress8", c_int(ptr, ptr, ptr, ptr, c_int, c_int)
    )
    plan = Compiler.compile(_make_plan(Compiler.compile(_region)))
    sf_num, sf_den = _SF_NUM, _SF_DEN
    p_h, p_w, p_sub, p_cs = (
        _TJPARAM_JPEGHEIGHT,
        _TJPARAM_JPEGWIDTH,
        _TJPARAM_SUBSAMP,
        _TJPARAM_COLORSPACE,
    )
    p_prec, p_lossless = _TJPARAM_PRECISION, _TJPARAM_LOSSLESS

    def kernel(
        handle,
        start,
        addrs,
        lens,
        eoi,
        heights,
        widths,
        boxes,
        dct,
        dst,
        dflat,
        jbuf,
        jflat,
        rbuf,
        arena,
        atab,
    ):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
        n = addrs.shape[0]
        oh = dst.shape[1]
        ow = dst.shape[2]
        row = oh * ow * 3
        for b in range(start, n):
            top, left, ch, cw = boxes[b, 0], boxes[b, 1], boxes[b, 2], boxes[b, 3]
            nbytes = lens[b]
            if nbytes == 0:
                return b, 0, 0
            up = ch < oh or cw < ow
            if header(handle, addrs[b], nbytes) != 0:
                return b, 0, 0
            height = get(handle, p_h)
            width = get(handle, p_w)
            sub = get(handle, p_sub)
            cs = get(handle, p_cs)
            if height != heights[b] or width != widths[b] or cs < 0 or cs > 2:
                return b, 0, 0
            if get(handle, p_prec) != 8 or get(handle, p_lossless) != 0:
                return b, 0, 0
            m, cropped, x, y, rw, rh, t2, l2, c2, w2 = plan(
                height, width, sub, top, left, ch, cw, oh, ow, dct, not eoi[b]
            )
            if not cropped:
                return b, 0, 0
            if set_scale(handle, (np.int64(sf_den[m]) << 32) | sf_num[m]) != 0:
                return b, 0, 0
            if set_crop(handle, (np.int64(y) << 32) | x, (np.int64(rh) << 32) | rw) != 0:
                return b, 0, 0
            if up:
                # an upscale (resized by the caller): the region goes to the arena, at the
                # running position atab[n, 0], and its place and crop to atab[b]
                pos = atab[n, 0]
                size = rh * rw * 3
                if pos + size > arena.shape[0]:
                    return b, -1, pos + size
                if decompress(handle, addrs[b], nbytes, arena[pos:].ctypes.data, rw * 3, 0) != 0:
                    return b, 0, 0
                atab[b, 0], atab[b, 1], atab[b, 2], atab[b, 3] = pos, rh, rw, t2
                atab[b, 4], atab[b, 5], atab[b, 6] = l2, c2, w2
                atab[n, 0] = pos + size
                continue
            out = dst[b]
            if rh == oh and rw == ow and c2 == oh and w2 == ow:
                # the region is the output: decode straight into the batch row
                if decompress(handle, addrs[b], nbytes, out.ctypes.data, ow * 3, 0) != 0:
                    return b, 0, 0
                continue
            if rh > jbuf.shape[0] or rw > jbuf.shape[1]:
                return b, rh, rw
            # the region fills the top-left corner of jbuf, rows jbuf.shape[1] pixels apart
            pitch = jbuf.shape[1] * 3
            if decompress(handle, addrs[b], nbytes, jbuf.ctypes.data, pitch, 0) != 0:
                return b, 0, 0
            area_resize(jbuf, jflat, t2, l2, c2, w2, out, dflat[b * row : (b + 1) * row], rbuf)
        return n, 0, 0

    none_i, none_u = np.zeros(0, np.int64), np.zeros(0, np.uint64)
    jbuf = np.zeros((1, 1, 3), np.uint8)
    dst = np.zeros((0, 1, 1, 3), np.uint8)
    args = (
        0,
        0,
        none_u,
        none_i,
        np.zeros(0, np.bool_),
        none_i,
        none_i,
        np.zeros((0, 4), np.int64),
        True,
        dst,
        dst.reshape(-1),
        jbuf,
        jbuf.reshape(-1),
        np.zeros(1, np.float32),
        np.zeros(1, np.uint8),
        np.zeros((1, ARENA_COLUMNS), np.int64),
    )
    return Compiler.compile(kernel), args


def colorspace_name(cs: int) -> str:
    """Name of a ``TJCS_*`` value."""
    return _TJCS_NAMES.get(cs, f"unknown ({cs})")
