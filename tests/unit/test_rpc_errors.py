"""One error mapping on each side: domain errors -> status codes (daemon), RpcError -> ours (client)."""

from __future__ import annotations

import gc
import weakref

import grpc
import pytest
from beton_client import errors as ce
from beton_serve.daemon import ShuttingDown
from beton_serve.errors import (
    BetonError,
    ConfigError,
    FormatError,
    PipelineError,
    SpecError,
    TransportError,
    UnknownDataset,
)
from beton_serve.rpc import status_for


@pytest.mark.parametrize(
    ("exc", "code", "client_cls"),
    [
        (SpecError("bad op"), grpc.StatusCode.INVALID_ARGUMENT, ce.SpecError),
        (UnknownDataset("unknown dataset 'x'"), grpc.StatusCode.INVALID_ARGUMENT, ce.SpecError),
        (ConfigError("bad"), grpc.StatusCode.INVALID_ARGUMENT, ce.SpecError),
        (TransportError("no shm"), grpc.StatusCode.FAILED_PRECONDITION, ce.TransportError),
        (ShuttingDown("bye"), grpc.StatusCode.UNAVAILABLE, ce.ServerUnavailable),
        (FormatError("/f.beton", 12, "bad pointer"), grpc.StatusCode.DATA_LOSS, ce.FormatError),
        (PipelineError("boom", sample_index=3, op="X"), grpc.StatusCode.INTERNAL, ce.PipelineError),
        (BetonError("other"), grpc.StatusCode.UNKNOWN, ce.ServerError),
    ],
)
def test_round_trip(exc: BaseException, code: grpc.StatusCode, client_cls: type) -> None:
    got_code, message, name = status_for(exc)
    assert got_code == code
    assert message == str(exc)
    assert name == type(exc).__name__

    class FakeRpcError(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return got_code

        def details(self) -> str:
            return message

        def trailing_metadata(self):
            return (("beton-error", name),)

    err = ce.from_rpc_error(FakeRpcError())
    assert type(err) is client_cls
    if client_cls is ce.FormatError:  # still a DataError, which client code catches
        assert isinstance(err, ce.DataError)
    assert str(err) == message and err.code == code.name and err.server_error == name


def test_unexpected_exceptions_are_internal_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    code, message, name = status_for(KeyError("k"))
    assert code == grpc.StatusCode.INTERNAL and "KeyError" in message and name == "InternalError"
    assert any("unexpected error" in r.message for r in caplog.records)


def test_unreachable_daemon_message_names_the_address() -> None:
    class Down(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNAVAILABLE

        def details(self) -> str:
            return "connect failed"

        def trailing_metadata(self):
            return ()

    err = ce.from_rpc_error(Down(), target="unix:///tmp/x.sock")
    assert isinstance(err, ce.ServerUnavailable) and "unix:///tmp/x.sock" in str(err)


def test_the_client_knows_the_unknown_dataset_refusal_by_its_class_name() -> None:
    """The served Loader tells "unknown dataset" from other ``SpecError`` by the ``beton-error``
    name (``beton_client._loader.UNKNOWN_DATASET``), not by the message."""
    from beton_client._loader import UNKNOWN_DATASET

    assert status_for(UnknownDataset("x"))[2] == UNKNOWN_DATASET
    assert issubclass(UnknownDataset, SpecError)


class _StreamingCall(grpc.RpcError):
    """Like gRPC's streaming call: iterating it raises the call object itself."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "the daemon is gone"

    def trailing_metadata(self) -> tuple:
        return ()

    def __next__(self) -> bytes:
        raise self  # this frame holds the call; the traceback will hold this frame


def test_translating_a_streaming_call_error_breaks_its_traceback_cycle() -> None:
    """The error's traceback holds frames that hold the call: a cycle that kept a stream (and
    its buffers, or its mapped ring) until a full garbage collection. ``from_rpc_error`` drops
    it, so the call is freed by reference counting."""
    gc.disable()
    try:
        call = _StreamingCall()
        ref = weakref.ref(call)
        try:
            next(call)
        except grpc.RpcError as err:
            assert err.__traceback__ is not None
            got = ce.from_rpc_error(err)
        assert isinstance(got, ce.ServerUnavailable) and "gone" in str(got)
        assert call.__traceback__ is None
        del call
        assert ref() is None
    finally:
        gc.enable()
