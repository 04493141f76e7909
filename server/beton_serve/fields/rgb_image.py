"""RGB images (type 2; mirrors ``ffcv.fields.rgb_image.RGBImageField``).

Metadata is the packed struct ``{mode u1, width <u2, height <u2, data_ptr <u8}`` (13 bytes,
alignment 1); ``mode`` is 0 for JPEG and 1 for raw. Each image is exactly one allocation: a
complete JPEG file, or ``height * width * 3`` bytes of HWC RGB in C order. Nothing is stored in
the argument blob, so the write options are not recoverable from a file.

Encoding one image (what FFCV 1.0.2 does, plus the documented conversions):

1. Input conversion. A PIL image is converted with ``img.convert("RGB")``; modes of more than 8
   bits per channel (``I``, ``I;16*``, ``F``) raise ``ValueError``, as their uint16/int32/float
   arrays do in FFCV (``convert`` would clip them). A ``uint8`` array may
   be ``(H, W)`` or ``(H, W, 1)`` (grayscale: the channel is replicated to R, G and B),
   ``(H, W, 3)`` (RGB, taken as is) or ``(H, W, 4)`` (RGBA: the alpha channel is dropped, colour
   channels are kept unchanged, as PIL's ``convert("RGB")`` does). Anything else raises
   ``ValueError``. FFCV rejects grayscale and RGBA.
2. ``max_resolution``: if ``ratio = max_resolution / max(W, H) < 1`` the image is resized to
   ``(int(ratio * W), int(ratio * H))`` with ``cv2.INTER_AREA`` (each side at least 1 pixel;
   FFCV crashes there). Images are never upscaled.
3. Mode: ``raw``; ``jpg``; ``smart`` = JPEG iff ``smart_threshold`` is set and
   ``H * W * 3 > smart_threshold`` (only then is the JPEG encoded; FFCV always encodes);
   ``proportion`` = JPEG iff ``rng.random() < compress_probability``, where ``rng`` is the
   per-sample generator the writer derives from its seed, or FFCV's global ``np.random`` without
   a seed. Without a seed the draw is made when the sample is stored (``encode_prepared``, on
   the writer's packing thread, in write order), once per try as in FFCV: a sample that spills
   to a new page is encoded again and draws again, so the global stream stays in step with
   FFCV's one-worker writer (and the JPEG of such a sample is encoded on that thread).
4. JPEG: ``cv2.imencode(".jpg", BGR image, [IMWRITE_JPEG_QUALITY, q])``, as FFCV.
5. Width and height are stored as ``u16``: a stored side above 65535 raises ``ValueError``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from beton_serve.fields.base import AllocationCheck, Field, Malloc, lazy_decoders, zero_args
from beton_serve.format import RGB_META_DTYPE

__all__ = ["RGBImageField", "encode_jpeg", "resize_to_max", "to_rgb_array"]

_MODES = ("raw", "jpg", "smart", "proportion")
_MAX_SIDE = 65535


#: ``_Prepared.mode`` of an unseeded ``proportion`` image: drawn when stored (module docstring).
_UNDRAWN = -1


class _Prepared(NamedTuple):
    mode: int  # 0 = jpg, 1 = raw, _UNDRAWN = raw data, the mode drawn when stored
    height: int
    width: int
    data: NDArray[np.uint8]  # 1-D, the bytes to store


def to_rgb_array(value: Any) -> NDArray[np.uint8]:
    """Apply the input conversion rule of the module docstring; returns ``(H, W, 3)`` uint8."""
    if hasattr(value, "convert") and hasattr(value, "mode") and not isinstance(value, np.ndarray):
        mode = str(value.mode)  # a PIL image
        if mode in ("I", "F") or mode.startswith("I;"):
            # convert("RGB") clips these to 0/255 (or zeros a 0..1 float image) without a word
            raise ValueError(
                f"PIL image mode {mode!r} has more than 8 bits per channel; scale it to 8-bit "
                "(mode 'L' or 'RGB') first (FFCV refuses it too: it needs uint8)"
            )
        value = value.convert("RGB")
    arr = np.asarray(value)
    if arr.dtype != np.uint8:
        raise ValueError(f"images must be uint8 arrays, got {arr.dtype}")
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[:, :, 0]
    if arr.ndim == 2:
        return np.ascontiguousarray(np.repeat(arr[:, :, None], 3, axis=2))
    if arr.ndim == 3 and arr.shape[2] == 4:
        return np.ascontiguousarray(arr[:, :, :3])
    if arr.ndim == 3 and arr.shape[2] == 3:
        return arr
    raise ValueError(
        f"images must be (H, W), (H, W, 1), (H, W, 3) or (H, W, 4) uint8, got shape {arr.shape}"
    )


def _max_resolution(value: Any) -> float:
    """``max_resolution`` as FFCV uses it (the number as given: ``100.5`` keeps its half), or
    ``ValueError`` for anything but a finite number >= 1."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"max_resolution must be a number >= 1 or None, got {value!r}")
    if not math.isfinite(float(value)) or value < 1:
        raise ValueError(f"max_resolution must be a finite number >= 1, got {value!r}")
    return int(value) if float(value).is_integer() else float(value)


