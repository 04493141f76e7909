"""``ModuleWrapper`` (mirrors ``ffcv.transforms.module``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from beton_serve.errors import SpecError
from beton_serve.pipeline.operation import Operation
from beton_serve.pipeline.state import State

__all__ = ["ModuleWrapper"]


class ModuleWrapper(Operation):
    """Run a ``torch.nn.Module`` (or any callable on a torch batch) as a pipeline op.

    Modules found in a pipeline are wrapped automatically. The declared state is unchanged (a
    module that changes the shape still works; the state just does not describe it). A module
    has no wire description: it runs in the client, after the daemon-side prefix.
    """

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
