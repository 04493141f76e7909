"""``Squeeze`` (mirrors ``ffcv.transforms.common``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, ClassVar

from beton_serve.errors import SpecError
from beton_serve.pipeline.operation import Operation
from beton_serve.pipeline.state import State

__all__ = ["Squeeze"]


class Squeeze(Operation):
    """In-place ``squeeze_(*dims)`` of a torch batch (``(B, 1)`` labels to ``(B,)``).

    ``dims`` are dimensions of the batch tensor (0 is the batch dimension), as in FFCV. The
    declared per-sample shape drops the size-1 dimensions that are squeezed (all of them when
    ``dims`` is empty); FFCV always declared all of them dropped.
    """

    torch_op: ClassVar[bool] = True

    spec_name = "Squeeze"

    def __init__(self, *dims: int) -> None:
        super().__init__()
        self.dims = tuple(int(d) for d in dims)

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, None]:
        if previous_state.jit_mode:
            raise SpecError("Squeeze works on torch tensors; put it after ToTensor()")
        shape = previous_state.shape or ()
        if not self.dims:
            new = tuple(s for s in shape if s != 1)
        else:
            nd = len(shape) + 1
            drop = {(d % nd) - 1 for d in self.dims}
            new = tuple(s for i, s in enumerate(shape) if not (i in drop and s == 1))
        return replace(previous_state, shape=new), None

    def generate_code(self) -> Callable[..., Any]:
        dims = self.dims

        def squeeze(inp, dst):
            if not dims:
                return inp.squeeze_()
            for d in sorted((d % inp.dim() for d in dims), reverse=True):
                inp = inp.squeeze_(d)
            return inp

        return squeeze

    def spec_params(self) -> dict[str, Any]:
        return {"dims": list(self.dims)}

    @classmethod
    def from_spec(cls, params: dict[str, Any]) -> Squeeze:
        """Rebuild from :meth:`spec_params` (``dims`` is a list, the constructor takes ``*dims``)."""
        dims = params.get("dims", [])
        if set(params) - {"dims"} or not isinstance(dims, list):
            raise SpecError(f"Squeeze takes {{'dims': [int, ...]}}, got {params!r}")
        return cls(*dims)
