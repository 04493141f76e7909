"""Per-sample memory requests (mirrors ``ffcv.pipeline.allocation_query``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

__all__ = ["AllocationQuery", "Allocation"]


@dataclass(frozen=True)
class AllocationQuery:
    """Memory an op needs for its output, **per sample** (the planner adds the batch dimension).

    Attributes:
        shape: per-sample shape.
        dtype: numpy dtype (compiled ops) or torch dtype (torch ops).
        device: ``None`` or ``"cpu"`` for host memory, else a torch device.
    """

    shape: tuple[int, ...]
    dtype: Any
    device: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if any(s < 0 for s in self.shape):
            raise ValueError(f"negative dimension in allocation shape {self.shape}")


#: What ``declare_state_and_memory`` may return as its second element: one query, several, or none.
Allocation = Union[AllocationQuery, "tuple[AllocationQuery, ...]", "list[AllocationQuery]", None]
