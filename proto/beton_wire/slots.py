"""The layout of one batch slot, shared by the daemon and the client.

A stream's ring is one shared-memory segment of ``slot_count`` equal slots. A slot holds one batch:
every output of the stream, in output order, each a C-contiguous ``(batch_size, *shape)`` array of
its dtype, starting at an offset aligned to :data:`ALIGN` bytes::

    segment: | slot 0 | slot 1 | ... | slot n-1 |        (each slot_bytes long, slot_bytes % ALIGN == 0)
    slot:    | out 0 (pad to ALIGN) | out 1 (pad) | ... |

A last, partial batch of ``length < batch_size`` samples uses the first ``length`` rows of each
output (the rows are contiguous, so that prefix is itself contiguous). Both sides compute the layout
from the stream's output specs with :func:`slot_layout`; the daemon also sends each tensor's offset
in ``BatchReady``, and the client checks that they agree.

This module depends only on the standard library and numpy-free dtype names, so that both packages
can import it cheaply.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "ALIGN",
    "DTYPE_NAMES",
    "DTYPE_SIZES",
    "SlotLayout",
    "TensorSlot",
    "dtype_name",
    "slot_layout",
]

#: Alignment of every tensor and of every slot, in bytes (a cache line, and enough for AVX-512).
ALIGN = 64

#: Wire dtype names (numpy spelling) and their item sizes, indexed like ``beton_wire.v1.DType``.
DTYPE_NAMES: tuple[str, ...] = (
    "",
    "uint8",
    "int8",
    "uint16",
    "int16",
    "uint32",
    "int32",
    "uint64",
    "int64",
    "float16",
    "float32",
    "float64",
    "bool",
    "complex64",
    "complex128",
)
DTYPE_SIZES: dict[str, int] = {
    "uint8": 1,
    "int8": 1,
    "uint16": 2,
    "int16": 2,
    "uint32": 4,
    "int32": 4,
    "uint64": 8,
    "int64": 8,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}


def dtype_name(code: int) -> str:
    """The numpy name of wire dtype ``code`` (a ``beton_wire.v1.DType`` value).

    Raises:
        ValueError: ``code`` is not one this release knows (a daemon of a newer release sent
            it, or ``DTYPE_UNSPECIFIED``).
    """
    if 0 < code < len(DTYPE_NAMES):
        return DTYPE_NAMES[code]
    raise ValueError(
        f"the daemon sent wire dtype {code}, which this client does not know: use a client of "
        "the daemon's release"
    )


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """Where one output lives inside a slot.

    Attributes:
        name: the output name.
        shape: per-sample shape (no batch dimension).
        dtype: numpy dtype name (a key of :data:`DTYPE_SIZES`).
        offset: byte offset from the start of the slot (a multiple of :data:`ALIGN`).
        sample_bytes: bytes per sample.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    sample_bytes: int

    def nbytes(self, length: int) -> int:
        """Bytes used by ``length`` samples."""
        return self.sample_bytes * length


@dataclass(frozen=True, slots=True)
class SlotLayout:
    """The layout of every slot of a ring.

    Attributes:
        batch_size: rows reserved per output.
        tensors: the outputs in stream order.
        slot_bytes: size of one slot (a multiple of :data:`ALIGN`, at least :data:`ALIGN`).
    """

    batch_size: int
    tensors: tuple[TensorSlot, ...]
    slot_bytes: int

    def slot_offset(self, slot: int) -> int:
        """Byte offset of ``slot`` from the start of the segment."""
        return slot * self.slot_bytes


def slot_layout(outputs: Sequence[tuple[str, Sequence[int], str]], batch_size: int) -> SlotLayout:
    """Compute the slot layout of a stream.

    Args:
        outputs: ``(name, per_sample_shape, dtype_name)`` of each output, in stream order.
        batch_size: the stream's batch size (rows reserved per output), at least 1.

    Returns:
        The layout; identical on both sides for identical arguments.

    Raises:
        ValueError: a dtype is not a wire dtype, a dimension is negative, or the batch size is < 1.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, not {batch_size}")
    offset = 0
    tensors = []
    for name, shape, dtype in outputs:
        if dtype not in DTYPE_SIZES:
            raise ValueError(
                f"output {name!r} has dtype {dtype!r}, which the wire cannot carry; "
                f"use one of {sorted(DTYPE_SIZES)}"
            )
        dims = tuple(int(d) for d in shape)
        if any(d < 0 for d in dims):
            raise ValueError(f"output {name!r} has a negative dimension in {dims}")
        per_sample = DTYPE_SIZES[dtype]
        for d in dims:
            per_sample *= d
        tensors.append(TensorSlot(name, dims, dtype, offset, per_sample))
        offset = _align(offset + per_sample * batch_size)
    return SlotLayout(batch_size, tuple(tensors), max(offset, ALIGN))
