"""``ReplaceLabel`` (mirrors ``ffcv.transforms.replace_label``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from beton_serve.errors import SpecError
from beton_serve.pipeline.operation import Operation
from beton_serve.pipeline.state import State
from beton_serve.transforms._util import bind, check_int, to_list

__all__ = ["ReplaceLabel"]


class ReplaceLabel(Operation):
    """Set the label of the samples listed in ``indices`` to ``new_label`` (in place)."""

    spec_name = "ReplaceLabel"

    def __init__(self, indices: Sequence[int], new_label: int) -> None:
        super().__init__()
        self.indices = np.sort(np.asarray(indices, dtype=np.uint64))
        self.new_label = check_int(type(self).__name__, "new_label", new_label)

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, None]:
        if not previous_state.jit_mode:
            raise SpecError("ReplaceLabel works on numpy labels; move it before ToTensor()")
        return replace(previous_state), None

    def generate_code(self) -> Callable[..., Any]:
        def replace_label(labels, dst, batch_indices, chosen, new):  # pragma: no cover - compiled
            for i in range(labels.shape[0]):
                sid = np.uint64(batch_indices[i])
                k = np.searchsorted(chosen, sid)
                if k < chosen.shape[0] and chosen[k] == sid:
                    labels[i] = new
            return labels

        return bind(replace_label, self.indices, self.new_label, indices=True)

    def spec_params(self) -> dict[str, Any]:
        return {"indices": to_list(self.indices), "new_label": self.new_label}
