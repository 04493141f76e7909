"""Domain errors -> gRPC status codes, for the rpc layer.

The table itself lives in :mod:`beton_serve.transport.status` (the batch streams of the transport
layer use it too); this module re-exports it where the rpc layer's users expect it.
"""

from __future__ import annotations

from beton_serve.transport.status import ERROR_METADATA_KEY, STATUS_TABLE, status_for

__all__ = ["ERROR_METADATA_KEY", "STATUS_TABLE", "status_for"]
