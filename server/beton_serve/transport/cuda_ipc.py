"""The CUDA IPC transport: a ring of dedicated GPU slabs on the client's device (DESIGN.md §6).

Data structure. For one stream on one GPU, :class:`CudaIpcRing` holds ``slot_count`` slots. Slot
``s`` owns:

* ``slab[s]``: a dedicated ``cudaMalloc`` of ``layout.slot_bytes`` (never a memory-pool
  sub-allocation: a CUDA IPC handle exports a whole allocation, and a pool would export its
  neighbours too and keep them alive in the client);
* ``staging[s]``: pinned host memory (``cudaHostAlloc``) of the same size, laid out by
  :func:`beton_wire.slots.slot_layout`; the engine decodes into it;
* ``ready[s]``: an interprocess event (``cudaEventInterprocess | cudaEventDisableTiming``) the
  daemon records on its stream after the host-to-device copy into ``slab[s]``;
* ``free[s]``: an interprocess event the *client* records on its own stream when it releases the
  slot; the daemon's stream waits on it before it overwrites ``slab[s]``. Without it, a client
  whose kernels still read the slab when its Python code releases the slot would see the next
  batch's bytes.

All IPC handles (slabs and both events) are exported once, in :meth:`CudaIpcRing.setup`, and the
client opens each one once (``beton_client._transport.cuda_ipc``).

Protocol for one batch (who calls what):

1. daemon event loop: :meth:`acquire` picks a FREE slot and waits (CPU, GIL released) until the
   previous copy out of its staging buffer is done; the slot is FILLING.
2. engine worker threads: write the batch into :meth:`host_views` (pinned host memory).
3. daemon event loop: :meth:`publish`: on the ring's own non-blocking stream, wait on
   ``free[s]``, copy ``staging[s]`` to ``slab[s]`` asynchronously, record ``ready[s]``; the slot is
   LEASED and the daemon sends ``BatchReady(slot=s)``. No CPU synchronisation.
4. client: makes its current torch stream wait on ``ready[s]`` (no CPU sync) and wraps
   ``slab[s]`` through DLPack; when done, records ``free[s]`` on its stream and sends ``Release``.
5. daemon event loop: :meth:`release`; the slot is FREE.

Ownership. The ring owns every slab, staging buffer, event and its stream. :meth:`close` (called by
the daemon exactly once, when the stream ends, including when its client died) waits for the
ring's stream with a timeout, then frees every slab, unpins every staging buffer and destroys the
events and the stream; a ``weakref.finalize`` does the same if the ring is dropped unclosed. A
client that dies loses its mappings with its process; its stream's ring is closed by the daemon,
which reclaims the slabs. If the ring's stream does not drain within the timeout (for instance it
waits on a ``free`` event recorded by a client that died with work pending), the device memory is
left to the driver rather than hanging the daemon, and this is logged.

Only the event-loop thread calls the ring's methods; :meth:`host_views` arrays are written by
engine workers between :meth:`acquire` and :meth:`publish`.

CuPy provides the CUDA runtime calls (``cupy.cuda.runtime``); it is imported only when a ring is
created or :func:`probe_cuda_ipc` runs. Tests inject a fake runtime.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from beton_wire.slots import SlotLayout

from beton_serve.errors import TransportError
from beton_serve.transport.base import Published, TransportSetup
from beton_serve.transport.negotiate import CudaDevice

__all__ = ["CachedProbe", "CudaIpcFactory", "CudaIpcRing", "cuda_facts", "probe_cuda_ipc"]

log = logging.getLogger("beton_serve.transport.cuda_ipc")

# CUDA runtime ABI constants (stable since CUDA 4; not all are exported by cupy.cuda.runtime).
STREAM_NON_BLOCKING = 0x01  # cudaStreamNonBlocking
EVENT_DISABLE_TIMING = 0x02  # cudaEventDisableTiming
EVENT_INTERPROCESS = 0x04  # cudaEventInterprocess
HOST_ALLOC_PORTABLE = 0x01  # cudaHostAllocPortable
MEMCPY_HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice
CUDA_SUCCESS = 0

_FREE, _FILLING, _LEASED = 0, 1, 2


def _cupy_runtime() -> Any:
    """``cupy.cuda.runtime``, imported on first use."""
    try:
        from cupy.cuda import runtime
    except ImportError as exc:
        raise TransportError(
            f"the cuda_ipc transport needs CuPy in the daemon ({exc}); "
            "install 'beton-serve[cuda12]' (or cuda11 / cuda13)"
        ) from None
    return runtime


@contextlib.contextmanager
def _on_device(rt: Any, index: int) -> Iterator[None]:
    """Make ``index`` the current device of this thread for the block, then restore it."""
    prev = rt.getDevice()
    if prev != index:
        rt.setDevice(index)
    try:
        yield
    finally:
        if prev != index:
            rt.setDevice(prev)


def _host_array(ptr: int, nbytes: int) -> np.ndarray:
    """A uint8 numpy view of ``nbytes`` of host memory at ``ptr`` (not owning it)."""
    return np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(ptr))


@dataclass(slots=True)
class _Resources:
    """Everything a ring allocated, freed by :func:`_free_resources` (also from the finalizer).

    Kept apart from the ring so that the ``weakref.finalize`` callback holds no reference to it.
    """

    rt: Any
    device: int
    stream: int = 0
    slabs: list[int] = field(default_factory=list)
    staging: list[int] = field(default_factory=list)
    events: list[int] = field(default_factory=list)
    drain_timeout: float = 5.0
    freed: bool = False


def _stream_drained(rt: Any, stream: int, timeout: float) -> bool:
    """Poll ``cudaStreamQuery`` until the stream is idle or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        if rt.streamQuery(stream) == CUDA_SUCCESS:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)


