"""Fixed-shape arrays (type 4; mirrors ``ffcv.fields.ndarray.NDArrayField``).

Metadata is the data pointer (``<u8``); each sample is one allocation of
``element_size = dtype.itemsize * prod(shape)`` bytes in C order. The argument blob (1024 bytes)
holds the shape as 32 ``<u8`` (unused entries 0), then ``type_length`` (``<u8``), then the ASCII
text ``json.dumps(dtype.descr)``, e.g. ``[["", "<f4"]]``; the rest is zero.

FFCV strips trailing zero dimensions when reading, crashes on a 0-d shape and cannot read
structured dtypes back, so the constructor rejects all three: FFCV must read what we write. It
also rejects the dtypes no decoder reads back (:func:`undecodable`: float16, non-native byte
order, strings, bytes, datetimes).
Values are converted to the field's dtype within their kind (numpy's ``same_kind``: ``float64``
into a ``float32`` field, ``int64`` into ``uint8``), and only when the values survive: an integer
that does not fit the field's dtype, an integer a float dtype cannot hold exactly, or a float that
overflows to infinity is a ``ValueError`` naming the first such element (floats may round to the
narrower dtype, as they always do). FFCV instead reinterprets the bytes of any array with the
same byte size, and wraps or truncates what numpy casts.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from beton_serve.fields.base import AllocationCheck, Field, Malloc, lazy_decoders
from beton_serve.format import ARGS_SIZE, NDARRAY_ARGS_DTYPE

__all__ = ["NDArrayField", "undecodable"]

_MAX_DIMS = 32


def undecodable(dtype: np.dtype) -> str | None:
    """Why ``NDArrayDecoder`` cannot decode arrays of ``dtype``, or ``None`` when it can.

    The decoder is a compiled copy into a batch of that dtype, so the dtype must be one numba
    handles: bool, the signed and unsigned integers, float32, float64, complex64 and complex128,
    in the machine's byte order. ``float16``, a big-endian dtype, strings, bytes, datetimes and
    raw ``void`` cannot be read back; the writer refuses them (FFCV could not decode them
    either), and a file that holds one is refused when a Loader decodes that field.
    """
    if dtype.kind not in "biufc" or dtype == np.float16:
        return (
            "the decoder handles bool, integer, float32/float64 and complex dtypes only; "
            "store it as one of those (e.g. float16 as float32, strings with a BytesField)"
        )
    if not dtype.isnative:
        return f"it is not in this machine's byte order; store it as {dtype.newbyteorder('=')}"
    return None


class _Flat(NamedTuple):
    """A prepared value: the array's bytes, already converted and flattened."""

    data: NDArray[np.uint8]


_TEXT_OFFSET = NDARRAY_ARGS_DTYPE.itemsize  # 264


