"""``RandomHorizontalFlip`` (mirrors ``ffcv.transforms.flip``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from beton_serve.pipeline.allocation_query import AllocationQuery
from beton_serve.pipeline.operation import Operation, same_array
from beton_serve.pipeline.state import State
from beton_serve.transforms._util import check_real, mark, require_image

__all__ = ["RandomHorizontalFlip"]


class RandomHorizontalFlip(Operation):
    """Flip each (H, W, C) image along W with probability ``flip_prob``.

    Draw: sample ``sid`` is flipped iff ``uniform(seed_key, sid, 0) < flip_prob``. Output is a
    buffer of the input's shape and dtype: its own, or the input itself. The op is ``inplace``:
    when the op before it has written its buffer and nothing else reads that buffer, the plan
    passes it as the destination too, and the flip then mirrors only the images drawn for a
    flip, in place (each row through a row-sized scratch), and leaves the others as they are.
    A decoder followed by a flip then writes the batch's destination directly: no batch-sized
    intermediate buffer to write, read and first-touch (a fresh 38.5 MB per worker on an
    RRC-224 first batch).

    Runs as Python (``python = True``) around GIL-free calls: the flip mask is drawn by a compiled
    helper, then one compiled row loop copies or flips the whole batch without the GIL. RGB and
    grey images of any size take it, as do small images (under 16 KiB) and images of more than 4
    channels. Larger images of 2 or 4 channels are flipped by OpenCV's ``cv2.flip``, one call
    per image.

    ``benchmarks/bench_flip.py``, per image on one thread, 64-image batches: 3.3-3.7 us at
    160x160x3 and 11.3 us at 224x224x3 for the row loop, against 4.8-7.2 us and 27.7-32.1 us for
    the ``cv2.flip`` / ``np.copyto`` call per image it replaced for RGB; and one GIL-free call
    per batch instead of a GIL round trip per image, which the decode groups' Python loop
    (issue 16) competes for.
    """

    spec_name = "RandomHorizontalFlip"
    inplace = True
    compile_ahead = True

    def __init__(self, flip_prob: float = 0.5) -> None:
        super().__init__()
        self.flip_prob = check_real(type(self).__name__, "flip_prob", flip_prob)

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery]:
        require_image(self, previous_state, channels=None)
        return replace(previous_state), AllocationQuery(
            previous_state.shape,  # type: ignore[arg-type]
            previous_state.dtype,
        )

    def generate_code(self) -> Callable[..., Any]:
        from beton_serve.pipeline.compiler import Compiler
        from beton_serve.pipeline.rng import uniform

        p = self.flip_prob

        def mask_of(batch_indices, seed_key, p):  # pragma: no cover - compiled
            n = batch_indices.shape[0]
            out = np.empty(n, np.bool_)
            for i in range(n):
                out[i] = uniform(seed_key, np.uint64(batch_indices[i]), np.int64(0)) < p
            return out

        def flip_any(images, dst, mask):  # pragma: no cover - compiled
            for i in range(images.shape[0]):
                if mask[i]:
                    dst[i] = images[i][:, ::-1]
                else:
                    dst[i] = images[i]
            return dst

        def flip_rows(src, out, mask, h, w, c):  # pragma: no cover - compiled
            # C-contiguous (N, H, W, C) seen as (N*H, W*C) rows (reshaped by the caller: a
            # reshape here pulls Numba's error formatting into the compile, seconds of it): row
            # views and unsigned offsets let LLVM drop Numba's negative-index checks (3x faster
            # than the reversed-slice copy on 32x32 images). RGB and grey rows have their own
            # branch with the channel count a constant: a 512-image batch of 32x32 RGB flips in
            # 87-124 us, against 610-720 us with the channel loop (issue 15, CIFAR;
            # benchmarks/bench_ops.py --cifar).
            n = mask.shape[0]
            m = w * c
            one = np.uint64(1)
            two = np.uint64(2)
            for i in range(n):
                for y in range(h):
                    srow = src[i * h + y]
                    drow = out[i * h + y]
                    if not mask[i]:
                        for j in range(m):
                            drow[j] = srow[j]
                    elif c == 3:
                        for x in range(w):
                            a = np.uint64((w - 1 - x) * 3)
                            b = np.uint64(x * 3)
                            drow[b] = srow[a]
                            drow[b + one] = srow[a + one]
                            drow[b + two] = srow[a + two]
                    elif c == 1:
                        for x in range(w):
                            drow[np.uint64(x)] = srow[np.uint64(w - 1 - x)]
                    else:
                        for x in range(w):
                            a = np.uint64((w - 1 - x) * c)
                            b = np.uint64(x * c)
                            for k in range(c):
                                drow[b + np.uint64(k)] = srow[a + np.uint64(k)]
            return out

        def flip_rows_inplace(buf, mask, h, w, c):  # pragma: no cover - compiled
            # The images drawn for a flip, mirrored in place: each row is copied to a scratch
            # row (in L1) and written back reversed by the same loops as flip_rows; the other
            # images are not touched at all. (The loops are written twice on purpose: one
            # function with an in-place flag ran 1.3-2.3x slower, its row no longer one type.)
            n = mask.shape[0]
            m = w * c
            tmp = np.empty(m, buf.dtype)
            one = np.uint64(1)
            two = np.uint64(2)
            for i in range(n):
                if not mask[i]:
                    continue
                for y in range(h):
                    row = buf[i * h + y]
                    for j in range(m):
                        tmp[j] = row[j]
                    if c == 3:
                        for x in range(w):
                            a = np.uint64((w - 1 - x) * 3)
                            b = np.uint64(x * 3)
                            row[b] = tmp[a]
                            row[b + one] = tmp[a + one]
                            row[b + two] = tmp[a + two]
                    elif c == 1:
                        for x in range(w):
                            row[np.uint64(x)] = tmp[np.uint64(w - 1 - x)]
                    else:
                        for x in range(w):
                            a = np.uint64((w - 1 - x) * c)
                            b = np.uint64(x * c)
                            for k in range(c):
                                row[b + np.uint64(k)] = tmp[a + np.uint64(k)]
            return buf

        mask_fn = Compiler.compile(mask_of)
        any_fn = Compiler.compile(flip_any)
        rows_fn = Compiler.compile(flip_rows)
        rows_inplace_fn = Compiler.compile(flip_rows_inplace)

        def mirror_mask(batch_indices, seed_key):
            """Which of the samples this op flips: the op's own draws, and those of a decoder
            that writes them mirrored itself in the op's place (``Plan._mirror_fusions``)."""
            return mask_fn(np.asarray(batch_indices), np.uint64(seed_key), p)

        def flip(images, dst, batch_indices, seed_key):
            mask = mirror_mask(batch_indices, seed_key)
            n = images.shape[0]
            same = same_array(images, dst)
            contiguous = images.ndim == 4 and images.flags.c_contiguous
            if same and contiguous:
                _, h, w, c = images.shape
                rows_inplace_fn(images.reshape(n * h, w * c), mask, h, w, c)
                return images
            if same or np.may_share_memory(images, dst):
                images = images.copy()  # an in-place call the loops below cannot do in place
            if (
                images.ndim != 4
                or dst.shape != images.shape
                or not images.flags.c_contiguous
                or not dst.flags.c_contiguous
            ):
                return any_fn(images, dst, mask)
            c = images.shape[3]
            if c in (1, 3) or c > 4 or images.nbytes < 16384 * n:
                _, h, w, c = images.shape
                rows = n * h
                rows_fn(images.reshape(rows, w * c), dst.reshape(rows, w * c), mask, h, w, c)
                return dst
            import cv2

            for i in range(n):
                if mask[i]:
                    cv2.flip(images[i], 1, dst=dst[i])
                else:
                    np.copyto(dst[i], images[i])
            return dst

        flip.mirror_mask = mirror_mask  # type: ignore[attr-defined]
        return mark(flip, indices=True, seed=True, python=True)

    def spec_params(self) -> dict[str, Any]:
        return {"flip_prob": self.flip_prob}
