"""The server's error hierarchy.

Every error raised on purpose by ``beton_serve`` derives from :class:`BetonError`. The gRPC layer
maps these to status codes in one place (``beton_serve.rpc``); nothing else does.
"""

from __future__ import annotations

import os
import traceback

from beton_wire.address import ADDRESS_IN_USE_STATUS, DATA_ERROR_STATUS

__all__ = [
    "AddressInUse",
    "BetonError",
    "ConfigError",
    "FormatError",
    "PipelineError",
    "ResourceExhausted",
    "ShuttingDown",
    "SpecError",
    "TransportError",
    "UnknownDataset",
    "WriterError",
    "drop_frame_locals",
    "without_traceback",
]


class BetonError(Exception):
    """Base class of every error ``beton_serve`` raises deliberately.

    Attributes:
        exit_status: what the command line exits with when this error ends it.
    """

    exit_status: int = 1


class FormatError(BetonError, ValueError):
    """A ``.beton`` file is malformed, truncated or inconsistent.

    Attributes:
        path: the file.
        offset: the byte offset where the problem was found, or ``None`` if it concerns the
            whole file.
        reason: what was expected and what was found.
    """

    exit_status = DATA_ERROR_STATUS

    def __init__(self, path: str | os.PathLike[str], offset: int | None, reason: str) -> None:
        self.path = os.fspath(path)
        self.offset = offset
        self.reason = reason
        where = f" at offset {offset}" if offset is not None else ""
        super().__init__(f"{self.path}{where}: {reason}")


class WriterError(BetonError):
    """Writing a dataset failed; ``index`` names the failing sample when one is to blame."""

    def __init__(self, message: str, index: int | None = None) -> None:
        self.index = index
        prefix = f"sample {index}: " if index is not None else ""
        super().__init__(prefix + message)


class SpecError(BetonError, ValueError):
    """A pipeline, loader or stream specification is invalid.

    Raised when the thing is built, never while it runs. The message says what to change.
    """


class UnknownDataset(SpecError):
    """A stream named a dataset the daemon does not serve (and no file it may open).

    Its own class so that a client tells it from other ``SpecError`` by the ``beton-error``
    trailing metadata (``"UnknownDataset"``), not by the message: the served Loader turns it
    into the in-process Loader's ``FormatError`` when the name was a path that is no file on
    the client's host."""


class PipelineError(BetonError):
    """A pipeline failed while running a batch.

    Attributes:
        sample_index: the dataset sample id being processed, when known.
        op: the name of the operation that failed, when known.
    """

    def __init__(
        self, message: str, *, sample_index: int | None = None, op: str | None = None
    ) -> None:
        self.sample_index = sample_index
        self.op = op
        parts = []
        if op is not None:
            parts.append(f"op {op}")
        if sample_index is not None:
            parts.append(f"sample {sample_index}")
        prefix = f"[{', '.join(parts)}] " if parts else ""
        super().__init__(prefix + message)


class TransportError(BetonError):
    """A transport (shm, cuda_ipc, grpc) could not be set up or failed."""


class ShuttingDown(TransportError):
    """The daemon is draining (SIGTERM, SIGINT, its idle timeout: the message names which) and
    accepts no new streams; retry against a new one."""


class ResourceExhausted(BetonError):
    """A resource is exhausted, and the message says which:

    * the daemon cannot take this stream now: its memory budget for stream buffers
      (``max_ring_bytes``) is full. The message says how much the stream needs and what is
      held; it fits once other streams close, or with a smaller ``batch_size`` /
      ``batches_ahead``;
    * the system refused a worker thread (its thread or memory limit): an ``Engine`` that
      could not start its workers, or whose last worker died and could not be replaced."""


class ConfigError(BetonError, ValueError):
    """The daemon's configuration (TOML file or flags) is invalid."""


class AddressInUse(ConfigError):
    """Another live daemon already serves this address (it holds its lock)."""

    exit_status = ADDRESS_IN_USE_STATUS


def drop_frame_locals(exc: BaseException) -> None:
    """Clear the locals of the finished frames in the tracebacks of ``exc``, its causes and its
    contexts; frames still running are left alone.

    The traceback's text (files, lines, functions) stays, so it can still be logged. What goes
    are the references: a failed batch's frames hold views of a stream's shared-memory ring, and
    an error kept by a future, often in a reference cycle through the frame that caught it,
    would keep that ring mapped until the garbage collector runs (issue 11).
    """
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)


def without_traceback(exc: BaseException) -> BaseException:
    """Remove the tracebacks of ``exc`` and of its causes, and a context it suppressed
    (``raise ... from None``); returns ``exc``, changed in place.

    For an expected error (a :class:`BetonError`, whose message is all a client or the log gets)
    raised on a thread that publishes batches: a frame keeps its caller once it has returned,
    so such a traceback holds the whole call stack of that moment, batch futures and slot views
    included, for as long as the error is kept (issue 11). :func:`drop_frame_locals` cannot help
    there, since those callers were still running.
    """
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        if e.__suppress_context__:
            e.__context__ = None
        e = e.__cause__ if e.__cause__ is not None else e.__context__
    return exc
