"""beton_client: the trainer-side Loader of beton-serve.

``from beton_client import Loader, OrderOption`` replaces ``from ffcv.loader import Loader,
OrderOption``. Importing this package never imports numba, cv2 or torch (torch is imported when a
pipeline has client-side ops).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from beton_client._options import ServeOptions
from beton_client._resume import RetryPolicy
from beton_client.errors import (
    AuthError,
    BetonClientError,
    DataError,
    FormatError,
    PipelineError,
    ResourceExhausted,
    ServerError,
    ServerUnavailable,
    SpecError,
    TransportError,
    UntrustedSocketError,
)

if TYPE_CHECKING:
    from beton_client._loader import Loader, OrderOption


def __getattr__(name: str) -> Any:
    # The served Loader (and grpc) load on first use: the in-process Loader imports the front
    # end (beton_client.frontend) without them.
    if name in ("Loader", "OrderOption"):
        from beton_client._gcpause import gc_paused

        with gc_paused():  # grpc and protobuf: no full collection of the trainer's objects
            from beton_client import _loader

        return getattr(_loader, name)
    raise AttributeError(f"module 'beton_client' has no attribute {name!r}")


__all__ = [
    "AuthError",
    "BetonClientError",
    "DataError",
    "FormatError",
    "Loader",
    "OrderOption",
    "PipelineError",
    "ResourceExhausted",
    "RetryPolicy",
    "ServerError",
    "ServeOptions",
    "ServerUnavailable",
    "SpecError",
    "TransportError",
    "UntrustedSocketError",
]
