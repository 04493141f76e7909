"""beton-serve: a data-serving daemon for FFCV ``.beton`` datasets.

The server package holds the format reader and writer, the fields, the pipeline compiler and its
ops, the shared worker engine, the in-process :class:`beton_serve.loader.Loader`, the transports,
the gRPC service and the CLI. Heavy dependencies (numba, cv2) are imported lazily by the modules
that need them, so ``beton_serve.transforms`` and ``beton_serve.fields.decoders`` import on
machines that only run the client.
"""

from __future__ import annotations

from collections.abc import Mapping

from beton_serve import _field_types
from beton_serve.errors import (
    BetonError,
    ConfigError,
    FormatError,
    PipelineError,
    SpecError,
    TransportError,
)

__version__ = "0.1.0"


def _builtin_field_types() -> Mapping[int, type]:
    """The built-in Field classes by type id, for readers opened without a table.

    The root supplies them because it sits above both layers: ``beton_serve.format`` must not
    import ``beton_serve.fields`` (``beton_serve._field_types`` explains the seam). The import is
    here, on first use, so that ``import beton_serve`` loads neither numpy nor the fields.
    """
    from beton_serve.fields import CLASS_BY_TYPE_ID

    return CLASS_BY_TYPE_ID


_field_types.set_default_provider(_builtin_field_types)

__all__ = [
    "BetonError",
    "ConfigError",
    "FormatError",
    "PipelineError",
    "SpecError",
    "TransportError",
    "__version__",
]
