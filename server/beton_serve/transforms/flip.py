"""``RandomHorizontalFlip`` (mirrors ``ffcv.transforms.flip``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from beton_serve.pipeline.allocation_query import AllocationQuery
from beton_serve.pipeline.operation import Operation
from beton_serve.pipeline.state import State
from beton_serve.transforms._util import mark, require_image

__all__ = ["RandomHorizontalFlip"]


class RandomHorizontalFlip(Operation):
    """Flip each (H, W, C) image along W with probability ``flip_prob``.

    Draw: sample ``sid`` is flipped iff ``uniform(seed_key, sid, 0) < flip_prob``. Output is a new
    buffer of the input's shape and dtype.
    """

    spec_name = "RandomHorizontalFlip"

    def __init__(self, flip_prob: float = 0.5) -> None:
        super().__init__()
        self.flip_prob = float(flip_prob)

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery]:
        require_image(self, previous_state, channels=None)
        return replace(previous_state), AllocationQuery(
            previous_state.shape,  # type: ignore[arg-type]
            previous_state.dtype,
        )

    def generate_code(self) -> Callable[..., Any]:
        from beton_serve.pipeline.rng import uniform

        p = self.flip_prob

        def flip(images, dst, batch_indices, seed_key):  # pragma: no cover - compiled
            for i in range(images.shape[0]):
                if uniform(seed_key, np.uint64(batch_indices[i]), 0) < p:
                    dst[i] = images[i][:, ::-1]
                else:
                    dst[i] = images[i]
            return dst

        return mark(flip, indices=True, seed=True)

    def spec_params(self) -> dict[str, Any]:
        return {"flip_prob": self.flip_prob}