def _free_resources(res: _Resources) -> None:
    """Free slabs, unpin staging, destroy events and the stream. Idempotent, never raises."""
    if res.freed:
        return
    res.freed = True
    rt = res.rt
    try:
        with _on_device(rt, res.device):
            if res.stream and not _stream_drained(rt, res.stream, res.drain_timeout):
                log.error(
                    "cuda_ipc ring on device %d: its stream did not drain in %.1f s (a client "
                    "died with GPU work pending?); leaving %d slab(s) to the driver",
                    res.device,
                    res.drain_timeout,
                    len(res.slabs),
                )
                return
            for what, free, ptrs in (
                ("event", rt.eventDestroy, res.events),
                ("slab", rt.free, res.slabs),
                ("pinned buffer", rt.freeHost, res.staging),
            ):
                for ptr in ptrs:
                    try:
                        free(ptr)
                    except Exception as exc:  # keep freeing the rest; report each failure
                        log.error("cuda_ipc: could not free %s %#x: %s", what, ptr, exc)
                ptrs.clear()
            if res.stream:
                try:
                    rt.streamDestroy(res.stream)
                except Exception as exc:
                    log.error("cuda_ipc: could not destroy stream %#x: %s", res.stream, exc)
                res.stream = 0
    except Exception as exc:  # the CUDA context is already gone (interpreter exit)
        log.error("cuda_ipc: freeing ring resources on device %d failed: %s", res.device, exc)


