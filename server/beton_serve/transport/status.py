"""Domain errors -> gRPC status codes: the one table (the rpc layer and the batch streams use it).

Every error also travels as its class name in the ``beton-error`` trailing metadata, so that
``beton_client`` raises the matching class of its own hierarchy; the status code alone lets any
other gRPC client react sensibly.

======================================  =======================  ================================
error                                   status                   meaning for the client
======================================  =======================  ================================
``ShuttingDown``                        ``UNAVAILABLE``          retry against a new daemon
``SpecError``, ``ConfigError``,         ``INVALID_ARGUMENT``     change the request (message says
``FramingError``                                                 how)
``TransportError``                      ``FAILED_PRECONDITION``  the transport cannot work here
``FormatError``                         ``DATA_LOSS``            the dataset file is damaged
``ResourceExhausted``                   ``RESOURCE_EXHAUSTED``   the daemon's stream memory is
                                                                 full: wait, or ask for less
``PipelineError``                       ``INTERNAL``             a batch failed (sample, op named)
other ``BetonError``                    ``UNKNOWN``
anything else                           ``INTERNAL``             a bug: logged with its traceback
======================================  =======================  ================================
"""

from __future__ import annotations

import logging

import grpc
from beton_wire.framing import FramingError
from beton_wire.limits import cap_message

from beton_serve.errors import (
    BetonError,
    ConfigError,
    FormatError,
    PipelineError,
    ResourceExhausted,
    ShuttingDown,
    SpecError,
    TransportError,
)

__all__ = ["ERROR_METADATA_KEY", "STATUS_TABLE", "status_for"]

log = logging.getLogger("beton_serve.rpc")

#: Trailing-metadata key carrying the error's class name.
ERROR_METADATA_KEY = "beton-error"

#: First match wins, so subclasses come before their bases.
STATUS_TABLE: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (ShuttingDown, grpc.StatusCode.UNAVAILABLE),
    (SpecError, grpc.StatusCode.INVALID_ARGUMENT),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (FramingError, grpc.StatusCode.INVALID_ARGUMENT),
    (TransportError, grpc.StatusCode.FAILED_PRECONDITION),
    (FormatError, grpc.StatusCode.DATA_LOSS),
    (PipelineError, grpc.StatusCode.INTERNAL),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (BetonError, grpc.StatusCode.UNKNOWN),
)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str, str]:
    """``(status code, message, error class name)`` to send for ``exc``.

    Unexpected exceptions (none of the table's) are logged with their traceback here, since they
    are bugs, and reach the client as ``INTERNAL`` with the exception's text. The message is cut
    to ``beton_wire.limits.MAX_ERROR_CHARS`` (gRPC drops a status over 16 KiB and reports
    ``RESOURCE_EXHAUSTED`` instead).
    """
    for cls, code in STATUS_TABLE:
        if isinstance(exc, cls):
            return code, cap_message(str(exc)), type(exc).__name__
    log.error("unexpected error while serving a request", exc_info=exc)
    text = cap_message(f"internal error: {type(exc).__name__}: {exc}")
    return grpc.StatusCode.INTERNAL, text, "InternalError"
