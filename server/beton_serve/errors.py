"""The server's error hierarchy.

Every error raised on purpose by ``beton_serve`` derives from :class:`BetonError`. The gRPC layer
maps these to status codes in one place (``beton_serve.rpc``); nothing else does.
"""

from __future__ import annotations

import os

__all__ = [
    "BetonError",
    "ConfigError",
    "FormatError",
    "PipelineError",
    "SpecError",
    "TransportError",
    "WriterError",
]


class BetonError(Exception):
    """Base class of every error ``beton_serve`` raises deliberately."""


class FormatError(BetonError, ValueError):
    """A ``.beton`` file is malformed, truncated or inconsistent.

    Attributes:
        path: the file.
        offset: the byte offset where the problem was found, or ``None`` if it concerns the
            whole file.
        reason: what was expected and what was found.
    """

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


class ConfigError(BetonError, ValueError):
    """The daemon's configuration (TOML file or flags) is invalid."""
