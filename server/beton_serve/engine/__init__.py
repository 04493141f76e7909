"""The shared worker engine: traversal orders, the worker pool and batch sources.

``Engine`` (one pool of nogil worker threads shared by every stream), ``BatchSource`` (one
stream's batches as units of work with credit-based backpressure) and the orders used by both the
daemon and the in-process Loader.
"""

from __future__ import annotations

from beton_serve.engine.orders import OrderConfig, OrderOption, TraversalOrder, make_order

__all__ = ["OrderConfig", "OrderOption", "TraversalOrder", "make_order"]
