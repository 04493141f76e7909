"""The daemon's transports beyond shm (issue 5): default factories and lazily gathered CUDA facts.

CUDA is never initialised in the daemon unless a client asks for a GPU: the daemon starts with
facts that list no GPU (``cuda_pending``), and the first stream whose offer wants CUDA makes it
call :func:`with_cuda_facts` once (CuPy import, device count and UUIDs; the IPC probe itself runs
later, once per device, only when everything else allows cuda_ipc).
"""

from __future__ import annotations

import dataclasses
import logging

from beton_serve.transport.base import TransportFactory
from beton_serve.transport.grpc_ring import GrpcFactory
from beton_serve.transport.negotiate import DaemonFacts

__all__ = ["default_factories", "with_cuda_facts"]

log = logging.getLogger("beton_serve.daemon")


def default_factories() -> dict[str, TransportFactory]:
    """``grpc`` (every compression allowed) and ``cuda_ipc`` (CuPy imported only when a ring is
    made); the daemon adds ``shm``."""
    from beton_serve.transport.cuda_ipc import CudaIpcFactory

    return {"grpc": GrpcFactory(), "cuda_ipc": CudaIpcFactory()}


def with_cuda_facts(facts: DaemonFacts) -> DaemonFacts:
    """``facts`` with CuPy's presence, the visible GPUs and a cached IPC probe (never raises)."""
    from beton_serve.transport.cuda_ipc import CachedProbe, cuda_facts

    has_cupy, devices = cuda_facts()
    log.info(
        "cuda facts gathered: cupy=%s devices=%s",
        has_cupy,
        ",".join(f"{d.index}:{d.uuid}" for d in devices) or "-",
    )
    return dataclasses.replace(
        facts, has_cupy=has_cupy, cuda_devices=devices, ipc_probe=CachedProbe()
    )
