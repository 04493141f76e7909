"""``Poison`` (mirrors ``ffcv.transforms.poisoning``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from beton_serve.errors import SpecError
from beton_serve.pipeline.operation import Operation
from beton_serve.pipeline.state import State
from beton_serve.transforms._util import bind, check_real, require_image, to_list

__all__ = ["Poison"]


class Poison(Operation):
    """Blend ``mask`` into the images of the samples listed in ``indices`` (in place).

    For those samples: ``img = clip(img * (1 - alpha) + mask * alpha, *clamp)`` computed in
    float32 (``alpha`` is (H, W), broadcast over channels) and truncated back to the dtype.
    """

    spec_name = "Poison"

    def __init__(
        self,
        mask: np.ndarray,
        alpha: np.ndarray,
        indices: Sequence[int],
        clamp: tuple[float, float] = (0, 255),
    ) -> None:
        super().__init__()
        self.mask = np.asarray(mask)
        self.alpha = np.asarray(alpha)
        self.indices = np.sort(np.asarray(indices, dtype=np.uint64))
        try:
            low, high = clamp
        except (TypeError, ValueError):
            raise SpecError(f"Poison: clamp must be (low, high), got {clamp!r}") from None
        self.clamp = (check_real("Poison", "clamp", low), check_real("Poison", "clamp", high))
        for what, arr in (("mask", self.mask), ("alpha", self.alpha)):
            if not np.issubdtype(arr.dtype, np.number):
                raise SpecError(f"Poison: {what} must hold numbers, got dtype {arr.dtype}")
        if self.mask.ndim != 3 or self.alpha.shape != self.mask.shape[:2]:
            raise SpecError(
                f"Poison: mask must be (H, W, 3) and alpha (H, W); got {self.mask.shape} "
                f"and {self.alpha.shape}"
            )

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, None]:
        require_image(self, previous_state)
        if tuple(previous_state.shape) != self.mask.shape:  # type: ignore[arg-type]
            raise SpecError(
                f"Poison: mask shape {self.mask.shape} differs from the images' "
                f"{previous_state.shape}"
            )
        return replace(previous_state), None

    def generate_code(self) -> Callable[..., Any]:
        def poison(
            images, dst, batch_indices, chosen, keep, mask, alpha, lo, hi
        ):  # pragma: no cover
            h, w = images.shape[1], images.shape[2]
            for i in range(images.shape[0]):
                sid = np.uint64(batch_indices[i])
                k = np.searchsorted(chosen, sid)
                if k >= chosen.shape[0] or chosen[k] != sid:
                    continue
                for y in range(h):
                    for x in range(w):
                        for c in range(images.shape[3]):
                            v = (
                                np.float32(images[i, y, x, c]) * keep[y, x]
                                + mask[y, x, c] * alpha[y, x]
                            )
                            v = min(max(v, lo), hi)
                            images[i, y, x, c] = v
            return images

        mask = np.ascontiguousarray(self.mask, dtype=np.float32)
        alpha = np.ascontiguousarray(self.alpha, dtype=np.float32)
        keep = (np.float32(1) - alpha).astype(np.float32)
        lo, hi = np.float32(self.clamp[0]), np.float32(self.clamp[1])
        return bind(poison, self.indices, keep, mask, alpha, lo, hi, indices=True)

    def spec_params(self) -> dict[str, Any]:
        return {
            "mask": to_list(self.mask),
            "alpha": to_list(self.alpha),
            "indices": to_list(self.indices),
            "clamp": list(self.clamp),
        }
