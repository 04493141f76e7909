"""Decoders: the first op of every field pipeline (mirrors ``ffcv.fields.decoders``).

A decoder reads its field's metadata column (``self.metadata``, indexable by sample id, set by
``accept_globals``) and the sample bytes (``self.memory_read(ptr, storage_state)``) and writes a
batch into the ``(B, *shape)`` buffer the planner allocated from its ``AllocationQuery``.

Per-sample metadata (ffcv-format.md §1.4): Int/Float: the value (``<i8``/``<f8``); RGB: packed
``{mode u1, width <u2, height <u2, data_ptr <u8}`` (mode 0 = JPEG, 1 = raw HWC RGB); Bytes/JSON:
``{ptr <u8, size <u8}``; NDArray: ``<u8`` pointer.

Differences from FFCV, all deliberate:

* ``BytesDecoder`` zero-fills each row after the sample's bytes (FFCV leaves stale bytes from
  earlier batches, issues #57/#370).
* JPEG decoding is strict: a corrupt JPEG raises :class:`~beton_serve.jpeg.CorruptJPEGError`
  naming the sample, where FFCV returns garbage pixels.
* Random crops draw from :mod:`beton_serve.pipeline.rng` (``with_seed``), so a crop is a pure
  function of (seed, epoch, op position, sample id).
* The crop decoders resize with a compiled area filter (``resize="area"``, within 1 grey level of
  OpenCV's ``INTER_AREA``, see :mod:`beton_serve._kernels.resize`) or with OpenCV itself
  (``resize="cv2"``, FFCV's exact pixels), and decode a JPEG at a reduced DCT scale when the
  crop is at least twice the output size (``dct_scale=True``; see :meth:`_CropDecoder.__init__`).
* With libjpeg-turbo's TurboJPEG 3 API (:mod:`beton_serve._tj3`, ``jpeg_backend="auto"``), the
  crop decoders decode only each crop's rectangle (plus a pixel each side), bit-identical to the
  same rectangle of a whole-image decode; simplejpeg's whole-image decode is the fallback.

This module imports neither Numba nor OpenCV at import time.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
from beton_wire.limits import short_repr

from beton_serve.errors import SpecError
from beton_serve.pipeline.allocation_query import AllocationQuery
from beton_serve.pipeline.compiler import Compiler
from beton_serve.pipeline.operation import Operation
from beton_serve.pipeline.state import State

__all__ = [
    "BytesDecoder",
    "CenterCropRGBImageDecoder",
    "FloatDecoder",
    "IntDecoder",
    "NDArrayDecoder",
    "RandomResizedCropRGBImageDecoder",
    "SimpleRGBImageDecoder",
]


def _require_metadata(op: Operation, names: tuple[str, ...] = ()) -> np.ndarray:
    md = op.metadata
    if md is None:
        raise SpecError(
            f"{type(op).__name__}: no field metadata; the planner must call accept_globals() "
            "before declare_state_and_memory()"
        )
    if names and (md.dtype.names is None or any(n not in md.dtype.names for n in names)):
        raise SpecError(
            f"{type(op).__name__} cannot decode a field whose metadata is {md.dtype}; "
            f"it needs members {names}: use the decoder that matches the field type"
        )
    return md  # type: ignore[no-any-return]


def _jit_state(previous_state: State, shape: tuple[int, ...], dtype: Any) -> State:
    return replace(previous_state, jit_mode=True, shape=shape, dtype=np.dtype(dtype))


# -- scalars ---------------------------------------------------------------------------------
class _ScalarDecoder(Operation):
    _dtype: Any = None
    compile_ahead = True

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery]:
        md = _require_metadata(self)
        if md.dtype.names is not None or md.dtype.kind not in "iuf":
            raise SpecError(
                f"{type(self).__name__} cannot decode a field whose metadata is {md.dtype}; "
                "use the decoder that matches the field type"
            )
        return _jit_state(previous_state, (1,), self._dtype), AllocationQuery((1,), self._dtype)

    def generate_code(self) -> Callable[..., Any]:
        def decode(batch_indices, dst, metadata, storage_state):  # pragma: no cover - compiled
            for i in range(batch_indices.shape[0]):
                dst[i, 0] = metadata[batch_indices[i]]
            return dst

        return decode

    def spec_params(self) -> dict[str, Any]:
        return {}


class IntDecoder(_ScalarDecoder):
    """An ``IntField`` as ``(B, 1)`` int64 (FFCV's shape: add ``Squeeze()`` for ``(B,)``)."""

    spec_name = "IntDecoder"
    _dtype = np.dtype("<i8")


class FloatDecoder(_ScalarDecoder):
    """A ``FloatField`` as ``(B, 1)`` float64."""

    spec_name = "FloatDecoder"
    _dtype = np.dtype("<f8")


# -- bytes / arrays --------------------------------------------------------------------------
class BytesDecoder(Operation):
    """A ``BytesField`` or ``JSONField`` as ``(B, max_size)`` uint8 rows, zero-padded.

    ``max_size`` is the largest sample over the whole file (FFCV's rule). Unlike FFCV, the bytes
    after each sample's data are zero, so rows never carry stale data from earlier batches.
    """

    spec_name = "BytesDecoder"

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery]:
        md = _require_metadata(self, ("ptr", "size"))
        max_size = int(md["size"].max()) if md.shape[0] else 0
        return (
            _jit_state(previous_state, (max_size,), np.uint8),
            AllocationQuery((max_size,), np.dtype(np.uint8)),
        )

    def generate_code(self) -> Callable[..., Any]:
        mem_read = Compiler.compile(self.memory_read)  # type: ignore[arg-type]

        def decode(batch_indices, dst, metadata, storage_state):  # pragma: no cover - compiled
            width = dst.shape[1]
            for i in range(batch_indices.shape[0]):
                rec = metadata[batch_indices[i]]
                n = min(int(rec["size"]), width)
                row = dst[i]
                if n > 0:
                    src = mem_read(rec["ptr"], storage_state)[:n]
                    for j in range(n):
                        row[j] = src[j]
                for j in range(n, width):
                    row[j] = 0
            return dst

        return decode

    def spec_params(self) -> dict[str, Any]:
        return {}


