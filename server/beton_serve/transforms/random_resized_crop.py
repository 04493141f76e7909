"""``RandomResizedCrop`` on decoded images (mirrors ``ffcv.transforms.random_resized_crop``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from beton_serve.errors import SpecError
from beton_serve.fields.decoders import crop_ranges
from beton_serve.pipeline.allocation_query import AllocationQuery
from beton_serve.pipeline.operation import Operation
from beton_serve.pipeline.state import State
from beton_serve.transforms._util import check_int, mark, require_image

__all__ = ["RandomResizedCrop"]


class RandomResizedCrop(Operation):
    """Random crop of each (H, W, 3) uint8 image, area-resized to ``size x size``.

    The crop sampler is the decoders' (:mod:`beton_serve._kernels.crop`, FFCV §3.5 with counter
    RNG draws); ``resize="area"`` uses the compiled area filter (within 1 grey level of OpenCV),
    ``"cv2"`` OpenCV's ``INTER_AREA``. Runs as Python (``python = True``) around GIL-free kernels.
    """

    spec_name = "RandomResizedCrop"

    def __init__(
        self,
        scale: tuple[float, float],
        ratio: tuple[float, float],
        size: int,
        *,
        resize: str = "area",
    ) -> None:
        super().__init__()
        self.scale, self.ratio = crop_ranges("RandomResizedCrop", scale, ratio)
        self.size = check_int(type(self).__name__, "size", size)
        if self.size < 1:
            raise SpecError(f"RandomResizedCrop: size must be at least 1, got {size}")
        if resize not in ("area", "cv2"):
            raise SpecError(f"RandomResizedCrop: resize must be 'area' or 'cv2', not {resize!r}")
        self.resize = resize

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery]:
        require_image(self, previous_state, dtype=np.uint8)
        shape = (self.size, self.size, 3)
        return replace(previous_state, shape=shape), AllocationQuery(shape, np.dtype(np.uint8))

    def generate_code(self) -> Callable[..., Any]:
        import threading

        from beton_serve._kernels.crop import rrc_batch_fixed
        from beton_serve._kernels.resize import resize_crop, scratch_size

        scale = np.array(self.scale)
        ratio = np.array(self.ratio)
        method = self.resize
        local = threading.local()

        def rrc(images, dst, batch_indices, seed_key):
            n, h, w = images.shape[0], images.shape[1], images.shape[2]
            ow = dst.shape[2]
            need = scratch_size(w, ow)
            buf = getattr(local, "buf", None)
            if buf is None or buf.shape[0] < need:
                buf = local.buf = np.empty(need, np.float32)
            ids = np.ascontiguousarray(batch_indices, dtype=np.uint64)
            boxes = rrc_batch_fixed(np.uint64(seed_key), ids, h, w, scale, ratio)
            for i in range(n):
                top, left, ch, cw = (int(v) for v in boxes[i])
                resize_crop(np.ascontiguousarray(images[i]), top, left, ch, cw, dst[i], buf, method)
            return dst

        return mark(rrc, indices=True, seed=True, python=True)

    def spec_params(self) -> dict[str, Any]:
        return {
            "scale": list(self.scale),
            "ratio": list(self.ratio),
            "size": self.size,
            "resize": self.resize,
        }
