"""The ops at the planner's numpy/torch boundary: ``ToTensor`` and ``ModuleWrapper``.

Users import them from ``beton_serve.transforms`` (FFCV's paths ``ffcv.transforms.ops`` and
``ffcv.transforms.module``). They are defined here, in the pipeline layer, because the planner
itself uses them: it appends ``ToTensor()`` to a default pipeline and wraps the
``torch.nn.Module`` instances it finds. The pipeline layer never imports ``beton_serve.transforms``.
torch is imported when these ops run, never at import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, ClassVar

import numpy as np

from beton_serve.errors import SpecError
from beton_serve.pipeline.operation import Operation
from beton_serve.pipeline.state import State, is_torch_dtype

__all__ = ["ModuleWrapper", "ToTensor", "torch_dtype"]


def torch_dtype(dtype: Any) -> Any:
    """The torch dtype for a torch dtype, a numpy dtype or a name such as ``"float16"``."""
    import torch

    if is_torch_dtype(dtype):
        return dtype
    if isinstance(dtype, str) and hasattr(torch, dtype.replace("torch.", "")):
        candidate = getattr(torch, dtype.replace("torch.", ""))
        if is_torch_dtype(candidate):
            return candidate
    try:
        return torch.from_numpy(np.empty(0, dtype=np.dtype(dtype))).dtype
    except TypeError:
        raise SpecError(f"{dtype!r} is not a dtype torch supports") from None


class ToTensor(Operation):
    """numpy batch to a torch tensor without a copy (``torch.from_numpy``).

    A tensor input is passed through unchanged, so ``ToTensor`` may appear twice (e.g. a user
    pipeline that ends with it, plus the one appended to a default pipeline).
    """

    spec_name = "ToTensor"

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, None]:
        if not previous_state.jit_mode:
            return replace(previous_state), None
        return (
            State(
                jit_mode=False,
                device=previous_state.device,
                shape=previous_state.shape,
                dtype=torch_dtype(previous_state.dtype),
            ),
            None,
        )

    def generate_code(self) -> Callable[..., Any]:
        def to_tensor(inp, dst):
            import torch

            if isinstance(inp, torch.Tensor):
                return inp
            return torch.from_numpy(inp)

        return to_tensor

    def spec_params(self) -> dict[str, Any]:
        return {}


class ModuleWrapper(Operation):
    """Run a ``torch.nn.Module`` (or any callable on a torch batch) as a pipeline op.

    Modules found in a pipeline are wrapped automatically. The declared state is unchanged (a
    module that changes the shape still works; the state just does not describe it). A module
    has no wire description: it runs in the client, after the daemon-side prefix.
    """

    torch_op: ClassVar[bool] = True

    spec_name = "ModuleWrapper"

    def __init__(self, module: Any) -> None:
        super().__init__()
        self.module = module

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, None]:
        if previous_state.jit_mode:
            raise SpecError(
                f"{type(self.module).__name__} is a torch module; put it after ToTensor()"
            )
        return replace(previous_state), None

    def generate_code(self) -> Callable[..., Any]:
        module = self.module

        def apply(inp, dst):
            return module(inp)

        return apply

    def spec_params(self) -> dict[str, Any]:
        raise NotImplementedError(
            f"ModuleWrapper({type(self.module).__name__}) has no wire description: torch modules "
            "run in the client; put them after ToDevice or load a plugin op into the daemon"
        )