class NDArrayDecoder(Operation):
    """An ``NDArrayField`` (or ``TorchTensorField``) as ``(B, *shape)`` of the field's dtype."""

    spec_name = "NDArrayDecoder"

    def _layout(self) -> tuple[tuple[int, ...], np.dtype]:
        field = self.field
        if field is None or not hasattr(field, "shape") or not hasattr(field, "dtype"):
            raise SpecError(
                "NDArrayDecoder needs an NDArrayField (with .shape and .dtype); "
                "use the decoder that matches the field type"
            )
        dtype = np.dtype(field.dtype)
        from beton_serve.fields.ndarray import undecodable

        if (problem := undecodable(dtype)) is not None:
            raise SpecError(f"NDArrayDecoder cannot decode this field's dtype {dtype}: {problem}")
        return tuple(int(s) for s in field.shape), dtype

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery]:
        md = _require_metadata(self)
        if md.dtype.names is not None:
            raise SpecError(
                f"NDArrayDecoder cannot decode a field whose metadata is {md.dtype}; "
                "use the decoder that matches the field type"
            )
        shape, dtype = self._layout()
        return _jit_state(previous_state, shape, dtype), AllocationQuery(shape, dtype)

    def generate_code(self) -> Callable[..., Any]:
        mem_read = Compiler.compile(self.memory_read)  # type: ignore[arg-type]
        shape, dtype = self._layout()
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize

        def decode(batch_indices, dst, metadata, storage_state):  # pragma: no cover - compiled
            n = batch_indices.shape[0]
            flat = dst.reshape(n, -1).view(np.uint8)
            for i in range(n):
                src = mem_read(metadata[batch_indices[i]], storage_state)[:nbytes]
                row = flat[i]
                m = src.shape[0]
                for j in range(m):
                    row[j] = src[j]
                for j in range(m, nbytes):
                    row[j] = 0
            return dst

        return decode

    def spec_params(self) -> dict[str, Any]:
        return {}


# -- images ----------------------------------------------------------------------------------
_RGB_MEMBERS = ("mode", "width", "height", "data_ptr")


class _ImageColumns:
    """Plain int64 copies of an RGB metadata column (fast to index from Python and Numba)."""

    def __init__(self, md: np.ndarray) -> None:
        self.modes = np.ascontiguousarray(md["mode"], dtype=np.int64)
        self.heights = np.ascontiguousarray(md["height"], dtype=np.int64)
        self.widths = np.ascontiguousarray(md["width"], dtype=np.int64)
        self.ptrs = np.ascontiguousarray(md["data_ptr"], dtype=np.uint64)
        self.max_h = int(self.heights.max()) if len(self.heights) else 0
        self.max_w = int(self.widths.max()) if len(self.widths) else 0


#: Bytes of upscale regions a worker thread of the TurboJPEG crop decoders holds before it
#: resizes them (more only for a single larger region, and not kept after that batch): the
#: bound of the thread's arena, which all its decoders share.
UPSCALE_ARENA_BYTES = 4 << 20

#: JPEG images whose metadata size differs from the file's common size that
#: SimpleRGBImageDecoder takes for bad samples rather than refusing the file (see _common_size).
MAX_ODD_IMAGES = 16


#: The scratch of the crop decoders on each worker thread (``_WorkerBuffers``): one set per
#: thread, shared by every decoder the thread runs, freed when the thread ends.
_THREAD_SCRATCH = threading.local()