class CudaIpcRing:
    """A ring of GPU slabs on one device for one stream (see the module docstring).

    Implements :class:`beton_serve.transport.base.SlotTransport`.

    Args:
        layout: the slot layout (host and device slabs use the same one).
        slot_count: number of slots (>= 1).
        device_index: the GPU, in the daemon's numbering.
        runtime: a ``cupy.cuda.runtime``-like object; ``None`` imports CuPy (tests pass a fake).
        drain_timeout: seconds :meth:`close` waits for the ring's stream before giving up.

    Raises:
        TransportError: CuPy is missing, or an allocation failed (everything allocated so far is
            freed first).
    """

    kind = "cuda_ipc"

    @property
    def notice_extras(self) -> None:
        """``None``: batches on the GPU are announced on the Batches call, not by notices."""
        return None

    def __init__(
        self,
        layout: SlotLayout,
        slot_count: int,
        *,
        device_index: int,
        runtime: Any = None,
        drain_timeout: float = 5.0,
    ) -> None:
        if slot_count < 1:
            raise TransportError(f"a cuda_ipc ring needs at least one slot, not {slot_count}")
        if device_index < 0:
            raise TransportError(f"a cuda_ipc ring needs a GPU index, not {device_index}")
        rt = _cupy_runtime() if runtime is None else runtime
        self.layout = layout
        self.slot_count = slot_count
        self.device_index = device_index
        self._rt = rt
        self._res = _Resources(rt=rt, device=device_index, drain_timeout=drain_timeout)
        self._finalizer = weakref.finalize(self, _free_resources, self._res)
        self._state = [_FREE] * slot_count
        self._ready: list[int] = []
        self._free_ev: list[int] = []
        self._views: list[list[np.ndarray]] = []
        self._setup: TransportSetup | None = None
        nbytes = layout.slot_bytes
        try:
            with _on_device(rt, device_index):
                self._res.stream = rt.streamCreateWithFlags(STREAM_NON_BLOCKING)
                flags = EVENT_INTERPROCESS | EVENT_DISABLE_TIMING
                for _ in range(slot_count):
                    self._res.slabs.append(rt.malloc(nbytes))
                    host = rt.hostAlloc(nbytes, HOST_ALLOC_PORTABLE)
                    self._res.staging.append(host)
                    ready = rt.eventCreateWithFlags(flags)
                    self._res.events.append(ready)
                    free_ev = rt.eventCreateWithFlags(flags)
                    self._res.events.append(free_ev)
                    self._ready.append(ready)
                    self._free_ev.append(free_ev)
                    self._views.append(self._make_views(_host_array(host, nbytes)))
                device_uuid = _device_uuid(rt, device_index)
                self._setup = TransportSetup(
                    kind=self.kind,
                    slot_count=slot_count,
                    slot_bytes=nbytes,
                    extra={
                        "device": device_index,
                        "device_uuid": device_uuid,
                        "owner_pid": os.getpid(),
                        "slab_handles": [bytes(rt.ipcGetMemHandle(p)) for p in self._res.slabs],
                        "event_handles": [bytes(rt.ipcGetEventHandle(e)) for e in self._ready],
                        "free_event_handles": [
                            bytes(rt.ipcGetEventHandle(e)) for e in self._free_ev
                        ],
                    },
                )
        except TransportError:
            self.close()
            raise
        except Exception as exc:
            self.close()
            raise TransportError(
                f"cannot create a cuda_ipc ring of {slot_count} x {nbytes} bytes on GPU "
                f"{device_index}: {exc}; use fewer batches_ahead or a smaller batch, or "
                "transport='shm'"
            ) from exc

    def _make_views(self, buf: np.ndarray) -> list[np.ndarray]:
        views = []
        batch = self.layout.batch_size
        for t in self.layout.tensors:
            arr = buf[t.offset : t.offset + t.sample_bytes * batch].view(np.dtype(t.dtype))
            views.append(arr.reshape((batch, *t.shape)))
        return views

    # -- SlotTransport --------------------------------------------------------------------

    def setup(self) -> TransportSetup:
        """The handles the client opens once: ``extra`` holds ``device`` (daemon numbering),
        ``device_uuid`` (32 hex digits), ``owner_pid``, and per slot ``slab_handles``
        (``cudaIpcMemHandle_t``, 64 bytes), ``event_handles`` (the ``ready`` events) and
        ``free_event_handles`` (the events the client records on release)."""
        if self._setup is None:
            raise TransportError("the cuda_ipc ring is closed")
        return self._setup

    def acquire(self) -> int | None:
        """Take a FREE slot (FILLING), once the previous copy out of its staging buffer is done.

        Blocks (GIL released by CuPy) only while that copy runs, which the client's release
        normally already outlasted. ``None`` when every slot is FILLING or LEASED, or the ring
        is closed.
        """
        if self._setup is None:
            return None
        for slot, st in enumerate(self._state):
            if st == _FREE:
                with _on_device(self._rt, self.device_index):
                    self._rt.eventSynchronize(self._ready[slot])
                self._state[slot] = _FILLING
                return slot
        return None

    def host_views(self, slot: int) -> list[np.ndarray]:
        """The pinned ``(batch_size, *shape)`` arrays of ``slot`` (valid until :meth:`close`)."""
        self._check_open()
        return self._views[slot]

    def publish(self, slot: int, length: int) -> Published:
        """Enqueue the host-to-device copy of ``slot`` and record its ``ready`` event.

        Asynchronous: returns before the copy runs. The copy first waits (on the GPU) for the
        client's ``free`` event of this slot, so a slab is never overwritten while the client's
        kernels still read it.

        Raises:
            TransportError: the slot was not FILLING, or a CUDA call failed.
        """
        self._check_open()
        if self._state[slot] != _FILLING:
            raise TransportError(f"cuda_ipc slot {slot} was published without being filled")
        if not 0 <= length <= self.layout.batch_size:
            raise TransportError(
                f"cuda_ipc slot {slot}: length {length} outside 0..{self.layout.batch_size}"
            )
        rt, stream = self._rt, self._res.stream
        try:
            with _on_device(rt, self.device_index):
                rt.streamWaitEvent(stream, self._free_ev[slot], 0)
                rt.memcpyAsync(
                    self._res.slabs[slot],
                    self._res.staging[slot],
                    self._used_bytes(length),
                    MEMCPY_HOST_TO_DEVICE,
                    stream,
                )
                rt.eventRecord(self._ready[slot], stream)
        except Exception as exc:
            raise TransportError(f"cuda_ipc: publishing slot {slot} failed: {exc}") from exc
        self._state[slot] = _LEASED
        return Published()

    def _used_bytes(self, length: int) -> int:
        """Bytes to copy for ``length`` rows: up to the end of the last output's rows."""
        tensors = self.layout.tensors
        if not tensors or length == self.layout.batch_size:
            return self.layout.slot_bytes
        last = tensors[-1]
        return last.offset + last.sample_bytes * length

    def release(self, slot: int) -> bool:
        """The client released ``slot`` (after recording its ``free`` event); ``False`` if the
        slot was not LEASED."""
        if self._setup is None or not 0 <= slot < self.slot_count:
            return False
        if self._state[slot] != _LEASED:
            return False
        self._state[slot] = _FREE
        return True

    def abandon(self, slot: int) -> None:
        """Return a FILLING slot to FREE without publishing it."""
        if self._setup is not None and self._state[slot] == _FILLING:
            self._state[slot] = _FREE

    def leased(self) -> int:
        """Number of slots FILLING or LEASED."""
        return sum(1 for st in self._state if st != _FREE)

    def nbytes(self) -> int:
        """Device bytes held (the same amount is pinned on the host)."""
        return self.slot_count * self.layout.slot_bytes

    def close(self) -> None:
        """Free every slab, unpin every staging buffer, destroy events and stream (idempotent).

        Leased slots are reclaimed: the client (alive or dead) must not use them afterwards.
        """
        self._setup = None
        self._state = [_FREE] * self.slot_count
        self._views = []
        self._finalizer()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return not self._finalizer.alive

    def _check_open(self) -> None:
        if self._setup is None:
            raise TransportError("the cuda_ipc ring is closed")

    def __enter__(self) -> CudaIpcRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _device_uuid(rt: Any, index: int) -> str:
    """The UUID of device ``index`` as 32 hex digits ("" if the runtime does not report it)."""
    try:
        raw = rt.getDeviceProperties(index).get("uuid", b"")
    except Exception:
        return ""
    return bytes(raw).hex() if isinstance(raw, bytes | bytearray) and len(raw) == 16 else ""


