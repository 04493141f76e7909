"""The shared worker engine: traversal orders, the worker pool and batch sources.

``Engine`` (one pool of nogil worker threads shared by every stream), ``BatchSource`` (one
stream's batches as units of work with credit-based backpressure) and the orders used by both the
daemon and the in-process Loader.
"""

from __future__ import annotations

from beton_serve.engine._decode_groups import dataset_identity
from beton_serve.engine._future import BatchFuture, Releasable, SourceCaps, ids_or
from beton_serve.engine._pool import Demand, Engine, Task
from beton_serve.engine._source import BadSample, BatchSource, delivered_ids
from beton_serve.engine.orders import (
    OrderConfig,
    OrderOption,
    TraversalOrder,
    distributed_rank_world,
    epoch_length,
    make_order,
)

__all__ = [
    "BadSample",
    "BatchFuture",
    "BatchSource",
    "Demand",
    "Engine",
    "OrderConfig",
    "OrderOption",
    "Releasable",
    "SourceCaps",
    "Task",
    "TraversalOrder",
    "dataset_identity",
    "delivered_ids",
    "distributed_rank_world",
    "epoch_length",
    "ids_or",
    "make_order",
]
