"""The client's end of the CUDA IPC transport: GPU batches without a host-to-device copy.

Protocol (the daemon's half is ``beton_serve.transport.cuda_ipc``; the wire carries the handles
in ``CudaIpcSetup`` and the slot number in each ``BatchReady``):

1. When the stream opens, the Loader builds one :class:`CudaIpcReceiver` from the setup the
   daemon sent (``setup_extra``): per slot, the slab's ``cudaIpcMemHandle_t``, the ``ready``
   event handle and the ``free`` event handle.
2. For each ``BatchReady(slot=s, tensors=...)``, the Loader's thread (the trainer's main thread)
   calls :meth:`CudaIpcReceiver.tensors`. The first use of slot ``s`` opens its three handles and
   caches them; every use makes the current torch stream of the target device wait on
   ``ready[s]`` (``cudaStreamWaitEvent``: the GPU waits, the CPU does not) and wraps the slab as
   torch tensors through DLPack (CuPy ``UnownedMemory`` -> ``MemoryPointer`` -> ``ndarray`` ->
   ``torch.from_dlpack``): views of the slab, no copy.
3. When the trainer asks for the next batch, the Loader calls :meth:`CudaIpcReceiver.release`,
   which records ``free[s]`` on the current torch stream and returns; the Loader then sends
   ``Release(slot=s)``. The daemon's next copy into the slab waits for that event on the GPU,
   so kernels the trainer queued on the batch finish reading before it is overwritten.

Ownership and lifetime. The daemon owns the slabs. This process maps them (``cudaIpcOpenMemHandle``)
once each; a mapping is closed when the receiver is closed *and* no tensor view of it is alive
(each view keeps its mapping object alive; a ``weakref.finalize`` on the mapping closes the
handle). A batch's contents are only guaranteed until it is released (the daemon reuses the
slab); use ``copy=True`` in the Loader to keep a batch. Opened events are destroyed on
:meth:`close`.

Streams: tensors are valid on the stream that was current when :meth:`tensors` ran (the one that
waited on ``ready``). Using them on another stream needs the usual ``wait_stream``.

CuPy and torch are imported lazily, inside the first :class:`CudaIpcReceiver`; importing this
module (and ``beton_client``) works without either.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from beton_client._forks import owner_only

__all__ = ["CudaIpcReceiver", "TensorView", "TransportUnavailable"]

log = logging.getLogger("beton_client.transport.cuda_ipc")

IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess


class TransportUnavailable(RuntimeError):
    """CUDA IPC cannot be set up in this client (missing CuPy, or a handle cannot be opened).

    Attributes:
        code: a reason code (``"client_no_cupy"`` or ``"ipc_open_failed"``); the Loader reopens
            the stream with ``transport="shm"`` and logs this message.
    """

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(f"[{code}] {message}")


@dataclass(frozen=True, slots=True)
class TensorView:
    """Where one output of a batch lives in a slab.

    Attributes:
        shape: the full shape, batch dimension first.
        dtype: numpy dtype name (``"uint8"``, ``"float16"``, ...).
        offset: byte offset from the start of the slab.
    """

    shape: tuple[int, ...]
    dtype: str
    offset: int


def _import_cupy_runtime() -> Any:
    try:
        from cupy.cuda import runtime
    except Exception as exc:
        raise TransportUnavailable(
            "client_no_cupy",
            f"CuPy is not usable in the trainer ({exc}); install 'beton-serve[cuda12]' "
            "(or cuda11 / cuda13) or use transport='shm'",
        ) from None
    return runtime


@contextlib.contextmanager
def _on_device(rt: Any, index: int) -> Iterator[None]:
    prev = rt.getDevice()
    if prev != index:
        rt.setDevice(index)
    try:
        yield
    finally:
        if prev != index:
            rt.setDevice(prev)


class _Mapping:
    """One opened slab: the device pointer in this process. Closed by its finalizer."""

    __slots__ = ("__weakref__", "device", "finalizer", "nbytes", "ptr", "slot")

    def __init__(self, rt: Any, slot: int, ptr: int, nbytes: int, device: int) -> None:
        self.slot, self.ptr, self.nbytes, self.device = slot, ptr, nbytes, device
        self.finalizer = weakref.finalize(self, owner_only(_close_mapping), rt, ptr, device)


def _close_mapping(rt: Any, ptr: int, device: int) -> None:
    try:
        with _on_device(rt, device):
            rt.ipcCloseMemHandle(ptr)
    except Exception as exc:  # the context is gone at interpreter exit: nothing left to close
        log.debug("cuda_ipc: closing slab mapping %#x failed: %s", ptr, exc)


def _torch_stream(device: int) -> int:
    """The current torch stream of ``device`` as a raw ``cudaStream_t``."""
    import torch

    return int(torch.cuda.current_stream(device).cuda_stream)


def _dlpack_wrap(mapping: _Mapping, view: TensorView, device: int, stream: int) -> Any:
    """A torch tensor viewing ``view`` inside ``mapping``'s slab, through DLPack (no copy).

    The CuPy array's memory is ``UnownedMemory`` whose owner is the mapping, so the mapping (and
    the IPC handle) stays open while the tensor lives.
    """
    import cupy
    import torch

    mem = cupy.cuda.UnownedMemory(mapping.ptr, mapping.nbytes, mapping, device)
    arr = cupy.ndarray(
        view.shape, dtype=view.dtype, memptr=cupy.cuda.MemoryPointer(mem, view.offset)
    )
    # Make CuPy's current stream the consumer's stream, so the DLPack exchange inserts no
    # extra synchronisation (the stream already waited on the slot's ready event).
    try:
        ext = cupy.cuda.ExternalStream(stream, device)
    except TypeError:  # CuPy releases whose ExternalStream takes no device_id
        ext = cupy.cuda.ExternalStream(stream)
    with cupy.cuda.Device(device), ext:
        try:
            return torch.from_dlpack(arr)
        except (BufferError, TypeError) as exc:
            # An older torch/CuPy pair that disagrees on the stream argument: the legacy capsule
            # carries no stream, and none is needed (the stream already waited on the event).
            log.debug("cuda_ipc: torch.from_dlpack failed (%s); using the legacy capsule", exc)
            return torch.utils.dlpack.from_dlpack(arr.toDlpack())


class CudaIpcReceiver:
    """Opens the daemon's slabs once and turns published slots into torch tensors.

    Args:
        setup_extra: the ``extra`` of the daemon's ``TransportSetup`` (``CudaIpcSetup`` on the
            wire): ``slot_bytes``, ``slab_handles``, ``event_handles``, ``free_event_handles``.
        slot_bytes: bytes per slab.
        device: the target GPU in *this process's* numbering (the same physical GPU the daemon
            allocated on; negotiation matched them by UUID).
        runtime: a ``cupy.cuda.runtime``-like object; ``None`` imports CuPy (tests inject fakes).
        stream_of: ``device -> cudaStream_t`` of the stream to synchronise with; defaults to
            torch's current stream.
        wrap: ``(mapping, view, device, stream) -> tensor``; defaults to the DLPack wrap.

    Raises:
        TransportUnavailable: CuPy is missing.
        ValueError: the setup is malformed.
    """

    def __init__(
        self,
        setup_extra: Mapping[str, Any],
        *,
        slot_bytes: int,
        device: int,
        runtime: Any = None,
        stream_of: Callable[[int], int] | None = None,
        wrap: Callable[[Any, TensorView, int, int], Any] | None = None,
    ) -> None:
        slabs = list(setup_extra.get("slab_handles", ()))
        ready = list(setup_extra.get("event_handles", ()))
        free = list(setup_extra.get("free_event_handles", ()))
        if not slabs or not (len(slabs) == len(ready) == len(free)):
            raise ValueError(
                "malformed cuda_ipc setup: need as many slab_handles, event_handles and "
                f"free_event_handles as slots, got {len(slabs)}, {len(ready)}, {len(free)}"
            )
        self._rt = _import_cupy_runtime() if runtime is None else runtime
        self._stream_of = _torch_stream if stream_of is None else stream_of
        self._wrap = _dlpack_wrap if wrap is None else wrap
        self.device = device
        self.slot_bytes = slot_bytes
        self._handles = [
            (bytes(m), bytes(r), bytes(f)) for m, r, f in zip(slabs, ready, free, strict=True)
        ]
        self._mappings: dict[int, _Mapping] = {}
        self._events: dict[int, tuple[int, int]] = {}
        self._closed = False

    @property
    def slot_count(self) -> int:
        """Number of slots in the daemon's ring."""
        return len(self._handles)

    def open_slots(self) -> int:
        """How many slabs this receiver has mapped so far (each is mapped at most once)."""
        return len(self._mappings)

    def _open(self, slot: int) -> tuple[_Mapping, int, int]:
        mapping = self._mappings.get(slot)
        if mapping is not None:
            ready, free = self._events[slot]
            return mapping, ready, free
        mem, ready_h, free_h = self._handles[slot]
        rt = self._rt
        try:
            with _on_device(rt, self.device):
                ptr = rt.ipcOpenMemHandle(mem, IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
                try:
                    ready = rt.ipcOpenEventHandle(ready_h)
                    free = rt.ipcOpenEventHandle(free_h)
                except Exception:
                    rt.ipcCloseMemHandle(ptr)
                    raise
        except Exception as exc:
            raise TransportUnavailable(
                "ipc_open_failed",
                f"cannot open the daemon's CUDA IPC handle for slot {slot} on cuda:{self.device}"
                f" ({exc}); this environment refuses CUDA IPC: use transport='shm'",
            ) from None
        mapping = _Mapping(rt, slot, ptr, self.slot_bytes, self.device)
        self._mappings[slot] = mapping
        self._events[slot] = (ready, free)
        return mapping, ready, free

    def tensors(self, slot: int, views: Sequence[TensorView]) -> list[Any]:
        """Wrap a published slot as tensors on the target GPU, ordered after its H2D copy.

        Args:
            slot: the slot of the ``BatchReady``.
            views: where each output lives (shape with the batch dimension, dtype, offset).

        Returns:
            One tensor per view, in order, viewing the slab (no copy).

        Raises:
            TransportUnavailable: the slot's handles cannot be opened here.
            ValueError: the receiver is closed, the slot is out of range, or a view does not
                fit in the slab.
        """
        if self._closed:
            raise ValueError("the cuda_ipc receiver is closed")
        if not 0 <= slot < len(self._handles):
            raise ValueError(f"slot {slot} outside the ring of {len(self._handles)} slots")
        for v in views:
            if v.offset < 0 or v.offset + _nbytes(v) > self.slot_bytes:
                raise ValueError(f"{v} does not fit in a slab of {self.slot_bytes} bytes")
        mapping, ready, _ = self._open(slot)
        stream = self._stream_of(self.device)
        with _on_device(self._rt, self.device):
            self._rt.streamWaitEvent(stream, ready, 0)
        return [self._wrap(mapping, v, self.device, stream) for v in views]

    def release(self, slot: int) -> None:
        """Mark the end of this process's GPU use of ``slot`` (record its ``free`` event).

        Call before sending ``Release(slot)``; work already queued on the current stream still
        finishes before the daemon overwrites the slab.
        """
        if self._closed or slot not in self._events:
            return
        stream = self._stream_of(self.device)
        with _on_device(self._rt, self.device):
            self._rt.eventRecord(self._events[slot][1], stream)

    def close(self) -> None:
        """Destroy the opened events and drop the mappings (idempotent).

        A mapping's IPC handle is closed as soon as no tensor view of it is alive.
        """
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception), _on_device(self._rt, self.device):
            for ready, free in self._events.values():
                for ev in (ready, free):
                    try:
                        self._rt.eventDestroy(ev)
                    except Exception as exc:
                        log.debug("cuda_ipc: destroying event %#x failed: %s", ev, exc)
        self._events.clear()
        self._mappings.clear()

    def __enter__(self) -> CudaIpcReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_ITEMSIZE = {
    "uint8": 1, "int8": 1, "bool": 1, "uint16": 2, "int16": 2, "float16": 2,
    "uint32": 4, "int32": 4, "float32": 4, "uint64": 8, "int64": 8, "float64": 8,
    "complex64": 8, "complex128": 16,
}  # fmt: skip


def _nbytes(view: TensorView) -> int:
    if view.dtype not in _ITEMSIZE:
        raise ValueError(f"dtype {view.dtype!r} cannot travel over cuda_ipc")
    n = _ITEMSIZE[view.dtype]
    for d in view.shape:
        n *= int(d)
    return n
