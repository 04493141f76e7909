"""The gRPC layer: the only place that touches protobuf messages and status codes.

``create_server(daemon, unix_socket=..., listen=[...]) -> ServerHandle`` builds a grpc.aio server
with the BetonServe service, health and reflection; ``status_for(exc)`` is the error mapping.
"""

from __future__ import annotations

from beton_serve.rpc._errors import ERROR_METADATA_KEY, status_for
from beton_serve.rpc._server import SERVICE_NAME, ServerHandle, create_server
from beton_serve.rpc._service import BetonServeServicer

__all__ = [
    "ERROR_METADATA_KEY",
    "SERVICE_NAME",
    "BetonServeServicer",
    "ServerHandle",
    "create_server",
    "status_for",
]
