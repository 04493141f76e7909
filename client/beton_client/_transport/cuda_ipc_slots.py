"""The cuda_ipc transport's entry in the Loader's receiver registry.

Adapts :class:`~beton_client._transport.cuda_ipc.CudaIpcReceiver` (``tensors(slot, views)``,
``release(slot)``) to the Loader's :class:`~beton_client._transport.Receiver` seam
(``arrays(slot, tensors)``, plus ``release(slot)``, which the Loader calls before it sends the
slot's Release so that the client's "free" event is recorded first).

The daemon names the GPU by its UUID (``CudaIpcSetup.device_uuid``); the client maps the slabs on
its own index of that GPU (its numbering may differ, e.g. with ``CUDA_VISIBLE_DEVICES``).

Building the receiver raises :class:`~beton_client._transport.cuda_ipc.TransportUnavailable` when
CuPy is missing; the Loader then re-opens the stream over shm and logs why.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from beton_client._transport.cuda_ipc import CudaIpcReceiver, TensorView
from beton_client._transport.shm import TensorInfo

__all__ = ["CudaIpcSlotReceiver", "local_device_index", "make_cuda_ipc_receiver"]


def local_device_index(uuid: str, fallback: int) -> int:
    """This process's index of the GPU with ``uuid`` (``fallback`` when it cannot tell)."""
    if not uuid:
        return fallback
    from beton_client._transport.identity import gather_facts

    want = uuid.lower().replace("gpu-", "").replace("-", "")
    for d in gather_facts("cuda", "cuda_ipc").cuda_devices:
        if d.uuid and d.uuid.lower().replace("gpu-", "").replace("-", "") == want:
            return int(d.index)
    return fallback


class CudaIpcSlotReceiver:
    """A :class:`~beton_client._transport.Receiver` over a :class:`CudaIpcReceiver`."""

    kind = "cuda_ipc"

    def __init__(self, receiver: CudaIpcReceiver) -> None:
        self.receiver = receiver

    def arrays(self, slot: int, tensors: Sequence[TensorInfo]) -> list[Any]:
        """Torch tensors on the client's GPU, views of the slot's slab (no copy)."""
        return self.receiver.tensors(
            slot, [TensorView(tuple(t.shape), t.dtype, t.offset) for t in tensors]
        )

    def release(self, slot: int) -> None:
        """Record the slot's free event on the current stream (before the Release message)."""
        self.receiver.release(slot)

    def close(self) -> None:
        """Close every IPC mapping and event."""
        self.receiver.close()


def make_cuda_ipc_receiver(setup: Any, **receiver_kw: Any) -> CudaIpcSlotReceiver:
    """``RECEIVERS["cuda_ipc"]``: open the ring a ``CudaIpcSetup`` describes.

    ``receiver_kw`` go to :class:`CudaIpcReceiver` (``runtime``, ``stream_of``, ``wrap``: tests
    inject fakes).

    Raises:
        TransportUnavailable: CuPy is missing in this process.
    """
    c = setup.cuda_ipc
    extra = {
        "slab_handles": list(c.slab_handles),
        "event_handles": list(c.event_handles),
        "free_event_handles": list(c.free_event_handles),
    }
    device = local_device_index(c.device_uuid, int(c.device))
    return CudaIpcSlotReceiver(
        CudaIpcReceiver(extra, slot_bytes=int(c.slot_bytes), device=device, **receiver_kw)
    )
