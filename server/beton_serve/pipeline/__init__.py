"""Pipelines: ``Operation``, ``State``, ``AllocationQuery`` and the planner/compiler.

Importing this package does not import numba.
"""

from __future__ import annotations

from beton_serve.pipeline._plan import OutputSpec, Plan, PlanCache, compile_pipelines
from beton_serve.pipeline.allocation_query import AllocationQuery
from beton_serve.pipeline.compiler import Compiler
from beton_serve.pipeline.operation import Operation
from beton_serve.pipeline.pipeline_spec import PipelineSpec
from beton_serve.pipeline.state import State

__all__ = [
    "AllocationQuery",
    "Compiler",
    "Operation",
    "OutputSpec",
    "PipelineSpec",
    "Plan",
    "PlanCache",
    "State",
    "compile_pipelines",
]
