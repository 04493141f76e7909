"""Transport negotiation: which transport a stream uses, and why the better ones were rejected.

Protocol (DESIGN.md §6). When a stream opens:

1. The client gathers its facts (``beton_client._transport.identity``) and sends them as a
   :class:`ClientOffer`: host identity (boot id, hostname, uid, pid, IPC namespace), the device
   it wants tensors on, what it can do (torch, CUDA, CuPy, the UUIDs of its visible GPUs) and the
   transport it asked for (``"auto"``, ``"shm"``, ``"cuda_ipc"`` or ``"grpc"``). The RPC layer
   replaces the uid and pid it reports with the kernel's (:mod:`beton_serve.transport.peer`).
2. The daemon's RPC layer (the thread that serves ``OpenStream``) calls :func:`negotiate` with
   that offer and the daemon's own :class:`DaemonFacts`. This module is pure: it touches no
   CUDA, no shared memory, no socket. The only side effect is the injected ``ipc_probe``, which
   the daemon caches (one probe per device per daemon, see
   :func:`beton_serve.transport.cuda_ipc.probe_cuda_ipc`).
3. The result, a :class:`Negotiation`, names the chosen transport and, for every better
   transport that was rejected, a :class:`Rejection` with a stable reason code, a human message
   and what the user can do about it. The daemon logs the rejections and returns them in the
   open-stream reply, so the trainer sees the same reason.

Order of preference: for a CUDA device ``cuda_ipc > shm > grpc``; for the CPU ``shm > grpc``.
``grpc`` always works, so ``"auto"`` never fails. A forced transport that cannot work raises
:class:`~beton_serve.errors.TransportError` whose message carries the reason code and text.

Reason codes (stable strings, also listed in :data:`REASON_TEXT`):

* ``different_host``: boot id or hostname differ. shm and cuda_ipc need the same kernel.
* ``different_ipc_namespace``: same host but another IPC namespace (a container without
  ``--ipc=host``): neither POSIX shared memory nor CUDA IPC handles cross it.
* ``different_user``: another uid; the daemon's shm segments are mode 0600.
* ``cpu_device``: the client asked for CPU tensors; cuda_ipc only delivers to a GPU.
* ``client_no_cuda``: the client has no torch with CUDA.
* ``client_no_cupy`` / ``daemon_no_cupy``: CuPy (which provides the IPC calls) is missing.
* ``daemon_no_cuda``: the daemon sees no GPU.
* ``device_not_visible``: the client's GPU (by UUID) is not visible to the daemon.
* ``ipc_refused``: the daemon's CUDA IPC probe failed (a sandbox that refuses IPC).
* ``shm_disabled``: the daemon was started without shared memory.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from beton_serve.errors import SpecError, TransportError

__all__ = [
    "REASON_TEXT",
    "TRANSPORTS",
    "ClientOffer",
    "CudaDevice",
    "DaemonFacts",
    "HostIdentity",
    "Negotiation",
    "Reason",
    "Rejection",
    "negotiate",
    "normalize_uuid",
]

#: Transport names, best first. ``auto`` is a request, never a result.
TRANSPORTS: tuple[str, ...] = ("cuda_ipc", "shm", "grpc")
_REQUESTS = frozenset((*TRANSPORTS, "auto"))


class Reason(str, enum.Enum):
    """Stable reason codes for rejecting a transport (sent on the wire as the string value)."""

    DIFFERENT_HOST = "different_host"
    DIFFERENT_IPC_NAMESPACE = "different_ipc_namespace"
    DIFFERENT_USER = "different_user"
    CPU_DEVICE = "cpu_device"
    CLIENT_NO_CUDA = "client_no_cuda"
    CLIENT_NO_CUPY = "client_no_cupy"
    DAEMON_NO_CUPY = "daemon_no_cupy"
    DAEMON_NO_CUDA = "daemon_no_cuda"
    DEVICE_NOT_VISIBLE = "device_not_visible"
    IPC_REFUSED = "ipc_refused"
    SHM_DISABLED = "shm_disabled"


#: For each reason: (what happened, what the user can do).
REASON_TEXT: Mapping[Reason, tuple[str, str]] = {
    Reason.DIFFERENT_HOST: (
        "the client runs on another host (boot id or hostname differ)",
        "nothing to fix: remote clients use grpc; run the trainer on the daemon's host for shm",
    ),
    Reason.DIFFERENT_IPC_NAMESPACE: (
        "the client is in another IPC namespace (a container without a shared IPC namespace)",
        "start the trainer's container with --ipc=host (or share the daemon's IPC namespace, "
        "e.g. hostIPC: true in Kubernetes)",
    ),
    Reason.DIFFERENT_USER: (
        "the client runs as another user; the daemon's shared memory is private to its user",
        "run the trainer and the daemon as the same user",
    ),
    Reason.CPU_DEVICE: (
        "the client asked for CPU tensors; cuda_ipc delivers only to a GPU",
        "use ToDevice('cuda:N') to receive batches on a GPU",
    ),
    Reason.CLIENT_NO_CUDA: (
        "the client has no CUDA-enabled torch",
        "install a CUDA build of torch in the trainer's environment",
    ),
    Reason.CLIENT_NO_CUPY: (
        "CuPy is not installed in the client",
        "pip install 'beton-serve[cuda12]' (or cuda11 / cuda13, matching the CUDA version)",
    ),
    Reason.DAEMON_NO_CUPY: (
        "CuPy is not installed in the daemon",
        "install the daemon with 'beton-serve[cuda12]' (or cuda11 / cuda13)",
    ),
    Reason.DAEMON_NO_CUDA: (
        "the daemon sees no CUDA device",
        "give the daemon's process/container access to the GPUs",
    ),
    Reason.DEVICE_NOT_VISIBLE: (
        "the client's GPU is not visible to the daemon",
        "make the GPU visible to the daemon (CUDA_VISIBLE_DEVICES, container device list)",
    ),
    Reason.IPC_REFUSED: (
        "CUDA IPC does not work in the daemon's environment (the probe failed)",
        "run outside the sandbox, or accept shm with a host-to-device copy in the trainer",
    ),
    Reason.SHM_DISABLED: (
        "the daemon was started without shared memory",
        "restart the daemon with shared memory enabled",
    ),
}


def normalize_uuid(value: str | bytes) -> str:
    """Canonical form of a GPU UUID: 32 lowercase hex digits.

    Accepts CuPy's raw 16 bytes, ``nvidia-smi``'s ``GPU-xxxxxxxx-xxxx-...`` and torch's dashed
    string alike, so the two sides compare UUIDs reported by different libraries.

    Raises:
        SpecError: the value does not hold exactly 16 bytes of UUID.
    """
    if isinstance(value, bytes | bytearray):
        if len(value) != 16:
            raise SpecError(f"a GPU UUID has 16 bytes, got {len(value)}")
        return bytes(value).hex()
    text = str(value).lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            text = text[len(prefix) :]
    digits = re.sub(r"[^0-9a-f]", "", text)
    if len(digits) != 32:
        raise SpecError(f"not a GPU UUID: {value!r}")
    return digits


@dataclass(frozen=True, kw_only=True, slots=True)
class HostIdentity:
    """Who and where a process is.

    Attributes:
        boot_id: ``/proc/sys/kernel/random/boot_id`` (unique per boot of a kernel).
        hostname: the host name.
        uid: the real user id; ``None`` when the daemon could not verify a client's (a client's
            uid and pid come from the kernel, never from its request: ``transport.peer``).
        pid: the process id (in the daemon's PID namespace for a client; 0: unknown).
        ipc_ns: the inode of ``/proc/self/ns/ipc``, or ``None`` if it could not be read.
    """

    boot_id: str
    hostname: str
    uid: int | None
    pid: int
    ipc_ns: int | None = None

    def __post_init__(self) -> None:
        if self.pid < 0 or (self.uid is not None and self.uid < 0):
            raise SpecError(f"pid and uid must be >= 0, got pid={self.pid} uid={self.uid}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HostIdentity:
        """Build from the JSON-safe dict that ``beton_client`` sends (unknown keys ignored)."""
        ipc = data.get("ipc_ns")
        uid = data.get("uid", 0)
        return cls(
            boot_id=str(data.get("boot_id", "")),
            hostname=str(data.get("hostname", "")),
            uid=None if uid is None else int(uid),
            pid=int(data.get("pid", 0)),
            ipc_ns=None if ipc is None else int(ipc),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class CudaDevice:
    """A GPU as one process sees it: its local index and its global UUID (normalized)."""

    index: int
    uuid: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "uuid", normalize_uuid(self.uuid))
        if self.index < 0:
            raise SpecError(f"a CUDA device index is >= 0, got {self.index}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ClientOffer:
    """What the client sends when it opens a stream.

    Attributes:
        identity: the client's host identity.
        device: ``"cpu"`` or ``"cuda:N"``, N being the index in the *client's* numbering.
        transport: the requested transport, ``"auto"`` or one of :data:`TRANSPORTS`.
        has_torch: torch is importable in the client.
        has_cuda: torch in the client has CUDA and sees a device.
        has_cupy: CuPy is importable in the client.
        cuda_devices: the client's visible GPUs (index in its numbering, UUID).
    """

    identity: HostIdentity
    device: str = "cpu"
    transport: str = "auto"
    has_torch: bool = False
    has_cuda: bool = False
    has_cupy: bool = False
    cuda_devices: tuple[CudaDevice, ...] = ()

    def __post_init__(self) -> None:
        if self.transport not in _REQUESTS:
            raise SpecError(f"unknown transport {self.transport!r}: use one of {sorted(_REQUESTS)}")
        if self.device != "cpu" and re.fullmatch(r"cuda(:\d+)?", self.device) is None:
            raise SpecError(f"device must be 'cpu' or 'cuda:N', got {self.device!r}")
        object.__setattr__(self, "cuda_devices", tuple(self.cuda_devices))

    @property
    def wants_cuda(self) -> bool:
        """Whether the client asked for tensors on a GPU."""
        return self.device.startswith("cuda")

    @property
    def device_index(self) -> int:
        """The GPU index in the client's numbering (``cuda`` alone means 0); -1 for the CPU."""
        if not self.wants_cuda:
            return -1
        _, _, idx = self.device.partition(":")
        return int(idx) if idx else 0

    @property
    def device_uuid(self) -> str | None:
        """The UUID of the GPU the client asked for, if the client reported it."""
        idx = self.device_index
        for dev in self.cuda_devices:
            if dev.index == idx:
                return dev.uuid
        return None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClientOffer:
        """Build from ``beton_client``'s ``ClientFacts.to_dict()`` (unknown keys ignored).

        Raises:
            SpecError: a field is malformed (the message says which).
        """
        try:
            devices = tuple(
                CudaDevice(index=int(d["index"]), uuid=d["uuid"])
                for d in data.get("cuda_devices", ())
            )
            return cls(
                identity=HostIdentity.from_dict(data.get("identity", {})),
                device=str(data.get("device", "cpu")),
                transport=str(data.get("transport", "auto")),
                has_torch=bool(data.get("has_torch", False)),
                has_cuda=bool(data.get("has_cuda", False)),
                has_cupy=bool(data.get("has_cupy", False)),
                cuda_devices=devices,
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, SpecError):
                raise
            raise SpecError(f"malformed transport offer: {exc}") from None


#: ``ipc_probe(device_index) -> (ok, reason)``; see ``cuda_ipc.probe_cuda_ipc``.
IpcProbe = Callable[[int], tuple[bool, str]]


def _no_probe(device_index: int) -> tuple[bool, str]:
    return False, "no CUDA IPC probe configured in the daemon"


@dataclass(frozen=True, kw_only=True, slots=True)
class DaemonFacts:
    """What the daemon knows about itself.

    Attributes:
        identity: the daemon's host identity.
        shm_enabled: whether the shm transport is on.
        has_cupy: CuPy is importable in the daemon.
        cuda_devices: the daemon's visible GPUs (index in the daemon's numbering, UUID).
        ipc_probe: called at most once per negotiation, only when everything else allows
            cuda_ipc, with the daemon-side device index; returns ``(ok, reason)``. The daemon
            should pass a cached probe.
    """

    identity: HostIdentity
    shm_enabled: bool = True
    has_cupy: bool = False
    cuda_devices: tuple[CudaDevice, ...] = ()
    ipc_probe: IpcProbe = _no_probe

    def __post_init__(self) -> None:
        object.__setattr__(self, "cuda_devices", tuple(self.cuda_devices))


@dataclass(frozen=True, kw_only=True, slots=True)
class Rejection:
    """Why one transport was not used.

    Attributes:
        transport: the rejected transport.
        code: the stable reason code.
        message: what happened, for a human (may include a detail such as a probe error).
        hint: what the user can do.
    """

    transport: str
    code: Reason
    message: str
    hint: str

    def __str__(self) -> str:
        return f"{self.transport} rejected [{self.code.value}]: {self.message} ({self.hint})"


@dataclass(frozen=True, kw_only=True, slots=True)
class Negotiation:
    """The outcome of :func:`negotiate`.

    Attributes:
        transport: the chosen transport, one of :data:`TRANSPORTS`.
        device_index: for cuda_ipc, the GPU index in the *daemon's* numbering; else -1.
        rejected: every transport better than the chosen one, with its reason, best first.
    """

    transport: str
    device_index: int = -1
    rejected: tuple[Rejection, ...] = field(default=())

    def summary(self) -> str:
        """One log line: the choice and the reasons (what the daemon logs)."""
        if not self.rejected:
            return f"transport {self.transport}"
        reasons = "; ".join(str(r) for r in self.rejected)
        return f"transport {self.transport} (fallback: {reasons})"


def _reject(transport: str, code: Reason, detail: str = "") -> Rejection:
    message, hint = REASON_TEXT[code]
    if detail:
        message = f"{message}: {detail}"
    return Rejection(transport=transport, code=code, message=message, hint=hint)


def _same_host(offer: ClientOffer, facts: DaemonFacts) -> bool:
    a, b = offer.identity, facts.identity
    return a.boot_id == b.boot_id and a.hostname == b.hostname and bool(a.boot_id)


def _check_shm(offer: ClientOffer, facts: DaemonFacts) -> Rejection | None:
    """Why shm cannot work for this client, or ``None`` if it can."""
    if not _same_host(offer, facts):
        return _reject("shm", Reason.DIFFERENT_HOST)
    a, b = offer.identity.ipc_ns, facts.identity.ipc_ns
    if a is not None and b is not None and a != b:
        return _reject("shm", Reason.DIFFERENT_IPC_NAMESPACE, f"client {a}, daemon {b}")
    if offer.identity.uid != facts.identity.uid:
        uid = offer.identity.uid
        client = (
            f"client uid {uid}"
            if uid is not None
            else "the client's uid could not be verified (TCP from another network namespace)"
        )
        return _reject("shm", Reason.DIFFERENT_USER, f"{client}, daemon uid {facts.identity.uid}")
    if not facts.shm_enabled:
        return _reject("shm", Reason.SHM_DISABLED)
    return None


def _check_cuda_ipc(offer: ClientOffer, facts: DaemonFacts) -> tuple[Rejection | None, int]:
    """Why cuda_ipc cannot work, or ``(None, daemon_device_index)`` if it can."""
    if not offer.wants_cuda:
        return _reject("cuda_ipc", Reason.CPU_DEVICE), -1
    # Same host, namespace and user first: a shm rejection is also a cuda_ipc rejection
    # (CUDA IPC handles need the same kernel and, in containers, the same IPC namespace).
    shm = _check_shm(offer, facts)
    if shm is not None and shm.code is not Reason.SHM_DISABLED:
        return _reject("cuda_ipc", shm.code, shm.message.partition(": ")[2]), -1
    if not (offer.has_torch and offer.has_cuda):
        return _reject("cuda_ipc", Reason.CLIENT_NO_CUDA), -1
    if not offer.has_cupy:
        return _reject("cuda_ipc", Reason.CLIENT_NO_CUPY), -1
    if not facts.has_cupy:
        return _reject("cuda_ipc", Reason.DAEMON_NO_CUPY), -1
    if not facts.cuda_devices:
        return _reject("cuda_ipc", Reason.DAEMON_NO_CUDA), -1
    uuid = offer.device_uuid
    if uuid is None:
        return (
            _reject(
                "cuda_ipc",
                Reason.DEVICE_NOT_VISIBLE,
                f"the client did not report the UUID of {offer.device}",
            ),
            -1,
        )
    match = next((d for d in facts.cuda_devices if d.uuid == uuid), None)
    if match is None:
        return (
            _reject("cuda_ipc", Reason.DEVICE_NOT_VISIBLE, f"{offer.device} is GPU {uuid}"),
            -1,
        )
    ok, why = facts.ipc_probe(match.index)
    if not ok:
        return _reject("cuda_ipc", Reason.IPC_REFUSED, why), -1
    return None, match.index


def negotiate(offer: ClientOffer, facts: DaemonFacts) -> Negotiation:
    """Choose the fastest transport that works for this client.

    Args:
        offer: what the client sent.
        facts: what the daemon knows about itself.

    Returns:
        The choice, with a :class:`Rejection` for each better transport that cannot work.
        With ``transport="auto"`` this never fails: grpc is the last resort.

    Raises:
        TransportError: the client forced a transport that cannot work; the message holds the
            reason code, what happened and what to do.
    """
    shm_why = _check_shm(offer, facts)
    cuda_why, cuda_index = _check_cuda_ipc(offer, facts)

    if offer.transport != "auto":
        forced = offer.transport
        why = {"cuda_ipc": cuda_why, "shm": shm_why, "grpc": None}[forced]
        if why is not None:
            raise TransportError(
                f"transport={forced!r} cannot work [{why.code.value}]: {why.message}. "
                f"To fix: {why.hint}; or use transport='auto'."
            )
        return Negotiation(
            transport=forced, device_index=cuda_index if forced == "cuda_ipc" else -1
        )

    rejected: list[Rejection] = []
    if offer.wants_cuda:
        if cuda_why is None:
            return Negotiation(transport="cuda_ipc", device_index=cuda_index)
        rejected.append(cuda_why)
    if shm_why is None:
        return Negotiation(transport="shm", rejected=tuple(rejected))
    rejected.append(shm_why)
    return Negotiation(transport="grpc", rejected=tuple(rejected))
