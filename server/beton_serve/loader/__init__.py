"""The in-process Loader (``from beton_serve.loader import Loader, OrderOption``), FFCV's API."""

from __future__ import annotations

from beton_serve.engine.orders import OrderOption, TraversalOrder
from beton_serve.loader._loader import EpochIterator, Loader

__all__ = ["EpochIterator", "Loader", "OrderOption", "TraversalOrder"]
