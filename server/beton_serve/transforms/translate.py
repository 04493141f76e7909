"""``RandomTranslate`` (mirrors ``ffcv.transforms.translate``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from beton_serve.errors import SpecError
from beton_serve.pipeline.allocation_query import AllocationQuery
from beton_serve.pipeline.operation import Operation
from beton_serve.pipeline.state import State
from beton_serve.transforms._util import bind, check_fill, check_int, require_image, to_list

__all__ = ["RandomTranslate"]


class RandomTranslate(Operation):
    """Shift each image by up to ``padding`` pixels, filling the uncovered area with ``fill``.

    As FFCV: the image is pasted at the centre of a ``(H + 2p, W + 2p)`` canvas filled with
    ``fill`` and the window at ``(y, x)``, ``y, x`` uniform in ``[0, 2p]``, is copied back into
    the input buffer (in place). Draws: ``y = randint(seed_key, sid, 0, 0, 2p + 1)``, ``x`` the
    same at counter 1.
    """

    spec_name = "RandomTranslate"
    compile_ahead = True

    def __init__(self, padding: int, fill: tuple[int, int, int] = (0, 0, 0)) -> None:
        super().__init__()
        self.padding = check_int(type(self).__name__, "padding", padding)
        if self.padding < 0:
            raise SpecError(f"RandomTranslate: padding must be >= 0, got {padding}")
        self.fill = check_fill("RandomTranslate", fill)

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery]:
        require_image(self, previous_state)
        h, w, c = previous_state.shape  # type: ignore[misc]
        p = self.padding
        return replace(previous_state), AllocationQuery(
            (h + 2 * p, w + 2 * p, c), previous_state.dtype
        )

    def generate_code(self) -> Callable[..., Any]:
        from beton_serve.pipeline.rng import randint

        def translate(images, dst, batch_indices, seed_key, pad, fill):  # pragma: no cover
            n, h, w = images.shape[0], images.shape[1], images.shape[2]
            for i in range(n):
                canvas = dst[i]
                for c in range(3):
                    canvas[:, :, c] = fill[c]
                canvas[pad : pad + h, pad : pad + w] = images[i]
                sid = np.uint64(batch_indices[i])
                y = randint(seed_key, sid, np.int64(0), np.int64(0), 2 * pad + 1)
                x = randint(seed_key, sid, np.int64(1), np.int64(0), 2 * pad + 1)
                images[i] = canvas[y : y + h, x : x + w]
            return images

        fill = np.ascontiguousarray(self.fill, dtype=np.float64)
        return bind(translate, self.padding, fill, indices=True, seed=True)

    def spec_params(self) -> dict[str, Any]:
        return {"padding": self.padding, "fill": to_list(self.fill)}
