"""A fake of the ``cupy.cuda.runtime`` calls the cuda_ipc transport makes, for CPU tests.

One :class:`FakeDriver` stands for the GPU driver shared by two processes; each process gets a
:class:`FakeRuntime` with its own pointer space, so an IPC handle opened in the "client" yields a
different pointer that aliases the same device bytes. Stream work runs immediately (in order) and
is logged, so tests check ordering (wait on ``free`` before the copy, ``ready`` recorded after)
and that every allocation is released.
"""

from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

NOT_READY = 600  # cudaErrorNotReady


class FakeCudaError(RuntimeError):
    pass


@dataclass
class FakeDriver:
    """State shared by every fake process: device memory, events, and the call log."""

    uuids: tuple[bytes, ...] = (bytes(range(16)), bytes(range(16, 32)))
    memory: dict[int, np.ndarray] = field(default_factory=dict)  # allocation id -> bytes
    events: dict[int, dict[str, Any]] = field(default_factory=dict)
    log: list[tuple] = field(default_factory=list)
    stuck_streams: set[int] = field(default_factory=set)
    fail: dict[str, int] = field(default_factory=dict)  # call name -> fail on the Nth call
    _ids: Any = field(default_factory=lambda: itertools.count(1))

    def next_id(self) -> int:
        return next(self._ids)


class FakeRuntime:
    """One process's view of the driver (``cupy.cuda.runtime``'s names and signatures)."""

    def __init__(self, driver: FakeDriver, name: str) -> None:
        self.d, self.name = driver, name
        self.device = 0
        self.calls: dict[str, int] = {}
        self.dev_ptrs: dict[int, tuple[int, int]] = {}  # ptr -> (allocation id, device)
        self.opened: dict[int, int] = {}  # ptr -> allocation id (IPC mappings)
        self.host: dict[int, np.ndarray] = {}
        self.streams: set[int] = set()
        self.local_events: dict[int, int] = {}  # local handle -> driver event id
        self._base = 0x7000_0000_0000 + (0x1000_0000 if name == "client" else 0)

    def _call(self, name: str) -> None:
        n = self.calls[name] = self.calls.get(name, 0) + 1
        if self.d.fail.get(name) == n:
            raise FakeCudaError(f"{name}: injected failure")

    # devices
    def getDeviceCount(self) -> int:
        return len(self.d.uuids)

    def getDevice(self) -> int:
        return self.device

    def setDevice(self, index: int) -> None:
        if not 0 <= index < len(self.d.uuids):
            raise FakeCudaError(f"cudaErrorInvalidDevice: {index}")
        self.device = index

    def getDeviceProperties(self, index: int) -> dict:
        return {"name": b"FakeGPU", "uuid": self.d.uuids[index]}

    # memory
    def malloc(self, nbytes: int) -> int:
        self._call("malloc")
        alloc = self.d.next_id()
        self.d.memory[alloc] = np.zeros(nbytes, np.uint8)
        ptr = self._base + alloc * 0x100_0000
        self.dev_ptrs[ptr] = (alloc, self.device)
        return ptr

    def free(self, ptr: int) -> None:
        alloc, _ = self.dev_ptrs.pop(ptr)
        del self.d.memory[alloc]

    def hostAlloc(self, nbytes: int, flags: int) -> int:
        self._call("hostAlloc")
        buf = np.zeros(nbytes, np.uint8)
        self.host[buf.ctypes.data] = buf
        return buf.ctypes.data

    def freeHost(self, ptr: int) -> None:
        del self.host[ptr]

    def _resolve(self, ptr: int) -> np.ndarray:
        for table in (self.dev_ptrs, self.opened):
            for base, entry in table.items():
                alloc = entry[0] if isinstance(entry, tuple) else entry
                mem = self.d.memory[alloc]
                if base <= ptr < base + mem.size:
                    return mem[ptr - base :]
        raise FakeCudaError(f"cudaErrorInvalidValue: {ptr:#x} is not device memory")

    def device_bytes(self, ptr: int, nbytes: int) -> np.ndarray:
        return self._resolve(ptr)[:nbytes]

    def memcpy(self, dst: int, src: int, nbytes: int, kind: int) -> None:
        if kind == 1:
            self._resolve(dst)[:nbytes] = np.frombuffer(ctypes.string_at(src, nbytes), np.uint8)
        else:
            ctypes.memmove(dst, self._resolve(src).ctypes.data, nbytes)

    def memcpyAsync(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        self._call("memcpyAsync")
        self.d.log.append((self.name, "copy", dst, nbytes, stream))
        self.memcpy(dst, src, nbytes, kind)

    # streams and events
    def streamCreateWithFlags(self, flags: int) -> int:
        s = self.d.next_id()
        self.streams.add(s)
        return s

    def streamDestroy(self, stream: int) -> None:
        self.streams.remove(stream)

    def streamQuery(self, stream: int) -> int:
        return NOT_READY if stream in self.d.stuck_streams else 0

    def eventCreateWithFlags(self, flags: int) -> int:
        self._call("eventCreateWithFlags")
        ev = self.d.next_id()
        self.d.events[ev] = {"flags": flags, "records": 0, "owner": self.name}
        self.local_events[ev] = ev
        return ev

    def eventDestroy(self, event: int) -> None:
        ev = self.local_events.pop(event)
        if self.d.events[ev]["owner"] == self.name:
            del self.d.events[ev]

    def eventRecord(self, event: int, stream: int) -> None:
        ev = self.local_events[event]
        self.d.events[ev]["records"] += 1
        self.d.log.append((self.name, "record", ev, stream))

    def eventSynchronize(self, event: int) -> None:
        self.d.log.append((self.name, "sync", self.local_events[event]))

    def streamWaitEvent(self, stream: int, event: int, flags: int = 0) -> None:
        self.d.log.append((self.name, "wait", self.local_events[event], stream))

    # IPC
    def ipcGetMemHandle(self, ptr: int) -> bytes:
        self._call("ipcGetMemHandle")
        alloc, _ = self.dev_ptrs[ptr]
        return alloc.to_bytes(8, "little") + b"M" * 56

    def ipcGetEventHandle(self, event: int) -> bytes:
        ev = self.local_events[event]
        if not self.d.events[ev]["flags"] & 0x04:
            raise FakeCudaError("cudaErrorInvalidResourceHandle: not an interprocess event")
        return ev.to_bytes(8, "little") + b"E" * 56

    def ipcOpenMemHandle(self, handle: bytes, flags: int = 1) -> int:
        self._call("ipcOpenMemHandle")
        alloc = int.from_bytes(handle[:8], "little")
        if alloc not in self.d.memory:
            raise FakeCudaError("cudaErrorInvalidValue: stale handle")
        ptr = self._base + alloc * 0x100_0000
        self.opened[ptr] = alloc
        return ptr

    def ipcCloseMemHandle(self, ptr: int) -> None:
        del self.opened[ptr]

    def ipcOpenEventHandle(self, handle: bytes) -> int:
        ev = int.from_bytes(handle[:8], "little")
        local = self.d.next_id()
        self.local_events[local] = ev
        return local
