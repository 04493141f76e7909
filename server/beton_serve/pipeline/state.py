"""The state that flows through a pipeline while it is planned (mirrors ``ffcv.pipeline.state``).

Each op's ``declare_state_and_memory`` receives the state its input will have and returns the state
its output will have. Nothing runs while states are declared: the planner uses them to allocate
every buffer once, up front, and to decide which ops run as compiled (``jit_mode``) code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["State", "is_torch_dtype"]


def is_torch_dtype(dtype: Any) -> bool:
    """True if ``dtype`` is a ``torch.dtype`` (checked without importing torch)."""
    return type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype"


def _is_cpu(device: Any) -> bool:
    if device is None:
        return True
    text = device if isinstance(device, str) else str(device)
    return text == "cpu" or text.startswith("cpu:")


@dataclass
class State:
    """Shape, dtype and device of a per-sample value at one point of a pipeline.

    Attributes:
        jit_mode: ``True`` while the value is a numpy array handled by compiled (Numba) code;
            ``False`` once it is a torch tensor handled by Python.
        device: ``"cpu"`` (or a ``torch.device``) where the value lives.
        shape: per-sample shape (no batch dimension); ``None`` before a decoder declares it.
        dtype: a numpy dtype in jit mode, a numpy or torch dtype afterwards.

    Change a state with :func:`dataclasses.replace`, as FFCV code does.
    """

    jit_mode: bool
    device: Any
    shape: tuple[int, ...] | None
    dtype: Any

    def __post_init__(self) -> None:
        if self.jit_mode:
            if not _is_cpu(self.device):
                raise ValueError(f"a jit-mode state must be on the CPU, not {self.device}")
            if is_torch_dtype(self.dtype):
                raise ValueError(f"a jit-mode state needs a numpy dtype, not {self.dtype}")
            if self.dtype is not None and not isinstance(self.dtype, np.dtype):
                self.dtype = np.dtype(self.dtype)
        if self.shape is not None:
            self.shape = tuple(int(s) for s in self.shape)
