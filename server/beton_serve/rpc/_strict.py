"""Registering the ``BetonServe`` servicer so that an unparseable message is ``INVALID_ARGUMENT``.

grpcio's generated ``add_BetonServeServicer_to_server`` deserialises with ``FromString``; when
that raises (a malformed protobuf, a length prefix that declares more bytes than the message
has), the aio server answers ``UNKNOWN`` ("Unexpected DecodeError") before any of our code runs.
Here each deserialiser catches the ``DecodeError`` and passes a :class:`Malformed` marker to a
thin wrapper, which ends the call with ``INVALID_ARGUMENT`` (``beton-error: SpecError``) naming
the message type. Nothing is allocated for declared sizes: protobuf checks each length prefix
against the bytes actually received (bounded by ``grpc.max_receive_message_length``, which is
``beton_wire.limits.MAX_REQUEST_BYTES``). An ``OpenStreamRequest`` with more indices than
``MAX_INDICES`` is refused (:class:`Refused`, ``INVALID_ARGUMENT``) before it is parsed
(``_convert.check_open_stream_bytes``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from beton_wire.v1 import beton_pb2 as pb
from google.protobuf.message import DecodeError

from beton_serve.errors import SpecError
from beton_serve.rpc._convert import check_open_stream_bytes

__all__ = ["Malformed", "Refused", "add_strict_servicer"]

SERVICE_NAME = "beton_wire.v1.BetonServe"


@dataclass(frozen=True, slots=True)
class Malformed:
    """A request that did not parse: its message type and the parser's error."""

    kind: str
    error: str


@dataclass(frozen=True, slots=True)
class Refused:
    """A request refused before parsing (``precheck``), with the message to send."""

    message: str


def _lenient(cls: Any, precheck: Callable[[bytes], None] | None = None) -> Callable[[bytes], Any]:
    def parse(raw: bytes) -> Any:
        if precheck is not None:
            try:
                precheck(raw)
            except SpecError as exc:
                return Refused(str(exc))
        try:
            return cls.FromString(raw)
        except (DecodeError, ValueError) as exc:
            return Malformed(cls.DESCRIPTOR.full_name, str(exc))

    return parse


async def _refuse(context: Any, bad: Malformed | Refused) -> None:
    context.set_trailing_metadata((("beton-error", "SpecError"),))
    if isinstance(bad, Refused):
        message = bad.message
    else:
        message = (
            f"malformed {bad.kind} message ({bad.error}); send a message built from "
            "beton_wire/v1/beton.proto"
        )
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)


def _unary(fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    async def handler(request: Any, context: Any) -> Any:
        if isinstance(request, Malformed | Refused):
            await _refuse(context, request)
        return await fn(request, context)

    return handler


def _stream(fn: Callable[[Any, Any], AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    async def handler(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        bad: list[Malformed] = []

        async def checked() -> AsyncIterator[Any]:
            async for r in requests:
                if isinstance(r, Malformed):
                    bad.append(r)
                    return  # the daemon sees the client hang up, and frees the stream
                yield r

        try:
            async for out in fn(checked(), context):
                if bad:
                    break
                yield out
        except grpc.aio.AbortError:
            if not bad:
                raise
        if bad:
            await _refuse(context, bad[0])

    return handler


def add_strict_servicer(servicer: Any, server: Any) -> None:
    """Register ``servicer`` (a ``BetonServeServicer``) on ``server`` (see the module docstring)."""
    unary = (
        ("ListDatasets", pb.ListDatasetsRequest, pb.ListDatasetsResponse),
        ("DescribeDataset", pb.DescribeDatasetRequest, pb.DatasetInfo),
        ("OpenStream", pb.OpenStreamRequest, pb.OpenStreamResponse),
        ("Stats", pb.StatsRequest, pb.StatsResponse),
    )
    # OpenStream's indices are counted on the raw bytes: parsing 13 M of them costs 100 MB.
    prechecks = {"OpenStream": check_open_stream_bytes}
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            _unary(getattr(servicer, name)),
            request_deserializer=_lenient(req, prechecks.get(name)),
            response_serializer=resp.SerializeToString,
        )
        for name, req, resp in unary
    }
    handlers["Batches"] = grpc.stream_stream_rpc_method_handler(
        _stream(servicer.Batches),
        request_deserializer=_lenient(pb.ClientMessage),
        response_serializer=pb.ServerMessage.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    register = getattr(server, "add_registered_method_handlers", None)
    if register is not None:
        register(SERVICE_NAME, handlers)
