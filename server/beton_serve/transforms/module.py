"""``ModuleWrapper`` (mirrors ``ffcv.transforms.module``).

The class lives in ``beton_serve.pipeline`` (``_boundary``), because the planner wraps the torch
modules it finds in a pipeline and must not import this layer above it.
"""

from __future__ import annotations

from beton_serve.pipeline import ModuleWrapper

__all__ = ["ModuleWrapper"]
