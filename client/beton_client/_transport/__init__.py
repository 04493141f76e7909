"""Client-side transports: how a published batch becomes arrays/tensors in the trainer.

Every transport implements :class:`Receiver`. The Loader (``beton_client._loader``) owns one per
stream, on the thread that iterates it:

* it builds the receiver from the OpenStream reply's transport setup;
* for each ``BatchReady`` it calls :meth:`Receiver.arrays` and yields (after the client tail) what
  it returns; that memory belongs to the daemon's slot and is valid until the Loader sends the
  slot's release, which it does when the user asks for the next batch (or on ``close``);
* :meth:`Receiver.close` runs once, when the stream ends.

Implementations: ``shm`` (:class:`~beton_client._transport.shm.ShmReceiver`), ``cuda_ipc`` and
``grpc`` (issue 5).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from beton_client._transport.shm import ShmReceiver, TensorInfo

__all__ = ["Receiver", "ShmReceiver", "TensorInfo"]


class Receiver(Protocol):
    """Turns a published slot into arrays or tensors (see the module docstring)."""

    kind: str

    def arrays(self, slot: int, tensors: Sequence[TensorInfo]) -> list[Any]:
        """Views of ``slot``'s tensors (numpy arrays on the CPU, or device tensors), no copy."""
        ...

    def release(self, slot: int) -> None:
        """The client is done with ``slot``; called before the daemon is told (cuda_ipc records
        the slot's free event here; nothing to do for shm)."""
        ...

    def close(self) -> None:
        """Release every mapping/handle of the ring (idempotent)."""
        ...