class _WorkerBuffers:
    """The scratch of a crop decoder on the calling worker thread, reused across batches and
    grown on demand: the resize scratch (``resize_scratch``), the decoded pixels or region
    (``jpeg``), and the TurboJPEG kernel's region grid (``grid``) and upscale arena (``arena``).

    The arrays are per *thread*, not per decoder: a daemon with many pipelines holds one set per
    worker, each as large as the largest image or region that worker decoded, instead of one per
    decoder and worker. This is safe because a thread runs one decoder call at a time and no
    call keeps them past its return (results are written into the batch's buffer; the decode
    groups' entries are arrays of their own).

    ``jpeg`` is sized by images whose header matched their metadata, never by the metadata's
    maximum: one lying sample must not make every worker map 12 GiB.
    """

    def __init__(self, cols: _ImageColumns) -> None:
        self.cols = cols

    def resize_scratch(self, ow: int) -> np.ndarray:
        """The area resize's float32 scratch for outputs ``ow`` wide."""
        from beton_serve._kernels import resize as rz

        need = rz.scratch_size(max(self.cols.max_w, 1), ow)
        rbuf = getattr(_THREAD_SCRATCH, "rbuf", None)
        if rbuf is None or rbuf.shape[0] < need:
            rbuf = _THREAD_SCRATCH.rbuf = np.empty(need, np.float32)
        return rbuf  # type: ignore[no-any-return]

    def jpeg(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of at least ``nbytes`` (decoded pixels, or a decoded region)."""
        jbuf = getattr(_THREAD_SCRATCH, "jbuf", None)
        if jbuf is None or jbuf.shape[0] < nbytes:
            cols = self.cols
            grown = 0 if jbuf is None else min(2 * jbuf.shape[0], cols.max_h * cols.max_w * 3)
            jbuf = _THREAD_SCRATCH.jbuf = np.empty(max(nbytes, grown, 1), np.uint8)
        return jbuf  # type: ignore[no-any-return]

    def arena(self, nbytes: int, keep: int = 0) -> np.ndarray:
        """The TurboJPEG batch kernel's flat arena of upscale regions, of at least ``nbytes``:
        grows (doubling, up to ``UPSCALE_ARENA_BYTES`` or one region) keeping its first
        ``keep`` bytes, the batch's regions so far. One grown past the bound for one large
        region of an earlier batch is dropped when a batch starts (``keep=0``)."""
        arena = getattr(_THREAD_SCRATCH, "arena", None)
        if arena is not None and keep == 0 and nbytes <= UPSCALE_ARENA_BYTES < arena.shape[0]:
            arena = None  # grown for one large region of an earlier batch: not kept
        if arena is None or arena.shape[0] < nbytes:
            old = np.zeros(0, np.uint8) if arena is None else arena
            grown = min(2 * old.shape[0], UPSCALE_ARENA_BYTES)
            arena = _THREAD_SCRATCH.arena = np.empty(max(nbytes, grown, 1), np.uint8)
            arena[:keep] = old[:keep]
        return arena  # type: ignore[no-any-return]

    def grid(self, h: int, w: int) -> np.ndarray:
        """An ``(>= h, >= w, 3)`` uint8 region scratch (the TurboJPEG batch kernel's)."""
        grid = getattr(_THREAD_SCRATCH, "grid", None)
        if grid is None or grid.shape[0] < h or grid.shape[1] < w:
            old = (0, 0) if grid is None else grid.shape[:2]
            grid = _THREAD_SCRATCH.grid = np.empty(
                (max(h, old[0], 1), max(w, old[1], 1), 3), np.uint8
            )
        return grid  # type: ignore[no-any-return]


def _common_size(cols: _ImageColumns) -> tuple[int, int]:
    """The ``(height, width)`` every image of a SimpleRGBImageDecoder's file must have.

    That is the size of all images; or, when at most :data:`MAX_ODD_IMAGES` JPEG images (and no
    raw one) differ from the size of all the others, that size: the odd ones are bad samples at
    decode time (their metadata lies about their JPEG, or they really differ), so that one sample
    whose metadata says 65535x65535 costs one sample, not a 12 GiB buffer per image.

    Raises:
        SpecError: the images have several sizes.
    """
    if not len(cols.heights):
        return 0, 0
    keys = cols.heights * 65536 + cols.widths
    values, counts = np.unique(keys, return_counts=True)
    common = int(values[np.argmax(counts)])
    odd = keys != common
    n_odd = int(np.count_nonzero(odd))
    if n_odd and (n_odd > MAX_ODD_IMAGES or (cols.modes[odd] != 0).any()):
        raise SpecError(
            "SimpleRGBImageDecoder needs every image of the file to have the same size, but "
            f"heights range {cols.heights.min()}..{cols.max_h} and widths "
            f"{cols.widths.min()}..{cols.max_w}; use RandomResizedCropRGBImageDecoder or "
            "CenterCropRGBImageDecoder"
        )
    return common // 65536, common % 65536


def _corrupt(exc: Exception, sid: int, op: str) -> Exception:
    from beton_serve.jpeg import CorruptJPEGError

    reason = str(exc.args[0]) if exc.args else str(exc)
    return CorruptJPEGError(reason, sample_index=sid, op=op)


def _odd_size(height: int, width: int, h: int, w: int) -> str:
    return (
        f"the image is {height}x{width} (HxW) but SimpleRGBImageDecoder outputs {h}x{w}, the "
        "size of the file's other images; use a crop decoder for images of several sizes"
    )


def _whole_raw_copy() -> Callable[..., Any]:
    """``SimpleRGBImageDecoder``'s raw copy for a file whose every allocation holds its whole
    image (``accept_storage``), with its ``mirrored`` variant for ``Plan._mirror_fusions``
    (``beton_serve._kernels.raw``, imported on first use: it imports Numba)."""
    from beton_serve._kernels import raw

    copy = raw.copy_whole
    if getattr(copy, "mirrored", None) is None:
        copy.mirrored = raw.copy_whole_mirrored
    return copy


class SimpleRGBImageDecoder(Operation):
    """An ``RGBImageField`` whose images all have one size, as ``(B, H, W, 3)`` uint8.

    Raw images are copied; JPEGs are decoded straight into the output (FFCV's pixels). Every
    JPEG's header is checked against its metadata first: a mismatch is a bad sample
    (:class:`~beton_serve.jpeg.CorruptJPEGError` naming it). A file whose images have several
    sizes is refused when the pipeline is built (``SpecError``), except that up to
    :data:`MAX_ODD_IMAGES` odd JPEG images are bad samples instead (see ``_common_size``).
    """

    spec_name = "SimpleRGBImageDecoder"
    _cols: _ImageColumns | None = None
    #: The output shape of the file whose columns ``_cols`` holds.
    _shape: tuple[int, int, int] | None = None

    #: Whether every raw image's allocation holds the whole image, for the file whose columns
    #: ``_cols`` holds (``None``: not known; see :meth:`accept_storage`).
    _raw_whole: bool | None = None
    #: Whether this decoder copies raw images itself (the crop decoders resize them).
    _copies_raw = True

    def accept_globals(self, metadata: Any, memory_read: Callable[..., Any]) -> None:
        """Receive the metadata column; drops columns cached from another file's (the plan
        hands the same column over again before every epoch)."""
        if metadata is not getattr(self, "metadata", None):
            self._cols = self._shape = None
            self._raw_whole = None
        super().accept_globals(metadata, memory_read)

    def accept_storage(self, storage_state: Any) -> None:
        """Learn, once per file, whether every raw image's allocation holds the whole image
        (a beton-serve extension the plan calls after :meth:`accept_globals`). When it does,
        the raw copy reads each image at its pointer without looking its allocation up: the
        per-sample binary search over the file's allocation table (``memory_read``) was ~95 us
        of a 512-image CIFAR batch's ~330 us copy (issue 15 §3). Only for the format's own
        ``memory_read`` and storage state; anything else keeps the looked-up reads.

        Cost: nothing for a file with any JPEG (one pass over the mode column) and for the crop
        decoders; for an all-raw file one look-up per sample, ~2 ms for 50,000 samples and
        ~50 ms per million, when a Loader plans the file."""
        from beton_serve.format import memory_read as format_read

        if self._raw_whole is not None:
            return
        self._raw_whole = False
        md = getattr(self, "metadata", None)
        if not self._copies_raw or self.memory_read is not format_read or md is None:
            return
        try:
            if not len(md) or not (md["mode"] != 0).all():
                return
            _, ptrs, sizes = storage_state
            if not len(ptrs):
                return
            want = np.ascontiguousarray(md["data_ptr"], dtype=np.uint64)
            ix = np.minimum(np.searchsorted(ptrs, want), len(ptrs) - 1)
            need = md["height"].astype(np.uint64) * md["width"].astype(np.uint64) * np.uint64(3)
            self._raw_whole = bool((ptrs[ix] == want).all() and (sizes[ix] >= need).all())
        except (TypeError, ValueError, KeyError):
            self._raw_whole = False

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery]:
        shape = self._shape
        if self._cols is None or shape is None:
            # once per file, not per epoch: the columns and their sizes' histogram took
            # ~0.5 ms of every epoch's start on 50,000 samples (issue 15 §3)
            cols = _ImageColumns(_require_metadata(self, _RGB_MEMBERS))
            shape = (*_common_size(cols), 3)
            self._cols, self._shape = cols, shape
        return _jit_state(previous_state, shape, np.uint8), AllocationQuery(shape, np.uint8)

    def generate_code(self) -> Callable[..., Any]:
        cols = self._cols
        if cols is None:
            cols = self._cols = _ImageColumns(_require_metadata(self, _RGB_MEMBERS))
        if self._raw_whole and (cols.modes != 0).all():
            return _whole_raw_copy()
        if not (cols.modes == 0).any():
            mem_read = Compiler.compile(self.memory_read)  # type: ignore[arg-type]

            def copy_raw(batch_indices, dst, metadata, storage_state):  # pragma: no cover
                n = batch_indices.shape[0]
                flat = dst.reshape(n, -1)
                size = flat.shape[1]
                for i in range(n):
                    data = mem_read(metadata[batch_indices[i]]["data_ptr"], storage_state)
                    row = flat[i]
                    src = data[:size]
                    # an explicit loop over row views vectorises; slice assignment does not.
                    # (a short allocation leaves the tail zero instead of reading past it)
                    m = src.shape[0]
                    for j in range(m):
                        row[j] = src[j]
                    for j in range(m, size):
                        row[j] = 0
                return dst

            return copy_raw

        mem_read_py = self.memory_read
        name = type(self).__name__

        def decode(batch_indices, dst, metadata, storage_state):
            from beton_serve.jpeg import CorruptJPEGError, check_size, decode_into

            h, w = dst.shape[1], dst.shape[2]
            for b in range(len(batch_indices)):
                sid = int(batch_indices[b])
                height, width = int(cols.heights[sid]), int(cols.widths[sid])
                data = mem_read_py(cols.ptrs[sid], storage_state)  # type: ignore[misc]
                if cols.modes[sid] == 0:
                    try:
                        check_size(data, height, width)  # metadata that lies: a bad sample
                        if (height, width) != (h, w):
                            raise CorruptJPEGError(_odd_size(height, width, h, w))
                        img = decode_into(data, dst[b])
                    except CorruptJPEGError as exc:
                        raise _corrupt(exc, sid, name) from None
                    if img.shape != (h, w, 3):
                        raise CorruptJPEGError(
                            f"JPEG is {img.shape[0]}x{img.shape[1]} but metadata says {h}x{w}",
                            sample_index=sid,
                            op=name,
                        )
                else:
                    dst[b].reshape(-1)[:] = data[: h * w * 3]
            return dst

        decode.python = True  # type: ignore[attr-defined]
        return decode

    def spec_params(self) -> dict[str, Any]:
        return {}


class _CropDecoder(SimpleRGBImageDecoder):
    """Shared machinery of the crop decoders: decode (maybe DCT-scaled), crop, area-resize."""

    with_seed = False
    _copies_raw = False
    #: Decodes shared with the decode group (issue 16); set by the public subclasses.
    share_decode: bool = False

    def __init__(
        self,
        output_size: tuple[int, int],
        *,
        resize: str = "area",
        dct_scale: bool = True,
        fast_upsample: bool = False,
        jpeg_backend: str = "auto",
    ) -> None:
        """Args:
        output_size: ``(height, width)`` of the output; may be changed between epochs
            (progressive resizing): ``declare_state_and_memory`` reads it each time.
        resize: ``"area"`` (compiled area filter, within 1 grey level of OpenCV) or
            ``"cv2"`` (OpenCV ``INTER_AREA``, FFCV's exact pixels).
        dct_scale: decode a JPEG at a reduced DCT scale ``M/8`` when the crop still covers
            the output at that scale (libjpeg-turbo's DCT-domain downscale: less decode work
            and a smaller resize): with TurboJPEG 3 the cheapest measured scale of 1/8, 1/4,
            1/2 (see ``beton_serve._tj3.SCALE_ORDER``), with simplejpeg one of 1/2, 3/8, 1/4,
            1/8. Pixels then differ from FFCV's full decode + resize by a few grey levels
            (docs/jpeg-decode.md); set ``False`` for FFCV's pixels.
        fast_upsample: plain chroma upsampling in the JPEG decoder (about 9% faster decode,
            chroma edges differ from FFCV by a few grey levels); off by default.
        jpeg_backend: ``"auto"`` (TurboJPEG 3 if a library is found, else simplejpeg with a
            logged reason), ``"tj3"`` (required: ``SpecError`` when the pipeline is built
            without it) or ``"simplejpeg"`` (whole-image decode). TurboJPEG 3 decodes only the
            crop's rectangle; without DCT scaling its pixels equal a whole-image decode's.
        """
        from beton_serve.jpeg import JPEG_BACKENDS

        super().__init__()
        if resize not in ("area", "cv2"):
            raise SpecError(f"resize must be 'area' or 'cv2', not {resize!r}")
        if jpeg_backend not in JPEG_BACKENDS:
            raise SpecError(f"jpeg_backend must be one of {JPEG_BACKENDS}, not {jpeg_backend!r}")
        self.output_size = output_size
        self._out_hw()  # refuse a malformed size here, not when the plan is compiled
        self.resize = resize
        self.dct_scale = bool(dct_scale)
        self.fast_upsample = bool(fast_upsample)
        self.jpeg_backend = jpeg_backend
        self._cols: _ImageColumns | None = None

    def _out_hw(self) -> tuple[int, int]:
        """``output_size`` as two positive ints. Only integers count (``int``, numpy integers):
        a string, bools or floats are refused, not coerced (``int()`` made ``"32"`` a 3x2
        output and truncated ``32.9``)."""
        size = self.output_size
        try:
            if isinstance(size, (str, bytes)) or any(isinstance(v, bool) for v in size):
                raise TypeError
            oh, ow = (operator.index(v) for v in size)
        except (TypeError, ValueError):
            raise SpecError(
                f"{type(self).__name__}: output_size must be (height, width), two integers, "
                f"not {short_repr(size)}"
            ) from None
        if oh < 1 or ow < 1:
            raise SpecError(f"{type(self).__name__}: output_size must be positive")
        return oh, ow

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery]:
        md = _require_metadata(self, _RGB_MEMBERS)
        if self._cols is None:
            self._cols = _ImageColumns(md)
        oh, ow = self._out_hw()
        shape = (oh, ow, 3)
        return _jit_state(previous_state, shape, np.uint8), AllocationQuery(shape, np.uint8)

    def _crops(self, batch_indices: np.ndarray, seed_key: Any) -> np.ndarray:
        raise NotImplementedError

    #: This decoder's crop sampler, by its ``beton_serve._prewarm`` group name.
    _sampler = "rrc"

    def _prewarm_lanes(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """``(helper, local)`` kernel groups to compile ahead on a cold compile cache
        (``beton_serve._prewarm.lanes``). The TurboJPEG batch kernel only where this decoder's
        own loop runs it: not with ``share_decode``, whose group decodes each sample."""
        from beton_serve import _prewarm
        from beton_serve.jpeg import resolve_backend

        tj3 = (
            resolve_backend(self.jpeg_backend) == "tj3"
            and self.resize == "area"
            and not self.share_decode
        )
        return _prewarm.lanes(self._sampler, tj3)

    def _wait_for_helper(self) -> None:
        """Before a batch: wait for the area resize a prewarm helper may be compiling into the
        cache, so that it is loaded, not compiled here a second time."""
        from beton_serve import _prewarm

        _prewarm.wait("resize")

    def _make_loop(self) -> Callable[..., Any]:
        from beton_serve import _prewarm
        from beton_serve.jpeg import resolve_backend

        # a cold compile cache: the crop kernels compile in parallel (and the batch kernel)
        _prewarm.start(*self._prewarm_lanes())
        if resolve_backend(self.jpeg_backend) == "tj3":
            return self._make_tj3_loop()
        return self._make_simplejpeg_loop()

    def _make_tj3_loop(self) -> Callable[..., Any]:
        """The batch loop with TurboJPEG 3: per sample, decode only the crop, at the cheapest
        scale that covers the output (``beton_serve._tj3.plan_crop``), then resize.

        Each worker thread owns one decompressor handle per decoder (in a ``threading.local``;
        freed when the thread or this loop goes) and region buffers, shared by the thread's
        decoders (``_WorkerBuffers``), that grow to the largest region decoded so far. A region that is exactly the output is decoded straight into ``dst[b]``.
        With ``resize="area"`` the batch runs in ``_tj3.batch_kernel`` (numba, no GIL) once it
        is compiled; ``one`` (ctypes) does the samples it hands back, and everything before.
        """
        from beton_serve import _tj3
        from beton_serve._kernels import resize as rz
        from beton_serve._kernels.crops import CROP_COLUMNS, resize_crops
        from beton_serve.jpeg import CorruptJPEGError

        if self._cols is None:
            self._cols = _ImageColumns(_require_metadata(self, _RGB_MEMBERS))
        cols = self._cols
        lib = _tj3.load()
        mem_read = self.memory_read
        method = self.resize
        dct = self.dct_scale
        fast_up = self.fast_upsample
        name = type(self).__name__
        local = threading.local()  # the TurboJPEG handle of each worker thread
        bufs = _WorkerBuffers(cols)
        crops_of = self._crops

        def worker_state(ow: int) -> tuple[_tj3.Decompressor, np.ndarray]:
            tj = getattr(local, "tj", None)
            if tj is None:
                tj = local.tj = _tj3.Decompressor(lib, fast_upsample=fast_up)
            return tj, bufs.resize_scratch(ow)

        region_buffer = bufs.jpeg

        def one(
            tj: _tj3.Decompressor,
            rbuf: np.ndarray,
            dst: np.ndarray,
            b: int,
            sid: int,
            box: np.ndarray,
            data: np.ndarray,
        ) -> None:
            """Sample ``sid`` into ``dst[b]`` through ctypes (each call releases the GIL)."""
            oh, ow = dst.shape[1], dst.shape[2]
            top, left, ch, cw = (int(v) for v in box)
            height, width = int(cols.heights[sid]), int(cols.widths[sid])
            if cols.modes[sid] != 0:
                img = data[: height * width * 3].reshape(height, width, 3)
                rz.resize_crop(img, top, left, ch, cw, dst[b], rbuf, method)
                return
            try:
                try:
                    hd = tj.header(data)
                except ValueError as exc:
                    raise CorruptJPEGError(str(exc)) from None
                if (hd.height, hd.width) != (height, width):
                    # the crop box comes from the metadata: a JPEG of another size is a
                    # bad sample (issue 11), as jpeg.check_size says
                    raise CorruptJPEGError(
                        f"the JPEG is {hd.height}x{hd.width} (HxW) but the sample's "
                        f"metadata says {height}x{width}"
                    )
                if hd.colorspace not in _tj3.DECODABLE_COLORSPACES:
                    raise CorruptJPEGError(
                        f"{_tj3.colorspace_name(hd.colorspace)} JPEGs cannot be decoded "
                        "to RGB; store them as RGB JPEGs"
                    )
                m, region, rh, rw, t2, l2, c2, w2 = _tj3.plan_crop(
                    hd, top, left, ch, cw, oh, ow, dct, not _tj3.ends_with_eoi(data)
                )
                out = dst[b]
                direct = (rh, rw, c2, w2) == (oh, ow, oh, ow) and out.flags.c_contiguous
                if not direct:
                    out = region_buffer(rh * rw * 3)[: rh * rw * 3].reshape(rh, rw, 3)
                try:
                    tj.decode(data, out, m, region)
                except ValueError as exc:
                    raise CorruptJPEGError(str(exc)) from None
            except CorruptJPEGError as exc:
                raise _corrupt(exc, sid, name) from None
            if not direct:
                rz.resize_crop(out, t2, l2, c2, w2, dst[b], rbuf, method)

        # The compiled loop (no GIL for the whole batch) decodes the JPEGs and area-resizes the
        # downscales; the upscales' regions it leaves in an arena, resized after it in one more
        # compiled call; this Python loop does what it hands back (raw images, errors) and
        # resize="cv2".
        # (compiled in the background on first use: the first batches take the Python loop)
        use_kernel = method == "area"

        # the kernel's (H, W, 3) region scratch; grows as regions need (as region_buffer)
        region_grid = bufs.grid

        # the kernel's flat arena of upscale regions (a batch's upscales are resized before
        # its run returns)
        upscale_arena = bufs.arena

        # The batch kernel's compile starts after a first batch (see _tj3.batch_kernel's start),
        # unless the compile cache has it: then the first batch loads and runs it.
        cached = use_kernel and _tj3.kernel_cached(lib)
        first_done = [False]

        def run(batch_indices, dst, metadata, storage_state, seed_key=None):
            out = run_batch(batch_indices, dst, metadata, storage_state, seed_key)
            first_done[0] = True
            return out

        def run_batch(batch_indices, dst, metadata, storage_state, seed_key=None):
            tj, rbuf = worker_state(dst.shape[2])
            boxes = crops_of(batch_indices, seed_key)
            n = len(batch_indices)
            ids = [int(v) for v in batch_indices]
            datas = [mem_read(cols.ptrs[sid], storage_state) for sid in ids]  # type: ignore[misc]
            kernel = (
                _tj3.batch_kernel(lib, wait=cached, start=cached or first_done[0])
                if use_kernel
                else None
            )
            if kernel is None or not dst.flags.c_contiguous or boxes.dtype != np.int64:
                for b in range(n):
                    one(tj, rbuf, dst, b, ids[b], boxes[b], datas[b])
                return dst
            addrs = np.zeros(n, np.uint64)
            lens = np.zeros(n, np.int64)  # 0: not a JPEG, left to one()
            eoi = np.zeros(n, np.bool_)
            for b in range(n):
                data = datas[b]
                if cols.modes[ids[b]] == 0 and data.shape[0]:
                    addrs[b] = data.ctypes.data
                    lens[b] = data.shape[0]
                    eoi[b] = _tj3.ends_with_eoi(data)
            idx = np.asarray(ids, np.int64)
            heights, widths = cols.heights[idx], cols.widths[idx]
            dflat = dst.reshape(-1)
            jbuf = region_grid(0, 0)
            arena = upscale_arena(0)
            atab = np.empty((n + 1, _tj3.ARENA_COLUMNS), np.int64)
            atab[:, 0] = -1
            atab[n, 0] = 0
            b = 0
            while b < n:
                b, need_h, need_w = kernel(  # type: ignore[operator]
                    tj.handle,
                    b,
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
                    jbuf.reshape(-1),
                    rbuf,
                    arena,
                    atab,
                )
                if b >= n:
                    break
                if need_h == -1:
                    if need_w > UPSCALE_ARENA_BYTES and atab[n, 0] > 0:
                        resize_upscales(atab, arena, dst, rbuf, n)  # empties the arena
                    else:
                        arena = upscale_arena(need_w, keep=int(atab[n, 0]))
                    continue
                if need_h:
                    jbuf = region_grid(need_h, need_w)
                    continue
                if lens[b]:  # a JPEG the kernel gave up on may have left the handle unusable
                    tj.reset()
                one(tj, rbuf, dst, b, ids[b], boxes[b], datas[b])
                b += 1
            resize_upscales(atab, arena, dst, rbuf, n)
            return dst

        def resize_upscales(
            atab: np.ndarray, arena: np.ndarray, dst: np.ndarray, rbuf: np.ndarray, n: int
        ) -> None:
            # the upscales the kernel decoded into the arena, all in one compiled call without
            # the GIL (resize_crop's "area" pixels); then the arena is empty again
            rows = np.flatnonzero(atab[:n, 0] >= 0)
            if rows.size:
                meta = np.empty((rows.size, len(CROP_COLUMNS)), np.int64)
                meta[:, 0] = rows
                meta[:, 1:] = atab[rows, 1:7]
                addrs = atab[rows, 0] + arena.ctypes.data
                resize_crops(addrs, meta, dst, dst.reshape(-1), rbuf, rbuf.view(np.int16))
                atab[rows, 0] = -1
            atab[n, 0] = 0

        return run

    def _make_simplejpeg_loop(self) -> Callable[..., Any]:
        """The batch loop with simplejpeg: decode the whole image (maybe DCT-scaled), crop,
        resize (the fallback when TurboJPEG 3 is missing)."""
        from beton_serve._kernels import resize as rz
        from beton_serve.jpeg import CorruptJPEGError, check_size, decode_into, scaled_size

        if self._cols is None:
            self._cols = _ImageColumns(_require_metadata(self, _RGB_MEMBERS))
        cols = self._cols
        mem_read = self.memory_read
        method = self.resize
        dct = self.dct_scale
        fast_up = self.fast_upsample
        name = type(self).__name__
        bufs = _WorkerBuffers(cols)  # per worker thread scratch, reused across batches
        crops_of = self._crops
        scratch, jpeg_buffer = bufs.resize_scratch, bufs.jpeg

        def run(batch_indices, dst, metadata, storage_state, seed_key=None):
            oh, ow = dst.shape[1], dst.shape[2]
            rbuf = scratch(ow)
            boxes = crops_of(batch_indices, seed_key)
            for b in range(len(batch_indices)):
                sid = int(batch_indices[b])
                top, left, ch, cw = (int(v) for v in boxes[b])
                height, width = int(cols.heights[sid]), int(cols.widths[sid])
                data = mem_read(cols.ptrs[sid], storage_state)  # type: ignore[misc]
                if cols.modes[sid] == 0:
                    try:
                        # The crop box comes from the metadata: a JPEG of another size is a bad
                        # sample, never mistaken for a DCT-scaled decode (issue 11).
                        check_size(data, height, width)
                        jbuf = jpeg_buffer(height * width * 3)
                        size = (height, width)
                        if dct and ch >= 2 * oh and cw >= 2 * ow:
                            mh = -((-height * oh) // ch)
                            mw = -((-width * ow) // cw)
                            sh, sw = scaled_size(height, width, mh, mw)
                            img = (
                                decode_into(data, jbuf, sh, sw, fast_up, size=size)
                                if sh < height
                                else None
                            )
                        else:
                            img = None
                        if img is None:
                            img = decode_into(data, jbuf, 0, 0, fast_up)
                    except CorruptJPEGError as exc:
                        raise _corrupt(exc, sid, name) from None
                    if img.shape[0] != height:
                        # map the crop onto the DCT-scaled image
                        fy = img.shape[0] / height
                        fx = img.shape[1] / width
                        t2 = int(top * fy)
                        l2 = int(left * fx)
                        ch = max(oh, min(img.shape[0] - t2, round(ch * fy)))
                        cw = max(ow, min(img.shape[1] - l2, round(cw * fx)))
                        top = min(t2, img.shape[0] - ch)
                        left = min(l2, img.shape[1] - cw)
                else:
                    img = data[: height * width * 3].reshape(height, width, 3)
                rz.resize_crop(img, top, left, ch, cw, dst[b], rbuf, method)
            return dst

        return run


#: Largest ``share_min_side`` accepted (the largest JPEG side).
_MAX_SHARE_MIN_SIDE = 65535


def crop_ranges(
    owner: str, scale: Sequence[float], ratio: Sequence[float]
) -> tuple[tuple[float, float], tuple[float, float]]:
    """A random-resized crop's ``scale`` and ``ratio`` as float pairs, checked (the decoder's and
    the ``RandomResizedCrop`` transform's): ``SpecError`` unless ``0 < scale[0] <= scale[1]`` and
    both ratios are positive."""
    s = (float(scale[0]), float(scale[1]))
    r = (float(ratio[0]), float(ratio[1]))
    if not (0 < s[0] <= s[1]) or min(r) <= 0:
        raise SpecError(
            f"{owner}: need 0 < scale[0] <= scale[1] and positive ratios, got scale={scale}, "
            f"ratio={ratio}"
        )
    return s, r


def _share_args(op: _CropDecoder, share_decode: object, share_min_side: object) -> tuple[bool, int]:
    """Checked ``(share_decode, share_min_side)`` of a crop decoder; raises ``SpecError``."""
    name = type(op).__name__
    if not isinstance(share_decode, bool | np.bool_):
        raise SpecError(f"{name}: share_decode must be True or False, not {share_decode!r}")
    if (
        isinstance(share_min_side, bool)
        or not isinstance(share_min_side, int)
        or not 0 <= share_min_side <= _MAX_SHARE_MIN_SIDE
    ):
        raise SpecError(
            f"{name}: share_min_side must be an int in [0, {_MAX_SHARE_MIN_SIDE}] "
            f"(0: share full decodes), not {share_min_side!r}"
        )
    if share_min_side and not share_decode:
        raise SpecError(
            f"{name}: share_min_side={share_min_side} applies only with share_decode=True"
        )
    return bool(share_decode), int(share_min_side)


def start_prewarm_early(pipelines: Mapping[str, Any]) -> None:
    """Start the prewarm helper process of each crop decoder in ``pipelines`` (lists of ops),
    before the in-process Loader opens its file: on a cold compile cache the helper's own start
    (about 0.9 s here) then overlaps the Loader's construction (``beton_serve._prewarm``). The
    decoder starts this process's lane itself when it builds its loop. Never raises: a
    decoder that cannot be planned is left for the pipeline to report."""
    from beton_serve import _prewarm

    for ops in pipelines.values():
        if not isinstance(ops, list | tuple):
            continue
        for op in ops:
            if not isinstance(op, _CropDecoder):
                continue
            try:
                helper, _ = op._prewarm_lanes()
            except Exception:  # e.g. jpeg_backend="tj3" without the library: its own error
                continue
            _prewarm.spawn_early(helper)


def _shared_loop(decoder: _CropDecoder) -> Callable[..., Any]:
    """``share_decode=True``: decodes shared with the decode group (issue 16)."""
    from beton_serve import _prewarm
    from beton_serve.fields._shared_decode import make_shared_loop

    _prewarm.start(*decoder._prewarm_lanes())
    return make_shared_loop(decoder)


class RandomResizedCropRGBImageDecoder(_CropDecoder):
    """Random crop (torchvision/FFCV sampler, §3.5) of each image, area-resized to ``output_size``.

    Crops are drawn from the counter RNG (``with_seed``): reproducible for any worker count.

    Decode groups (issue 16): ``share_decode=True`` takes each sample's decode from the
    stream's decode group (:mod:`beton_serve.fields.decode_cache`), so that the jobs of a sweep
    decode each image once; a stream decodes the same way alone, so its batches do not depend
    on who else runs.

    - ``share_min_side=0`` (the default): the shared decode is the full image; the pixels are
      those of ``dct_scale=False`` (FFCV's full decode + resize).
    - ``share_min_side=S > 0``: the shared decode is the image at the smallest DCT scale of 1/8,
      1/4 and 1/2 whose shorter side is still at least ``S`` pixels (full size when none is),
      chosen from the image's size alone; each job crops and resizes that. About half the
      decode and resize work of full-size sharing, at the cost of detail in crops that then
      cover fewer source pixels than the output: set ``S`` to the largest output side of the
      sweep to never upscale a whole image, or lower for speed (docs/architecture.md#decode-groups).
      Only streams with the same ``S`` share.
    """

    spec_name = "RandomResizedCropRGBImageDecoder"

    def __init__(
        self,
        output_size: tuple[int, int],
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0),
        *,
        resize: str = "area",
        dct_scale: bool = True,
        fast_upsample: bool = False,
        jpeg_backend: str = "auto",
        share_decode: bool = False,
        share_min_side: int = 0,
    ) -> None:
        super().__init__(
            output_size,
            resize=resize,
            dct_scale=dct_scale,
            fast_upsample=fast_upsample,
            jpeg_backend=jpeg_backend,
        )
        #: Issue 16: take decodes from the stream's decode group (fields.decode_cache).
        self.share_decode, self.share_min_side = _share_args(self, share_decode, share_min_side)
        self.scale, self.ratio = crop_ranges("RandomResizedCropRGBImageDecoder", scale, ratio)

    def _crops(self, batch_indices: np.ndarray, seed_key: Any) -> np.ndarray:
        from beton_serve._kernels.crop import rrc_batch

        self._wait_for_helper()
        cols = self._cols
        return rrc_batch(  # type: ignore[no-any-return]
            np.uint64(seed_key),
            np.asarray(batch_indices),
            cols.heights,  # type: ignore[union-attr]
            cols.widths,  # type: ignore[union-attr]
            np.array(self.scale),
            np.array(self.ratio),
        )

    def generate_code(self) -> Callable[..., Any]:
        loop = _shared_loop(self) if self.share_decode else self._make_loop()

        def decode(batch_indices, dst, metadata, storage_state, seed_key):
            return loop(batch_indices, dst, metadata, storage_state, seed_key)

        decode.python = True  # type: ignore[attr-defined]
        decode.with_seed = True  # type: ignore[attr-defined]
        return decode

    def spec_params(self) -> dict[str, Any]:
        return {
            "output_size": [int(v) for v in self.output_size],
            "scale": list(self.scale),
            "ratio": list(self.ratio),
            "resize": self.resize,
            "dct_scale": self.dct_scale,
            "fast_upsample": self.fast_upsample,
            # sent only when chosen, so that a default spec reads as before (and as FFCV's)
            **({"jpeg_backend": self.jpeg_backend} if self.jpeg_backend != "auto" else {}),
            **({"share_decode": True} if self.share_decode else {}),
            **({"share_min_side": self.share_min_side} if self.share_min_side else {}),
        }


class CenterCropRGBImageDecoder(_CropDecoder):
    """FFCV's centre crop (§3.6): ``c = int(ratio * min(H, W))`` square, resized to ``output_size``.

    ``ratio`` is required, as in FFCV (ffcv-imagenet uses ``224/256``). ``share_decode`` and
    ``share_min_side``: as for :class:`RandomResizedCropRGBImageDecoder`.
    """

    spec_name = "CenterCropRGBImageDecoder"
    _sampler = "center"

    def __init__(
        self,
        output_size: tuple[int, int],
        ratio: float,
        *,
        resize: str = "area",
        dct_scale: bool = True,
        fast_upsample: bool = False,
        jpeg_backend: str = "auto",
        share_decode: bool = False,
        share_min_side: int = 0,
    ) -> None:
        super().__init__(
            output_size,
            resize=resize,
            dct_scale=dct_scale,
            fast_upsample=fast_upsample,
            jpeg_backend=jpeg_backend,
        )
        #: Issue 16: take decodes from the stream's decode group (fields.decode_cache).
        self.share_decode, self.share_min_side = _share_args(self, share_decode, share_min_side)
        self.ratio = float(ratio)
        if not 0 < self.ratio <= 1:
            raise SpecError(f"CenterCropRGBImageDecoder: ratio must be in (0, 1], got {ratio}")

    def _crops(self, batch_indices: np.ndarray, seed_key: Any) -> np.ndarray:
        from beton_serve._kernels.crop import center_crop_batch

        self._wait_for_helper()
        cols = self._cols
        return center_crop_batch(  # type: ignore[no-any-return]
            np.asarray(batch_indices),
            cols.heights,  # type: ignore[union-attr]
            cols.widths,  # type: ignore[union-attr]
            self.ratio,
        )

    def generate_code(self) -> Callable[..., Any]:
        loop = _shared_loop(self) if self.share_decode else self._make_loop()

        def decode(batch_indices, dst, metadata, storage_state):
            return loop(batch_indices, dst, metadata, storage_state)

        decode.python = True  # type: ignore[attr-defined]
        return decode

    def spec_params(self) -> dict[str, Any]:
        return {
            "output_size": [int(v) for v in self.output_size],
            "ratio": self.ratio,
            "resize": self.resize,
            "dct_scale": self.dct_scale,
            "fast_upsample": self.fast_upsample,
            # sent only when chosen, so that a default spec reads as before (and as FFCV's)
            **({"jpeg_backend": self.jpeg_backend} if self.jpeg_backend != "auto" else {}),
            **({"share_decode": True} if self.share_decode else {}),
            **({"share_min_side": self.share_min_side} if self.share_min_side else {}),
        }
