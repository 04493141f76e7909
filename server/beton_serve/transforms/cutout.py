"""``Cutout`` (mirrors ``ffcv.transforms.cutout``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from beton_serve.errors import SpecError
from beton_serve.pipeline.operation import Operation
from beton_serve.pipeline.state import State
from beton_serve.transforms._util import bind, check_fill, check_int, require_image, to_list

__all__ = ["Cutout"]


class Cutout(Operation):
    """Fill a ``crop_size`` square of each image with ``fill`` (in place).

    As FFCV, the square always lies fully inside the image: its corner is
    ``(randint(H - s + 1), randint(W - s + 1))`` (counters 0 and 1).
    """

    spec_name = "Cutout"
    compile_ahead = True

    def __init__(self, crop_size: int, fill: tuple[int, int, int] = (0, 0, 0)) -> None:
        super().__init__()
        self.crop_size = check_int("Cutout", "crop_size", crop_size)
        self.fill = check_fill("Cutout", fill)

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, None]:
        require_image(self, previous_state)
        h, w, _ = previous_state.shape  # type: ignore[misc]
        if not 0 < self.crop_size <= min(h, w):
            raise SpecError(
                f"Cutout: crop_size {self.crop_size} must be in 1..{min(h, w)} for {h}x{w} images"
            )
        return replace(previous_state), None

    def generate_code(self) -> Callable[..., Any]:
        from beton_serve.pipeline.rng import randint

        def cutout(images, dst, batch_indices, seed_key, s, fill):  # pragma: no cover - compiled
            h, w = images.shape[1], images.shape[2]
            for i in range(images.shape[0]):
                sid = np.uint64(batch_indices[i])
                y = randint(seed_key, sid, np.int64(0), np.int64(0), h - s + 1)
                x = randint(seed_key, sid, np.int64(1), np.int64(0), w - s + 1)
                for c in range(3):
                    images[i, y : y + s, x : x + s, c] = fill[c]
            return images

        fill = np.ascontiguousarray(self.fill, dtype=np.float64)
        return bind(cutout, self.crop_size, fill, indices=True, seed=True)

    def spec_params(self) -> dict[str, Any]:
        return {"crop_size": self.crop_size, "fill": to_list(self.fill)}