def resize_to_max(image: NDArray[np.uint8], max_resolution: float | None) -> NDArray[np.uint8]:
    """FFCV's ``max_resolution`` rule (never upscales; INTER_AREA)."""
    if max_resolution is None:
        return image
    h, w = image.shape[:2]
    ratio = max_resolution / max(w, h)
    if ratio >= 1:
        return image
    import cv2

    new_w, new_h = max(1, int(ratio * w)), max(1, int(ratio * h))
    return np.asarray(cv2.resize(image, (new_w, new_h), interpolation=cv2.INTER_AREA))


def encode_jpeg(image: NDArray[np.uint8], quality: int) -> NDArray[np.uint8]:
    """JPEG-encode an ``(H, W, 3)`` RGB image exactly as FFCV does (OpenCV, BGR input)."""
    import cv2

    if image.shape[0] == 0 or image.shape[1] == 0:
        raise ValueError(f"cannot encode an empty image of shape {image.shape}")
    bgr = cv2.cvtColor(np.ascontiguousarray(image), cv2.COLOR_RGB2BGR)
    ok, buf = cv2.imencode(".jpg", bgr, [int(cv2.IMWRITE_JPEG_QUALITY), int(quality)])
    if not ok:
        raise ValueError(f"OpenCV failed to JPEG-encode an image of shape {image.shape}")
    return np.asarray(buf, dtype=np.uint8).reshape(-1)


