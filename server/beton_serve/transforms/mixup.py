"""``ImageMixup``, ``LabelMixup``, ``MixupToOneHot`` (mirror ``ffcv.transforms.mixup``).

FFCV reseeds Numba's RNG with the batch's last sample id so that the image and label ops draw
the same mixing weights. Here both ops draw from the counter RNG under one fixed key,
``MIXUP_KEY = derive_seed_key(0, 0, "mixup")``, keyed by the batch's last sample id:
``lam_i = beta(MIXUP_KEY, indices[-1], c, alpha, alpha)`` with ``c = 0`` for every image when
``same_lambda`` else ``c = i``. Image ``i`` is mixed with image ``i - 1`` (image 0 with the last),
as in FFCV.

So, as in FFCV, the weights are a pure function of the batch's composition: reproducible for any
worker count, different between epochs whenever the order changes the batches (RANDOM,
QUASI_RANDOM), but repeated under SEQUENTIAL order. They cannot come from the per-op
``seed_key`` because the image and the label op sit at different op positions and must agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, ClassVar

import numpy as np

from beton_serve.errors import SpecError
from beton_serve.pipeline.allocation_query import AllocationQuery
from beton_serve.pipeline.operation import Operation
from beton_serve.pipeline.state import State
from beton_serve.transforms._util import bind, check_int, check_real

__all__ = ["ImageMixup", "LabelMixup", "MixupToOneHot", "MIXUP_STREAM", "mixup_key"]

#: Name of the shared random stream of the mixup ops (see the module docstring).
MIXUP_STREAM = "mixup"


def mixup_key() -> np.uint64:
    """The fixed key of the mixup weights (see the module docstring)."""
    from beton_serve.pipeline.rng import derive_seed_key

    return derive_seed_key(0, 0, MIXUP_STREAM)


def _lambdas_fn() -> Callable[..., Any]:
    from beton_serve.pipeline.rng import beta

    def lambdas(batch_indices, seed_key, alpha, same):  # pragma: no cover - compiled
        n = batch_indices.shape[0]
        out = np.empty(n, np.float64)
        if n == 0:
            return out
        last = np.uint64(batch_indices[n - 1])
        for i in range(n):
            out[i] = beta(seed_key, last, 0 if same else i, alpha, alpha)
        return out

    return lambdas


class ImageMixup(Operation):
    """``out[i] = lam_i * img[i] + (1 - lam_i) * img[i - 1]``, cast back (truncated) to the dtype."""

    batch_wide: ClassVar[bool] = True

    spec_name = "ImageMixup"

    def __init__(self, alpha: float, same_lambda: bool) -> None:
        super().__init__()
        self.alpha = check_real(type(self).__name__, "alpha", alpha)
        self.same_lambda = bool(same_lambda)
        if self.alpha <= 0:
            raise SpecError(f"ImageMixup: alpha must be > 0, got {alpha}")

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery]:
        if not previous_state.jit_mode:
            raise SpecError("ImageMixup works on numpy arrays; move it before ToTensor()")
        return replace(previous_state), AllocationQuery(
            previous_state.shape,  # type: ignore[arg-type]
            previous_state.dtype,
        )

    def generate_code(self) -> Callable[..., Any]:
        from beton_serve.pipeline.compiler import Compiler

        lambdas = Compiler.compile(_lambdas_fn())
        seed_key = mixup_key()

        def mixup(images, dst, batch_indices, alpha, same):  # pragma: no cover - compiled
            n = images.shape[0]
            lam = lambdas(batch_indices, seed_key, alpha, same)
            for i in range(n):
                j = i - 1 if i > 0 else n - 1
                li = lam[i]
                a = images[i]
                b = images[j]
                o = dst[i]
                for idx in np.ndindex(a.shape):
                    o[idx] = a[idx] * li + b[idx] * (1.0 - li)
            return dst

        return bind(mixup, self.alpha, bool(self.same_lambda), indices=True)

    def spec_params(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "same_lambda": self.same_lambda}


class LabelMixup(Operation):
    """Labels ``(B, 1)`` to ``(B, 3)`` float32 rows ``(label_i, label_{i-1}, lam_i)``."""

    batch_wide: ClassVar[bool] = True

    spec_name = "LabelMixup"

    def __init__(self, alpha: float, same_lambda: bool) -> None:
        super().__init__()
        self.alpha = check_real(type(self).__name__, "alpha", alpha)
        self.same_lambda = bool(same_lambda)
        if self.alpha <= 0:
            raise SpecError(f"LabelMixup: alpha must be > 0, got {alpha}")

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery]:
        if not previous_state.jit_mode:
            raise SpecError("LabelMixup works on numpy labels; move it before ToTensor()")
        return (
            replace(previous_state, shape=(3,), dtype=np.dtype(np.float32)),
            AllocationQuery((3,), np.dtype(np.float32)),
        )

    def generate_code(self) -> Callable[..., Any]:
        from beton_serve.pipeline.compiler import Compiler

        lambdas = Compiler.compile(_lambdas_fn())
        seed_key = mixup_key()

        def mixup(labels, dst, batch_indices, alpha, same):  # pragma: no cover - compiled
            n = labels.shape[0]
            lam = lambdas(batch_indices, seed_key, alpha, same)
            flat = labels.reshape(n, -1)
            for i in range(n):
                j = i - 1 if i > 0 else n - 1
                dst[i, 0] = flat[i, 0]
                dst[i, 1] = flat[j, 0]
                dst[i, 2] = lam[i]
            return dst

        return bind(mixup, self.alpha, bool(self.same_lambda), indices=True)

    def spec_params(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "same_lambda": self.same_lambda}


class MixupToOneHot(Operation):
    """``(B, 3)`` mixup rows to ``(B, num_classes)`` soft targets (torch, after ToTensor).

    ``out[i, a_i] += lam_i`` and ``out[i, b_i] += 1 - lam_i``. Differences from FFCV: when
    ``a_i == b_i`` the row is one-hot (1.0), where FFCV overwrote it with ``1 - lam_i``; and the
    input is not modified (FFCV rewrote its column 2 in place).
    """

    torch_op: ClassVar[bool] = True

    spec_name = "MixupToOneHot"

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.num_classes = check_int(type(self).__name__, "num_classes", num_classes)

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery]:
        if previous_state.jit_mode:
            raise SpecError("MixupToOneHot works on torch tensors; put it after ToTensor()")
        shape = (self.num_classes,)
        return replace(previous_state, shape=shape), AllocationQuery(
            shape, previous_state.dtype, previous_state.device
        )

    def generate_code(self) -> Callable[..., Any]:
        def one_hot(mixed, dst):
            import torch

            n = mixed.shape[0]
            dst = dst[:n]
            dst.zero_()
            rows = torch.arange(n, device=mixed.device)
            lam = mixed[:, 2].to(dst.dtype)
            dst.index_put_((rows, mixed[:, 0].long()), lam, accumulate=True)
            dst.index_put_((rows, mixed[:, 1].long()), 1 - lam, accumulate=True)
            return dst

        return one_hot

    def spec_params(self) -> dict[str, Any]:
        return {"num_classes": self.num_classes}
