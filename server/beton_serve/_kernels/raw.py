"""The raw image copy of ``SimpleRGBImageDecoder``, plain or with chosen images mirrored.

For a file whose every allocation holds its whole image (``SimpleRGBImageDecoder.accept_storage``)
each image is read at its pointer, with no lookup in the allocation table: the per-sample binary
search of ``memory_read`` was ~95 us of a 512-image CIFAR batch's ~330 us copy (issue 15 §3).

:func:`copy_whole_mirrored` is the variant that ``Plan._mirror_fusions`` calls in place of a
``RandomHorizontalFlip`` after the decoder: the images drawn for a flip are written with each
row's pixels in reverse order, so that the batch is written once and never read back (the flip's
own pass re-read and re-wrote each flipped image, over a ring slot the decoder had just made
cold in the daemon: most of the served CIFAR path's extra cost). The pixels are the flip's, bit
for bit (``tests/unit/test_mirror_fusion.py``). Unsigned offsets, as in the flip's row loop, let
LLVM drop the negative-index checks. Mirroring costs ~0.2 us per 32x32 image over the plain
copy (0.25 us): reversing four pixels at a time with a byte shuffle (an LLVM intrinsic: 16-byte
loads and stores) measured the same, so the plain loop stayed.
"""

from __future__ import annotations

import numpy as np

from beton_serve.pipeline.compiler import Compiler

__all__ = ["copy_whole", "copy_whole_mirrored"]

_jit = Compiler.kernel


@_jit
def copy_whole(batch_indices, dst, metadata, storage_state):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """Image ``batch_indices[i]`` into ``dst[i]``, read at its pointer (whole allocations)."""
    mem = storage_state[0]
    n = batch_indices.shape[0]
    flat = dst.reshape(n, -1)
    size = flat.shape[1]
    for i in range(n):
        start = np.uint64(metadata[batch_indices[i]]["data_ptr"])
        src = mem[start : start + np.uint64(size)]
        row = flat[i]
        # an explicit loop over row views vectorises; slice assignment does not.
        for j in range(size):
            row[j] = src[j]
    return dst


@_jit
def copy_whole_mirrored(batch_indices, dst, metadata, storage_state, mirror):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """:func:`copy_whole`, with the images of ``mirror`` mirrored along W (the flip's pixels)."""
    mem = storage_state[0]
    n = batch_indices.shape[0]
    h, w = dst.shape[1], dst.shape[2]
    flat = dst.reshape(n, -1)
    size = flat.shape[1]
    one = np.uint64(1)
    two = np.uint64(2)
    for i in range(n):
        start = np.uint64(metadata[batch_indices[i]]["data_ptr"])
        src = mem[start : start + np.uint64(size)]
        row = flat[i]
        if not mirror[i]:
            for j in range(size):
                row[j] = src[j]
            continue
        for y in range(h):
            base = y * w * 3
            for x in range(w):
                a = np.uint64(base + (w - 1 - x) * 3)
                b = np.uint64(base + x * 3)
                row[b] = src[a]
                row[b + one] = src[a + one]
                row[b + two] = src[a + two]
    return dst