class NDArrayField(Field):
    """An array of fixed ``shape`` and ``dtype`` per sample (decoded by ``NDArrayDecoder``).

    Args:
        dtype: a numpy dtype with a single, non-object member (e.g. ``np.dtype('float32')``).
        shape: the per-sample shape; at least one dimension, no trailing zero dimension, at most
            32 dimensions, and at least one byte in all.

    Raises:
        ValueError: for a dtype or shape that FFCV could not read back.
    """

    def __init__(self, dtype: Any, shape: tuple[int, ...], *, _from_file: bool = False) -> None:
        dt = np.dtype(dtype)
        shp = tuple(int(s) for s in shape)
        if dt.fields is not None or dt.subdtype is not None or dt.hasobject:
            raise ValueError(f"NDArrayField needs a plain scalar dtype, got {dt!r}")
        if not shp or len(shp) > _MAX_DIMS:
            raise ValueError(f"NDArrayField shape needs 1 to 32 dimensions, got {shp!r}")
        if any(s < 0 for s in shp) or shp[-1] == 0:
            raise ValueError(
                f"NDArrayField shape {shp!r} is invalid: dimensions must be >= 0 and the last "
                "one non-zero (FFCV drops trailing zero dimensions when reading)"
            )
        self.dtype = dt
        self.shape = shp
        self.element_size = int(dt.itemsize * int(np.prod(shp, dtype=np.int64)))
        if not _from_file and (problem := undecodable(dt)) is not None:
            raise ValueError(f"NDArrayField of dtype {dt}: {problem}")
        if self.element_size == 0 and not _from_file:  # FFCV may have written one: read it
            raise ValueError(
                f"NDArrayField of shape {shp!r} and dtype {dt} holds 0 bytes; zero-size "
                "allocations are ambiguous in the allocation table (ffcv-format.md §1.6)"
            )

    @property
    def metadata_type(self) -> np.dtype:
        return np.dtype("<u8")

    @staticmethod
    def from_binary(binary: NDArray[np.uint8]) -> NDArrayField:
        blob = np.asarray(binary, dtype=np.uint8).reshape(-1)
        if blob.size != ARGS_SIZE:
            raise ValueError(f"argument blob has {blob.size} bytes, expected {ARGS_SIZE}")
        header = blob[:_TEXT_OFFSET].view(NDARRAY_ARGS_DTYPE)[0]
        dims = [int(d) for d in header["shape"]]
        while dims and dims[-1] == 0:
            dims.pop()
        if not dims:
            raise ValueError("NDArrayField arguments hold an empty shape")
        length = int(header["type_length"])
        if length == 0 or length > ARGS_SIZE - _TEXT_OFFSET:
            raise ValueError(f"NDArrayField dtype text length {length} is out of range")
        if np.any(blob[_TEXT_OFFSET + length :]):
            raise ValueError("NDArrayField arguments have non-zero bytes after the dtype text")
        try:
            text = blob[_TEXT_OFFSET : _TEXT_OFFSET + length].tobytes().decode("ascii")
            descr = json.loads(text)
            if not isinstance(descr, list) or len(descr) != 1:
                raise ValueError("expected exactly one dtype entry")
            dt = np.dtype([tuple(e) for e in descr])["f0"]
            if int(np.prod(dims, dtype=np.float64)) * dt.itemsize > 2**62:
                raise ValueError(f"shape {dims} is too large")
            return NDArrayField(dt, tuple(dims), _from_file=True)
        except (UnicodeDecodeError, TypeError, KeyError, IndexError) as exc:
            raise ValueError(f"NDArrayField dtype text is not a valid dtype: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"NDArrayField arguments are invalid: {exc}") from None

    def to_binary(self) -> NDArray[np.uint8]:
        blob = np.zeros(ARGS_SIZE, dtype=np.uint8)
        header = np.zeros(1, dtype=NDARRAY_ARGS_DTYPE)
        header["shape"][0, : len(self.shape)] = self.shape
        text = json.dumps(self.dtype.descr).encode("ascii")
        if len(text) > ARGS_SIZE - _TEXT_OFFSET:
            raise ValueError(f"dtype text of {self.dtype!r} does not fit the argument blob")
        header["type_length"] = len(text)
        blob[:_TEXT_OFFSET] = header.view(np.uint8)
        blob[_TEXT_OFFSET : _TEXT_OFFSET + len(text)] = np.frombuffer(text, dtype=np.uint8)
        return blob

    def _as_array(self, value: Any) -> NDArray[np.uint8]:
        if hasattr(value, "detach") and hasattr(value, "numpy"):  # a CPU torch tensor
            value = value.detach().numpy()
        arr = np.asarray(value)
        if arr.shape != self.shape:
            raise ValueError(f"expected an array of shape {self.shape}, got {arr.shape}")
        if arr.dtype != self.dtype:
            if not np.can_cast(arr.dtype, self.dtype, casting="same_kind"):
                raise ValueError(f"cannot store a {arr.dtype} array in a {self.dtype} field")
            arr = _cast_exact(arr, self.dtype)
        return np.ascontiguousarray(arr).reshape(-1).view(np.uint8)

    def prepare(self, value: Any, rng: np.random.Generator | None = None) -> Any:
        return _Flat(self._as_array(value))

    def encode_prepared(self, destination: np.ndarray, prepared: Any, malloc: Malloc) -> None:
        data = prepared.data if isinstance(prepared, _Flat) else self._as_array(prepared)
        ptr, buf = malloc(self.element_size)
        buf[:] = data
        destination[0] = ptr

    def encode(self, destination: np.ndarray, field: Any, malloc: Malloc) -> None:
        self.encode_prepared(destination, field, malloc)

    def get_decoder_class(self) -> type:
        from beton_serve.fields.decoders import NDArrayDecoder

        return NDArrayDecoder

    def allocation_checks(self, column: np.ndarray) -> list[AllocationCheck]:
        ptrs = np.ascontiguousarray(column, dtype=np.uint64)
        sizes = np.full(ptrs.shape, self.element_size, dtype=np.int64)
        return [AllocationCheck("NDArrayField ptr", ptrs, sizes)]

    def describe(self) -> dict[str, Any]:
        return {"dtype": self.dtype.str, "shape": list(self.shape)}


def _cast_exact(arr: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    """``arr`` as ``dtype`` (a ``same_kind`` cast), refused when it would change a value (see the
    module docstring).

    Raises:
        ValueError: naming the first element the cast would change, and what it would become.
    """
    with np.errstate(all="ignore"):
        out = arr.astype(dtype)
    if np.can_cast(arr.dtype, dtype, casting="safe") and arr.dtype.kind == dtype.kind:
        return out  # a wider dtype of the same kind holds every value
    if dtype.kind in "fc" and arr.dtype.kind in "fc":  # rounding is expected; overflow is not
        with np.errstate(all="ignore"):
            bad = np.isinf(out) & np.isfinite(arr)
    elif dtype.kind in "iu" and arr.dtype.kind in "iu":  # compared as Python ints: no wrap
        info = np.iinfo(dtype)
        bad = (arr < info.min) | (arr > info.max)
    else:  # integers or booleans into another kind: exactly, or not at all
        with np.errstate(all="ignore"):
            bad = out.astype(arr.dtype) != arr
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"a {arr.dtype} array does not fit this {dtype} field: element {where} is "
            f"{arr[where].item()!r}, which would be stored as {out[where].item()!r}"
        )
    return out


# FFCV also exposes its decoders here (e.g. ``ffcv.fields.ndarray.<Decoder>``).
__getattr__ = lazy_decoders(__name__, ("NDArrayDecoder",))