class CudaIpcFactory:
    """Builds :class:`CudaIpcRing` objects for the daemon (a ``TransportFactory``).

    Args:
        runtime: a ``cupy.cuda.runtime``-like object; ``None`` imports CuPy when a ring is made.
        drain_timeout: passed to every ring.
    """

    kind = "cuda_ipc"

    def __init__(self, runtime: Any = None, *, drain_timeout: float = 5.0) -> None:
        self._runtime = runtime
        self._drain_timeout = drain_timeout

    def create(self, layout: SlotLayout, slot_count: int, *, device_index: int = -1) -> CudaIpcRing:
        """A ring of ``slot_count`` slabs on ``device_index`` (daemon numbering).

        Raises:
            TransportError: no device given, CuPy missing, or an allocation failed.
        """
        return CudaIpcRing(
            layout,
            slot_count,
            device_index=device_index,
            runtime=self._runtime,
            drain_timeout=self._drain_timeout,
        )


_CHILD_OPEN = """
import sys
from cupy.cuda import runtime as rt
rt.setDevice(int(sys.argv[1]))
ptr = rt.ipcOpenMemHandle(bytes.fromhex(sys.argv[2]))
ev = rt.ipcOpenEventHandle(bytes.fromhex(sys.argv[3]))
rt.eventSynchronize(ev)
buf = bytearray(16)
import ctypes
host = (ctypes.c_ubyte * 16).from_buffer(buf)
rt.memcpy(ctypes.addressof(host), ptr, 16, 2)
rt.ipcCloseMemHandle(ptr)
rt.eventDestroy(ev)
sys.stdout.write(bytes(buf).hex())
"""


