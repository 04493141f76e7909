"""``NormalizeImage`` (mirrors ``ffcv.transforms.normalize``), CPU path and a torch fallback.

A lookup table ``T[v, c] = (v - mean[c]) / std[c]`` is computed in float64 for every uint8
value ``v`` and cast to ``type``; each pixel is then a table lookup.

* numpy (jit) input ``(H, W, 3)`` uint8, before ToTensor: output ``(H, W, 3)`` of ``type``,
  except **float16, which comes out as its int16 bit pattern** (Numba has no float16, as in
  FFCV); ``ToTorchImage(convert_back_int16=True)`` reinterprets it as float16 later.
* torch input (after ToTensor/ToTorchImage, ``(C, H, W)`` per sample, any device): the same table
  applied with torch indexing; the output is of the torch dtype of ``type`` (float16 works) and
  keeps the input's memory format. (FFCV's CuPy kernel belongs to the CUDA path.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from beton_serve.errors import SpecError
from beton_serve.pipeline.allocation_query import AllocationQuery
from beton_serve.pipeline.operation import Operation
from beton_serve.pipeline.state import State
from beton_serve.transforms._util import bind, dtype_name, to_list

__all__ = ["NormalizeImage"]


class NormalizeImage(Operation):
    """``(img - mean) / std`` per channel through a 256-entry table, output dtype ``type``."""

    spec_name = "NormalizeImage"
    compile_ahead = True

    def __init__(self, mean: np.ndarray, std: np.ndarray, type: Any) -> None:
        super().__init__()
        self.mean = np.asarray(mean, dtype=np.float64)
        self.std = np.asarray(std, dtype=np.float64)
        self.type = np.dtype(type)
        self._jit_input = True
        if self.mean.shape != (3,) or self.std.shape != (3,):
            raise SpecError("NormalizeImage: mean and std must have 3 values (one per channel)")

    def lookup_table(self) -> np.ndarray:
        """``(256, 3)`` table of ``type`` (float16 as its int16 bit pattern)."""
        v = np.arange(256, dtype=np.float64)[:, None]
        table = ((v - self.mean[None, :]) / self.std[None, :]).astype(self.type)
        if self.type == np.float16:
            table = table.view(np.int16)
        return table

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery]:
        shape = previous_state.shape
        self._jit_input = bool(previous_state.jit_mode)
        if previous_state.jit_mode:
            if shape is None or len(shape) != 3 or shape[2] != 3:
                raise SpecError(f"NormalizeImage needs (H, W, 3) uint8 images, got {shape}")
            out = np.dtype(np.int16) if self.type == np.float16 else self.type
            return replace(previous_state, dtype=out), AllocationQuery(shape, out)
        import torch

        tdtype = getattr(torch, self.type.name)
        return replace(previous_state, dtype=tdtype), AllocationQuery(
            shape,  # type: ignore[arg-type]
            tdtype,
            previous_state.device,
        )

    def generate_code(self) -> Callable[..., Any]:
        table = self.lookup_table()
        ttype = self.type

        def normalize(images, dst, table):  # pragma: no cover - compiled
            n, h, w = images.shape[0], images.shape[1], images.shape[2]
            for i in range(n):
                for y in range(h):
                    for x in range(w):
                        for c in range(3):
                            dst[i, y, x, c] = table[images[i, y, x, c], c]
            return dst

        def normalize_torch(images, dst):
            import torch

            tab = torch.from_numpy(table.view(np.float16) if ttype == np.float16 else table)
            tab = tab.to(images.device)
            n, c, h, w = images.shape
            # As FFCV: the result is written channels-last and returned as an NCHW view of it
            # (channels_last strides), the layout channels_last models read without a copy.
            nhwc = dst[:n].reshape(-1)[: n * c * h * w].view(n, h, w, c)
            idx = images.permute(0, 2, 3, 1).long()
            for k in range(3):
                nhwc[..., k] = tab[:, k][idx[..., k]]
            return nhwc.permute(0, 3, 1, 2)

        return bind(normalize, table) if self._jit_input else normalize_torch

    def spec_params(self) -> dict[str, Any]:
        return {"mean": to_list(self.mean), "std": to_list(self.std), "type": dtype_name(self.type)}
