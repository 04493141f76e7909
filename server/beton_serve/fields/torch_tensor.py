"""Torch tensors (type 6; mirrors ``ffcv.fields.torch_tensor.TorchTensorField``).

Identical bytes to :class:`~beton_serve.fields.ndarray.NDArrayField` (same argument blob and
storage); the torch dtype is converted to numpy's (so bfloat16 is impossible). On read, a type-6
field becomes a plain ``NDArrayField``, as in FFCV. torch is imported only when one is built.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from beton_serve.fields.ndarray import NDArrayField

__all__ = ["TorchTensorField"]


class TorchTensorField(NDArrayField):
    """A CPU tensor of fixed shape and dtype per sample.

    Args:
        dtype: a ``torch.dtype`` with a numpy equivalent.
        shape: the per-sample shape.
    """

    def __init__(self, dtype: Any, shape: tuple[int, ...]) -> None:
        import torch

        try:
            np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        except (TypeError, RuntimeError) as exc:
            raise ValueError(f"torch dtype {dtype} has no numpy equivalent: {exc}") from None
        self.torch_dtype = dtype
        super().__init__(np_dtype, shape)

    @staticmethod
    def from_binary(binary: NDArray[np.uint8]) -> NDArrayField:
        """Read back as a plain :class:`NDArrayField` (FFCV does the same)."""
        return NDArrayField.from_binary(binary)