def probe_cuda_ipc(
    device_index: int,
    *,
    runtime: Any = None,
    cross_process: bool = True,
    timeout: float = 60.0,
) -> tuple[bool, str]:
    """Whether CUDA IPC works for ``device_index`` in this environment.

    Exports an IPC handle for a small dedicated allocation and an interprocess event. With
    ``cross_process`` (the default) a child Python process also opens both handles and reads the
    bytes back: sandboxes (gVisor, some container runtimes) may allow the export and refuse the
    import. The daemon calls this once per device and caches the answer
    (``DaemonFacts.ipc_probe``); it takes a few seconds with ``cross_process``.

    Returns:
        ``(True, "")`` if it works, else ``(False, reason)`` with the failing call and error.
    """
    try:
        rt = _cupy_runtime() if runtime is None else runtime
    except TransportError as exc:
        return False, str(exc)
    step = "cudaGetDeviceCount"
    ptr = event = 0
    try:
        count = rt.getDeviceCount()
        if not 0 <= device_index < count:
            return False, f"device {device_index} not visible (the daemon sees {count})"
        with _on_device(rt, device_index):
            step = "cudaMalloc"
            ptr = rt.malloc(4096)
            pattern = bytes(range(16))
            host = (ctypes.c_ubyte * 16).from_buffer_copy(pattern)
            step = "cudaMemcpy"
            rt.memcpy(ptr, ctypes.addressof(host), 16, MEMCPY_HOST_TO_DEVICE)
            step = "cudaIpcGetMemHandle"
            mem_handle = bytes(rt.ipcGetMemHandle(ptr))
            step = "cudaEventCreateWithFlags(interprocess)"
            event = rt.eventCreateWithFlags(EVENT_INTERPROCESS | EVENT_DISABLE_TIMING)
            rt.eventRecord(event, 0)
            step = "cudaIpcGetEventHandle"
            ev_handle = bytes(rt.ipcGetEventHandle(event))
            rt.eventSynchronize(event)
            if cross_process:
                step = "cudaIpcOpenMemHandle in a child process"
                proc = subprocess.run(
                    [
                        sys.executable,
                        "-P",  # the working directory is not on sys.path
                        "-c",
                        _CHILD_OPEN,
                        str(device_index),
                        mem_handle.hex(),
                        ev_handle.hex(),
                    ],
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                    check=False,
                )
                if proc.returncode != 0:
                    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                    return False, f"{step} failed: {last}"
                if proc.stdout.strip() != pattern.hex():
                    return False, f"{step} read wrong bytes: {proc.stdout.strip()!r}"
        return True, ""
    except subprocess.TimeoutExpired:
        return False, f"{step} did not finish in {timeout:.0f} s"
    except Exception as exc:
        return False, f"{step} failed: {type(exc).__name__}: {exc}"
    finally:
        with contextlib.suppress(Exception), _on_device(rt, device_index):
            if event:
                rt.eventDestroy(event)
            if ptr:
                rt.free(ptr)


def cuda_facts(runtime: Any = None) -> tuple[bool, tuple[CudaDevice, ...]]:
    """``(has_cupy, visible GPUs)`` for ``DaemonFacts``; never raises.

    Without CuPy, or when the driver fails, the daemon reports no GPUs and negotiation says so.
    """
    try:
        rt = _cupy_runtime() if runtime is None else runtime
    except TransportError:
        return False, ()
    try:
        devices = []
        for i in range(rt.getDeviceCount()):
            uuid = _device_uuid(rt, i)
            if uuid:
                devices.append(CudaDevice(index=i, uuid=uuid))
        return True, tuple(devices)
    except Exception as exc:
        log.warning("cuda_ipc: cannot list CUDA devices: %s", exc)
        return True, ()


class CachedProbe:
    """An ``ipc_probe`` for ``DaemonFacts`` that runs :func:`probe_cuda_ipc` once per device.

    The first negotiation that reaches the probe pays for it (a few seconds with the
    cross-process check); the answer is logged once and reused.
    """

    def __init__(self, probe: Any = None) -> None:
        self._probe = probe_cuda_ipc if probe is None else probe
        self._results: dict[int, tuple[bool, str]] = {}

    def __call__(self, device_index: int) -> tuple[bool, str]:
        if device_index not in self._results:
            ok, why = self._probe(device_index)
            if ok:
                log.info("CUDA IPC works on device %d", device_index)
            else:
                log.warning("CUDA IPC refused on device %d: %s", device_index, why)
            self._results[device_index] = (ok, why)
        return self._results[device_index]
