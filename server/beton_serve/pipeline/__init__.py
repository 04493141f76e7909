"""Pipelines: ``Operation``, ``State``, ``AllocationQuery`` and the planner/compiler.

Also the boundary the planner splits a pipeline at, which ``beton_serve.transforms`` re-exports
for users: ``ToTensor`` (the end of the jit prefix), ``ModuleWrapper`` (a torch module as an op)
and ``torch_dtype``; and ``OpFailure``, what ``Plan.run`` raises when an op fails on a sample.
The persistent compile cache is ``beton_serve.pipeline.compile_cache`` (not imported here).

Importing this package does not import numba.
"""

from __future__ import annotations

from beton_serve import _cfunc_hook
from beton_serve.pipeline._boundary import ModuleWrapper, ToTensor, torch_dtype
from beton_serve.pipeline._plan import (
    OpFailure,
    OutputSpec,
    Plan,
    PlanCache,
    WorkspaceMemory,
    compile_pipelines,
    set_idle_workspace_limit,
    workspace_memory,
)
from beton_serve.pipeline.allocation_query import AllocationQuery
from beton_serve.pipeline.compiler import Compiler
from beton_serve.pipeline.operation import Operation
from beton_serve.pipeline.pipeline_spec import PipelineSpec
from beton_serve.pipeline.state import State


def _cached_cfunc(sig: object) -> object:
    from beton_serve.pipeline.compile_cache import cached_cfunc

    return cached_cfunc(sig)


_cfunc_hook.register(_cached_cfunc)  # type: ignore[arg-type]

__all__ = [
    "AllocationQuery",
    "Compiler",
    "ModuleWrapper",
    "OpFailure",
    "Operation",
    "OutputSpec",
    "PipelineSpec",
    "Plan",
    "PlanCache",
    "State",
    "ToTensor",
    "WorkspaceMemory",
    "compile_pipelines",
    "set_idle_workspace_limit",
    "torch_dtype",
    "workspace_memory",
]
