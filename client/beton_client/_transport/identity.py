"""The client's side of transport negotiation: who this process is and what it can do.

Protocol: when a ``beton_client.Loader`` opens a stream it calls :func:`gather_facts` once (in
the trainer's main thread) and sends ``facts.to_dict()`` with the open-stream request. The
daemon rebuilds it with ``beton_serve.transport.negotiate.ClientOffer.from_dict`` (same keys),
picks a transport and returns it with the reasons it rejected the better ones.

Nothing here imports torch or CuPy at module import. :func:`gather_facts` imports torch only
when torch is installed (to ask whether CUDA works and for the GPUs' UUIDs), and CuPy only when
the client wants tensors on a GPU (cuda_ipc is the only thing CuPy is needed for).

GPUs are identified by UUID, because the client and the daemon may number them differently
(``CUDA_VISIBLE_DEVICES``, containers). The device index sent is in the client's numbering.
"""

from __future__ import annotations

import importlib.util
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from beton_client._torch import torch_if_installed

__all__ = ["ClientFacts", "CudaDevice", "HostIdentity", "gather_facts", "host_identity"]


@dataclass(frozen=True, kw_only=True, slots=True)
class HostIdentity:
    """Who and where this process is (see ``beton_serve.transport.negotiate.HostIdentity``)."""

    boot_id: str
    hostname: str
    uid: int
    pid: int
    ipc_ns: int | None


@dataclass(frozen=True, kw_only=True, slots=True)
class CudaDevice:
    """A GPU as this process sees it: index in this process's numbering, UUID (32 hex digits)."""

    index: int
    uuid: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ClientFacts:
    """Everything the client tells the daemon when it opens a stream.

    Attributes:
        identity: this process's host identity.
        device: ``"cpu"`` or ``"cuda:N"`` (client numbering).
        transport: the requested transport: ``"auto"``, ``"shm"``, ``"cuda_ipc"`` or ``"grpc"``.
        has_torch: torch is installed.
        has_cuda: torch has CUDA and sees at least one GPU.
        has_cupy: CuPy is importable (only checked when ``device`` is a GPU).
        cuda_devices: the visible GPUs, with UUIDs.
    """

    identity: HostIdentity
    device: str
    transport: str
    has_torch: bool
    has_cuda: bool
    has_cupy: bool
    cuda_devices: tuple[CudaDevice, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict with the keys ``ClientOffer.from_dict`` reads."""
        ident = self.identity
        return {
            "identity": {
                "boot_id": ident.boot_id,
                "hostname": ident.hostname,
                "uid": ident.uid,
                "pid": ident.pid,
                "ipc_ns": ident.ipc_ns,
            },
            "device": self.device,
            "transport": self.transport,
            "has_torch": self.has_torch,
            "has_cuda": self.has_cuda,
            "has_cupy": self.has_cupy,
            "cuda_devices": [{"index": d.index, "uuid": d.uuid} for d in self.cuda_devices],
        }


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _ns_inode(path: Path) -> int | None:
    """The inode of a namespace link such as ``/proc/self/ns/ipc`` (``ipc:[4026531839]``)."""
    try:
        target = os.readlink(path)
    except OSError:
        return None
    found = re.search(r"\[(\d+)\]", target)
    return int(found.group(1)) if found else None


def host_identity(proc: Path | str = "/proc") -> HostIdentity:
    """This process's boot id, hostname, uid, pid and IPC namespace.

    Args:
        proc: the procfs root (tests pass a fake one). Missing files give ``""`` / ``None``,
            which the daemon treats as "cannot share memory" rather than guessing.
    """
    root = Path(proc)
    return HostIdentity(
        boot_id=_read(root / "sys" / "kernel" / "random" / "boot_id"),
        hostname=socket.gethostname(),
        uid=os.getuid(),
        pid=os.getpid(),
        ipc_ns=_ns_inode(root / "self" / "ns" / "ipc"),
    )


def _uuid_hex(value: Any) -> str | None:
    """32 hex digits from whatever torch reports as a device UUID, or ``None``."""
    raw = getattr(value, "bytes", None)
    if isinstance(raw, bytes | bytearray) and len(raw) == 16:
        return bytes(raw).hex()
    if isinstance(value, bytes | bytearray) and len(value) == 16:
        return bytes(value).hex()
    text = str(value).lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            text = text[len(prefix) :]
    digits = re.sub(r"[^0-9a-f]", "", text)
    return digits if len(digits) == 32 else None


def _torch_cuda(torch: Any) -> tuple[bool, bool, tuple[CudaDevice, ...]]:
    """(has_torch, has_cuda, devices) from a torch module (or ``None`` if not installed)."""
    if torch is None:
        return False, False, ()
    try:
        if not torch.cuda.is_available():
            return True, False, ()
        devices = []
        for i in range(torch.cuda.device_count()):
            uuid = _uuid_hex(getattr(torch.cuda.get_device_properties(i), "uuid", None))
            if uuid is not None:
                devices.append(CudaDevice(index=i, uuid=uuid))
        return True, True, tuple(devices)
    except Exception:  # a broken driver install: report "no CUDA", the daemon explains
        return True, False, ()


def _cupy_works() -> bool:
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy  # noqa: F401
    except Exception:  # installed for another CUDA version, missing libraries, ...
        return False
    return True


def gather_facts(
    device: str,
    transport: str = "auto",
    *,
    proc: Path | str = "/proc",
    torch_module: Any = True,
    cupy_available: bool | None = None,
) -> ClientFacts:
    """Collect what the client sends when it opens a stream.

    Args:
        device: ``"cpu"`` or ``"cuda:N"`` (client numbering), as given to ``ToDevice``.
        transport: the transport the user asked for.
        proc: procfs root (for tests).
        torch_module: the torch module to ask; ``True`` (default) imports torch if installed,
            ``None`` means "no torch"; tests pass a fake with torch's ``cuda`` API.
        cupy_available: override the CuPy check (for tests); by default CuPy is imported only
            when ``device`` is a GPU.

    Returns:
        The facts; gathering never raises for a missing library or driver.
    """
    torch: Any = torch_if_installed() if torch_module is True else torch_module
    has_torch, has_cuda, devices = _torch_cuda(torch or None)
    wants_cuda = device.startswith("cuda")
    if cupy_available is None:
        cupy_available = (
            _cupy_works() if wants_cuda else importlib.util.find_spec("cupy") is not None
        )
    return ClientFacts(
        identity=host_identity(proc),
        device=device,
        transport=transport,
        has_torch=has_torch,
        has_cuda=has_cuda,
        has_cupy=cupy_available,
        cuda_devices=devices,
    )
