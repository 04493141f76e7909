"""Conversion ops: ``ToTensor``, ``ToDevice``, ``ToTorchImage``, ``Convert``, ``View``
(mirror ``ffcv.transforms.ops``).

From ``ToTensor`` on, a pipeline holds torch tensors and its ops run as plain Python in the
consumer (the "client tail"); torch is imported when these ops run, never at import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, ClassVar

import numpy as np
from beton_wire.limits import short_repr

from beton_serve.errors import SpecError
from beton_serve.pipeline import ToTensor, torch_dtype
from beton_serve.pipeline.allocation_query import AllocationQuery
from beton_serve.pipeline.operation import Operation
from beton_serve.pipeline.state import State, is_torch_dtype
from beton_serve.transforms._util import dtype_name

__all__ = ["Convert", "ToDevice", "ToTensor", "ToTorchImage", "View", "torch_dtype"]


def _require_torch(op: Operation, state: State) -> None:
    if state.jit_mode:
        raise SpecError(
            f"{type(op).__name__} works on torch tensors; put it after ToTensor() in the pipeline"
        )


def _check_device(device: Any) -> None:
    """Refuse a CUDA device this process does not have, in the served Loader's words."""
    dev = str(device)
    if not dev.startswith("cuda"):
        return
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    tail = dev.partition(":")[2]
    index = int(tail) if tail.isdigit() else 0
    if index >= n:
        have = [f"cuda:{i}" for i in range(n)]
        hint = (
            "pick one of those"
            if have
            else "install a CUDA build of torch here, or use ToDevice('cpu')"
        )
        raise SpecError(
            f"ToDevice({short_repr(dev)}): this process sees {have or 'no CUDA device'}; {hint}"
        )


class ToDevice(Operation):
    """Copy into a preallocated buffer on ``device`` (channels-last inputs stay channels-last)."""

    torch_op: ClassVar[bool] = True

    spec_name = "ToDevice"

    def __init__(self, device: Any, non_blocking: bool = True) -> None:
        super().__init__()
        self.device = device
        self.non_blocking = bool(non_blocking)

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery]:
        _require_torch(self, previous_state)
        _check_device(self.device)
        return replace(previous_state, device=self.device), AllocationQuery(
            previous_state.shape,  # type: ignore[arg-type]
            previous_state.dtype,
            self.device,
        )

    def generate_code(self) -> Callable[..., Any]:
        device = self.device
        non_blocking = self.non_blocking

        def to_device(inp, dst):
            import torch

            if dst is None:
                return inp.to(device, non_blocking=non_blocking)
            n = inp.shape[0]
            if inp.dim() == 4 and inp.is_contiguous(memory_format=torch.channels_last):
                b, c, h, w = dst.shape
                dst = dst.reshape(b, h, w, c).permute(0, 3, 1, 2)
            dst = dst[:n]
            dst.copy_(inp, non_blocking=non_blocking)
            return dst

        return to_device

    def spec_params(self) -> dict[str, Any]:
        return {"device": str(self.device), "non_blocking": self.non_blocking}


class ToTorchImage(Operation):
    """``(B, H, W, C)`` to ``(B, C, H, W)``: a zero-copy channels-last view, or a copy.

    With ``convert_back_int16``, an int16 batch (``NormalizeImage``'s float16 bit pattern) is
    reinterpreted as float16.
    """

    torch_op: ClassVar[bool] = True

    spec_name = "ToTorchImage"

    def __init__(self, channels_last: bool = True, convert_back_int16: bool = True) -> None:
        super().__init__()
        self.channels_last = bool(channels_last)
        self.convert_back_int16 = bool(convert_back_int16)

    def declare_state_and_memory(
        self, previous_state: State
    ) -> tuple[State, AllocationQuery | None]:
        _require_torch(self, previous_state)
        shape = previous_state.shape
        if shape is None or len(shape) != 3:
            raise SpecError(f"ToTorchImage needs (H, W, C) images per sample, got {shape}")
        import torch

        dtype = previous_state.dtype
        if self.convert_back_int16 and dtype == torch.int16:
            dtype = torch.float16
        h, w, c = shape
        state = replace(previous_state, shape=(c, h, w), dtype=dtype)
        if self.channels_last:
            return state, None
        return state, AllocationQuery((c, h, w), dtype, previous_state.device)

    def generate_code(self) -> Callable[..., Any]:
        channels_last = self.channels_last
        convert = self.convert_back_int16

        def to_torch_image(inp, dst):
            import torch

            if convert and inp.dtype == torch.int16:
                inp = inp.view(torch.float16)
            out = inp.permute(0, 3, 1, 2)
            if channels_last:
                return out
            dst = dst[: inp.shape[0]]
            dst.copy_(out)
            return dst

        return to_torch_image

    def spec_params(self) -> dict[str, Any]:
        return {"channels_last": self.channels_last, "convert_back_int16": self.convert_back_int16}


class Convert(Operation):
    """``tensor.type(target_dtype)`` (a new tensor every batch, as in FFCV)."""

    torch_op: ClassVar[bool] = True

    spec_name = "Convert"

    def __init__(self, target_dtype: Any) -> None:
        super().__init__()
        self.target_dtype = target_dtype

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, None]:
        _require_torch(self, previous_state)
        self._target = torch_dtype(self.target_dtype)
        return replace(previous_state, dtype=self._target), None

    def generate_code(self) -> Callable[..., Any]:
        target = torch_dtype(self.target_dtype)

        def convert(inp, dst):
            return inp.type(target)

        return convert

    def spec_params(self) -> dict[str, Any]:
        return {"target_dtype": dtype_name(self.target_dtype)}


class View(Operation):
    """Reinterpret the batch's bytes as ``target_dtype`` (``.view``); numpy or torch input.

    Runs as Python (out of the compiled prefix), as FFCV's ``View`` does.
    """

    spec_name = "View"

    def __init__(self, target_dtype: Any) -> None:
        super().__init__()
        self.target_dtype = target_dtype

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, None]:
        if previous_state.jit_mode and not is_torch_dtype(self.target_dtype):
            dtype: Any = np.dtype(self.target_dtype)
        else:
            dtype = torch_dtype(self.target_dtype)
        return replace(previous_state, dtype=dtype, jit_mode=False), None

    def generate_code(self) -> Callable[..., Any]:
        target = self.target_dtype

        def view(inp, dst):
            if isinstance(inp, np.ndarray):
                if is_torch_dtype(target):
                    import torch

                    return torch.from_numpy(inp).view(target)
                return inp.view(np.dtype(target))
            return inp.view(torch_dtype(target))

        return view

    def spec_params(self) -> dict[str, Any]:
        return {"target_dtype": dtype_name(self.target_dtype)}
