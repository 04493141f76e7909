"""The client's error hierarchy, and the one function that turns gRPC errors into it.

Every error ``beton_client`` raises derives from :class:`BetonClientError`. No ``grpc.RpcError``
reaches user code: each call site does ``except grpc.RpcError as e: raise from_rpc_error(e)
from None``.

=====================  ==========================================  =============================
class                  when                                        daemon status (or cause)
=====================  ==========================================  =============================
``SpecError``          the request is wrong: change it             ``INVALID_ARGUMENT``
``TransportError``     the transport cannot work here              ``FAILED_PRECONDITION``
``ServerUnavailable``  no daemon answers, or it is shutting down   ``UNAVAILABLE``, deadlines
``FormatError``        the dataset file is damaged (a DataError)   ``DATA_LOSS``
``PipelineError``      a batch failed in the daemon                ``INTERNAL``
``ResourceExhausted``  the daemon's stream memory budget is full   ``RESOURCE_EXHAUSTED``
``AuthError``          missing or wrong token                      ``UNAUTHENTICATED`` ...
``ServerError``        anything else the daemon reported           other codes
=====================  ==========================================  =============================

:class:`UntrustedSocketError` comes from no status: the client raises it before connecting, when
the Unix socket or its directory is not the expected user's.
"""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = [
    "AuthError",
    "BetonClientError",
    "DataError",
    "FormatError",
    "PipelineError",
    "ResourceExhausted",
    "ServerError",
    "ServerUnavailable",
    "SpecError",
    "TransportError",
    "UntrustedSocketError",
    "from_rpc_error",
]


class BetonClientError(Exception):
    """Base class of every error raised by ``beton_client``.

    Attributes:
        code: the gRPC status name the daemon sent (e.g. ``"INVALID_ARGUMENT"``), or ``""``.
        server_error: the daemon-side error class name, when it said.
    """

    def __init__(self, message: str, *, code: str = "", server_error: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.server_error = server_error


class SpecError(BetonClientError, ValueError):
    """The Loader's arguments or pipelines are invalid; the message says what to change."""


class TransportError(BetonClientError):
    """The requested transport cannot work (the message gives the reason and the fix)."""


class ServerUnavailable(BetonClientError, ConnectionError):
    """No daemon answers at the address, it went away, or it is shutting down."""


class DataError(BetonClientError):
    """The daemon found the dataset file damaged."""


class FormatError(DataError):
    """The dataset file is malformed, truncated or inconsistent: the daemon's ``FormatError``,
    under the same name as the one the in-process Loader raises
    (``beton_serve.errors.FormatError``). A :class:`DataError`."""


class PipelineError(BetonClientError):
    """A batch failed in the daemon (the message names the sample and the op)."""


class ResourceExhausted(BetonClientError):
    """The daemon cannot hold this stream's buffers now (its ``max_ring_bytes`` budget, or a
    gRPC message limit): the message says what it needs and what is held. Not retried: ask for
    less (``batch_size``, ``batches_ahead``), wait for other streams to close, or raise the
    daemon's ``--max-ring-bytes``."""


class AuthError(BetonClientError, PermissionError):
    """The daemon refused the credentials."""


class UntrustedSocketError(BetonClientError, PermissionError):
    """The daemon's Unix socket, or its directory, is not the expected user's (or others may
    write the directory): another user may have planted it, so the client refuses to connect.

    The message names the path and what is wrong. Raised before any connection is made.
    """


class ServerError(BetonClientError):
    """Any other error reported by the daemon."""


_BY_CODE: dict[str, type[BetonClientError]] = {
    "INVALID_ARGUMENT": SpecError,
    "NOT_FOUND": SpecError,
    "OUT_OF_RANGE": SpecError,
    "FAILED_PRECONDITION": TransportError,
    "UNAVAILABLE": ServerUnavailable,
    "DEADLINE_EXCEEDED": ServerUnavailable,
    "CANCELLED": ServerUnavailable,
    "DATA_LOSS": FormatError,
    "INTERNAL": PipelineError,
    "RESOURCE_EXHAUSTED": ResourceExhausted,
    "UNAUTHENTICATED": AuthError,
    "PERMISSION_DENIED": AuthError,
}


def from_rpc_error(err: Any, *, target: str = "") -> BetonClientError:
    """Translate a ``grpc.RpcError`` (or anything with ``code()``/``details()``) into our error.

    Args:
        err: the error raised by a gRPC call.
        target: the daemon address, mentioned when it cannot be reached.

    Returns:
        The matching :class:`BetonClientError` (raise it ``from None``).

    ``err``'s traceback is dropped: a streaming call's ``RpcError`` is the call object itself,
    which the traceback's frames hold, and the cycle would keep the call (and whatever its
    caller's frame holds: a stream, its buffers) until a full garbage collection.
    """
    with contextlib.suppress(AttributeError, TypeError):
        err.__traceback__ = None
    try:
        code = err.code()
        name = getattr(code, "name", str(code))
    except Exception:
        name = "UNKNOWN"
    try:
        details = err.details() or ""
    except Exception:
        details = str(err)
    server_error = ""
    try:
        for key, value in err.trailing_metadata() or ():
            if key == "beton-error":
                server_error = str(value)
    except Exception:
        pass
    cls = _BY_CODE.get(name, ServerError)
    if server_error == "InternalError":
        cls = ServerError
    message = details
    if cls is ServerUnavailable and server_error == "":
        where = f" at {target}" if target else ""
        message = f"no beton-serve daemon answers{where} ({name}: {details})"
    return cls(message, code=name, server_error=server_error)
