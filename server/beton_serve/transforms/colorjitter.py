"""``RandomBrightness``, ``RandomContrast``, ``RandomSaturation`` (mirror ``ffcv.transforms.colorjitter``).

All three work in place on uint8 (H, W, 3) images and blend in float64 as FFCV does:
``out = uint8(clip(f * img + (1 - f) * other, 0, 255))`` (truncation), where ``other`` is 0
(brightness), the mean of the image's grey levels (contrast) or the per-pixel grey level
(saturation); grey = ``uint8(0.2989 R + 0.587 G + 0.114 B)`` (truncated). The contrast mean is
the exact integer sum of grey levels divided by their count.

Draws for sample ``sid``: applied iff ``uniform(seed_key, sid, 0) < p``; the factor is
``uniform_range(seed_key, sid, 1, max(0, 1 - magnitude), 1 + magnitude)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from beton_serve.pipeline.operation import Operation
from beton_serve.pipeline.state import State
from beton_serve.transforms._util import bind, check_real, require_image

__all__ = ["RandomBrightness", "RandomContrast", "RandomSaturation"]

_BRIGHTNESS, _CONTRAST, _SATURATION = 0, 1, 2


class _ColorJitter(Operation):
    _kind = _BRIGHTNESS
    compile_ahead = True

    def __init__(self, magnitude: float, p: float = 0.5) -> None:
        super().__init__()
        self.magnitude = check_real(type(self).__name__, "magnitude", magnitude)
        self.p = check_real(type(self).__name__, "p", p)

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, None]:
        require_image(self, previous_state, dtype=np.uint8)
        return replace(previous_state), None

    def generate_code(self) -> Callable[..., Any]:
        from beton_serve.pipeline.rng import uniform, uniform_range

        kind = self._kind  # captured: three kernels, each with the other two kinds' code folded

        def jitter(images, dst, batch_indices, seed_key, p, lo, hi):  # pragma: no cover
            h, w = images.shape[1], images.shape[2]
            for i in range(images.shape[0]):
                sid = np.uint64(batch_indices[i])
                if not uniform(seed_key, sid, np.int64(0)) < p:
                    continue
                f = uniform_range(seed_key, sid, np.int64(1), lo, hi)
                img = images[i]
                mean = 0.0
                if kind == 1:
                    total = np.int64(0)
                    for y in range(h):
                        for x in range(w):
                            total += np.int64(
                                np.uint8(
                                    0.2989 * img[y, x, 0]
                                    + 0.587 * img[y, x, 1]
                                    + 0.114 * img[y, x, 2]
                                )
                            )
                    mean = total / (h * w)
                if kind == 0:
                    # brightness: other is 0 and (1 - f) * 0 is +-0.0, which leaves f * v (>= +0)
                    # unchanged: the same bits as the blend below, without it (it measured 20 %
                    # slower with the factor's bounds as arguments instead of constants)
                    for y in range(h):
                        for x in range(w):
                            for c in range(3):
                                v = f * img[y, x, c]
                                v = min(max(v, 0.0), 255.0)
                                img[y, x, c] = np.uint8(v)
                    continue
                for y in range(h):
                    for x in range(w):
                        other = mean
                        if kind == 2:
                            other = float(
                                np.uint8(
                                    0.2989 * img[y, x, 0]
                                    + 0.587 * img[y, x, 1]
                                    + 0.114 * img[y, x, 2]
                                )
                            )
                        for c in range(3):
                            v = f * img[y, x, c] + (1.0 - f) * other
                            v = min(max(v, 0.0), 255.0)
                            img[y, x, c] = np.uint8(v)
            return images

        lo = max(0.0, 1.0 - self.magnitude)
        return bind(jitter, self.p, lo, 1.0 + self.magnitude, indices=True, seed=True)

    def spec_params(self) -> dict[str, Any]:
        return {"magnitude": self.magnitude, "p": self.p}


class RandomBrightness(_ColorJitter):
    """Scale pixel values by ``f ~ U(max(0, 1 - magnitude), 1 + magnitude)`` with probability ``p``."""

    spec_name = "RandomBrightness"
    _kind = _BRIGHTNESS


class RandomContrast(_ColorJitter):
    """Blend each image with its mean grey level (factor ``f``) with probability ``p``."""

    spec_name = "RandomContrast"
    _kind = _CONTRAST


class RandomSaturation(_ColorJitter):
    """Blend each image with its own grey version (factor ``f``) with probability ``p``."""

    spec_name = "RandomSaturation"
    _kind = _SATURATION
