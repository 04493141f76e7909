"""The grpc transport's entry in the Loader's receiver registry.

Over grpc a batch is not in a slot the client maps: it arrives on the pass-through batch method
(``beton_client._transport.grpc_codec``) into the client's own buffers, driven by
``beton_client._multi_loader``. What the OpenStream reply contributes is :class:`GrpcSetupInfo`:
the method path, the chunk size and the accepted compression. :func:`make_grpc_receiver` is what
``RECEIVERS["grpc"]`` holds; the Loader reads grpc streams through ``_multi_loader`` and never asks
this object for slot views (:meth:`GrpcSetupInfo.arrays` says so if it is).

The name of the extra array that carries each batch's sample ids, :data:`SAMPLE_IDS`, must match
the daemon's (``beton_serve.daemon._grpc_batches.SAMPLE_IDS``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from beton_wire.framing import DEFAULT_CHUNK_BYTES

from beton_client._transport.grpc_codec import DEFAULT_METHOD_PATH
from beton_client.errors import TransportError

__all__ = ["SAMPLE_IDS", "GrpcSetupInfo", "make_grpc_receiver"]

SAMPLE_IDS = "__sample_ids__"
#: The daemon's batch method when an older reply does not name one.
DAEMON_METHOD_PATH = "/beton_wire.v1.BatchStream/Stream"


@dataclass(frozen=True, slots=True)
class GrpcSetupInfo:
    """What a grpc stream's reply says: batch method, chunk size, compression ("" = none)."""

    method: str = DAEMON_METHOD_PATH
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    compression: str = ""
    kind: str = "grpc"

    @classmethod
    def from_setup(cls, setup: Any) -> GrpcSetupInfo:
        """From a ``TransportSetup`` message whose kind is ``grpc``."""
        g = setup.grpc
        return cls(
            method=g.method or DAEMON_METHOD_PATH,
            chunk_bytes=int(g.chunk_bytes) or DEFAULT_CHUNK_BYTES,
            compression=g.compression,
        )

    def arrays(self, slot: int, tensors: Sequence[Any]) -> list[Any]:
        """Not a slot transport: grpc batches are read through ``_multi_loader``."""
        raise TransportError(
            "grpc batches arrive on the batch method, not in slots "
            f"(method {self.method or DEFAULT_METHOD_PATH})"
        )

    def close(self) -> None:
        """Nothing to release."""


def make_grpc_receiver(setup: Any) -> GrpcSetupInfo:
    """``RECEIVERS["grpc"]``: the setup of a grpc stream."""
    return GrpcSetupInfo.from_setup(setup)