class RGBImageField(Field):
    """An RGB image per sample (decoded by ``SimpleRGBImageDecoder`` by default).

    Args:
        write_mode: ``'raw'``, ``'jpg'``, ``'smart'`` or ``'proportion'``.
        max_resolution: maximum side length after resizing (a number >= 1, used as given in
            FFCV's ratio, so a float stays a float), or ``None``.
        smart_threshold: ``smart`` mode stores JPEG iff ``H*W*3 > smart_threshold``.
        jpeg_quality: 0..100, passed to OpenCV.
        compress_probability: probability of JPEG in ``proportion`` mode.

    Raises:
        ValueError: for an unknown ``write_mode`` or out-of-range argument.
    """

    def __init__(
        self,
        write_mode: str = "raw",
        max_resolution: float | None = None,
        smart_threshold: int | None = None,
        jpeg_quality: int = 90,
        compress_probability: float = 0.5,
    ) -> None:
        if write_mode not in _MODES:
            raise ValueError(f"write_mode must be one of {_MODES}, got {write_mode!r}")
        if max_resolution is not None:
            max_resolution = _max_resolution(max_resolution)
        if not 0 <= int(jpeg_quality) <= 100:
            raise ValueError(f"jpeg_quality must be in [0, 100], got {jpeg_quality}")
        if not 0.0 <= float(compress_probability) <= 1.0:
            raise ValueError(f"compress_probability must be in [0, 1], got {compress_probability}")
        self.write_mode = write_mode
        self.max_resolution = max_resolution
        self.smart_threshold = smart_threshold
        self.jpeg_quality = int(jpeg_quality)
        self.compress_probability = float(compress_probability)

    @property
    def metadata_type(self) -> np.dtype:
        return RGB_META_DTYPE

    @staticmethod
    def from_binary(binary: NDArray[np.uint8]) -> RGBImageField:
        if np.any(np.asarray(binary)):
            raise ValueError("RGBImageField stores an all-zero argument blob; this one is not")
        return RGBImageField()

    def to_binary(self) -> NDArray[np.uint8]:
        return zero_args()

    def _wants_jpeg(self, image: NDArray[np.uint8], rng: np.random.Generator | None) -> bool:
        if self.write_mode == "jpg":
            return True
        if self.write_mode == "raw":
            return False
        if self.write_mode == "smart":
            return self.smart_threshold is not None and image.size > self.smart_threshold
        draw = rng.random() if rng is not None else np.random.rand()
        return bool(draw < self.compress_probability)

    def prepare(self, value: Any, rng: np.random.Generator | None = None) -> _Prepared:
        image = resize_to_max(to_rgb_array(value), self.max_resolution)
        h, w = int(image.shape[0]), int(image.shape[1])
        if h > _MAX_SIDE or w > _MAX_SIDE:
            raise ValueError(
                f"image of {h}x{w} (HxW) exceeds the format's 65535-pixel side limit; "
                "set max_resolution"
            )
        if h == 0 or w == 0:
            raise ValueError(f"image of {h}x{w} (HxW) is empty")
        if self.write_mode == "proportion" and rng is None:
            return _Prepared(_UNDRAWN, h, w, np.ascontiguousarray(image).reshape(-1))
        if self._wants_jpeg(image, rng):
            return _Prepared(0, h, w, encode_jpeg(image, self.jpeg_quality))
        return _Prepared(1, h, w, np.ascontiguousarray(image).reshape(-1))

    def encode_prepared(self, destination: np.ndarray, prepared: Any, malloc: Malloc) -> None:
        if prepared.mode == _UNDRAWN:  # FFCV's draw, now, in write order (once per try)
            h, w, data = prepared.height, prepared.width, prepared.data
            if self._wants_jpeg(data, None):
                prepared = _Prepared(0, h, w, encode_jpeg(data.reshape(h, w, 3), self.jpeg_quality))
            else:
                prepared = _Prepared(1, h, w, data)
        ptr, buf = malloc(int(prepared.data.size))
        buf[:] = prepared.data
        destination["mode"] = prepared.mode
        destination["width"] = prepared.width
        destination["height"] = prepared.height
        destination["data_ptr"] = ptr

    def encode(self, destination: np.ndarray, field: Any, malloc: Malloc) -> None:
        prepared = field if isinstance(field, _Prepared) else self.prepare(field)
        self.encode_prepared(destination, prepared, malloc)

    def get_decoder_class(self) -> type:
        from beton_serve.fields.decoders import SimpleRGBImageDecoder

        return SimpleRGBImageDecoder

    def allocation_checks(self, column: np.ndarray) -> list[AllocationCheck]:
        ptrs = np.ascontiguousarray(column["data_ptr"], dtype=np.uint64)
        raw = column["mode"] == 1
        sizes = np.full(ptrs.shape, -1, dtype=np.int64)
        sizes[raw] = (
            column["width"][raw].astype(np.int64) * column["height"][raw].astype(np.int64) * 3
        )
        return [AllocationCheck("RGBImageField data_ptr", ptrs, sizes)]

    def metadata_problem(self, column: np.ndarray) -> tuple[int, str] | None:
        bad = np.flatnonzero(column["mode"] > 1)
        if bad.size:
            i = int(bad[0])
            return i, f"image mode {int(column['mode'][i])} (expected 0 = jpg or 1 = raw)"
        bad = np.flatnonzero((column["width"] == 0) | (column["height"] == 0))
        if bad.size:
            return int(bad[0]), "image has zero width or height"
        return None

    def describe(self) -> dict[str, Any]:
        # Write options are not stored in the file; describe() of a read field shows defaults.
        return {}


# FFCV also exposes its decoders here (e.g. ``ffcv.fields.rgb_image.<Decoder>``).
__getattr__ = lazy_decoders(
    __name__,
    (
        "SimpleRGBImageDecoder",
        "RandomResizedCropRGBImageDecoder",
        "CenterCropRGBImageDecoder",
    ),
)
