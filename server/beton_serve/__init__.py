"""beton-serve: a data-serving daemon for FFCV ``.beton`` datasets.

The server package holds the format reader and writer, the fields, the pipeline compiler and its
ops, the shared worker engine, the in-process :class:`beton_serve.loader.Loader`, the transports,
the gRPC service and the CLI. Heavy dependencies (numba, cv2) are imported lazily by the modules
that need them, so ``beton_serve.transforms`` and ``beton_serve.fields.decoders`` import on
machines that only run the client.
"""

from __future__ import annotations

from beton_serve.errors import (
    BetonError,
    ConfigError,
    FormatError,
    PipelineError,
    SpecError,
    TransportError,
)

__version__ = "0.1.0"

__all__ = [
    "BetonError",
    "ConfigError",
    "FormatError",
    "PipelineError",
    "SpecError",
    "TransportError",
    "__version__",
]
