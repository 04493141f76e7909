"""Helpers of the FFCV-script scenarios: an isolated per-user socket for auto-spawn, small
datasets, and the in-process twin of a served Loader.

Auto-spawn isolation: ``XDG_RUNTIME_DIR`` points at a short private directory, so the client's
default address (``beton_wire.address.default_socket_path``) is
``$XDG_RUNTIME_DIR/beton-serve/beton.sock`` there, and the daemon a Loader spawns (which
inherits the environment) serves that socket and nothing else. :func:`stop_spawned` ends every
daemon serving it (SIGTERM, then SIGKILL) and reaps it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from beton_serve.fields import IntField, RGBImageField
from beton_serve.writer import DatasetWriter
from helpers.daemon import daemons_serving

__all__ = [
    "in_process",
    "stop_spawned",
    "write_images",
    "write_pairs",
]


def stop_spawned(socket: str, timeout: float = 20.0) -> list[int]:
    """Stop every daemon serving ``socket``; returns the PIDs that were running."""
    pids = daemons_serving(socket)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while daemons_serving(socket) and time.monotonic() < deadline:
        _reap(pids)
        time.sleep(0.05)
    for pid in daemons_serving(socket):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while daemons_serving(socket) and time.monotonic() < deadline:
        time.sleep(0.05)
    _reap(pids)
    return pids


def _reap(pids: list[int]) -> None:
    """Collect the exit status of those PIDs that are our own, exited children."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


class _Images:
    def __init__(self, n: int, hw: tuple[int, int], seed: int) -> None:
        self.n, self.hw, self.seed = n, hw, seed

    def __len__(self) -> int:
        return self.n

    def image(self, i: int, salt: int = 0) -> np.ndarray:
        rng = np.random.default_rng([self.seed, salt, i])
        h, w = self.hw
        # smooth gradients plus noise: JPEG-friendly, and every sample distinct
        yy, xx = np.mgrid[0:h, 0:w]
        base = (yy * 7 + xx * 3 + i * 11 + salt * 50)[..., None] + np.array([0, 40, 80])
        noise = rng.integers(0, 24, size=(h, w, 3))
        return ((base + noise) % 256).astype(np.uint8)

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        return self.image(i), i % 10


class _Pairs(_Images):
    def __getitem__(self, i: int) -> tuple[Any, ...]:
        return self.image(i, 0), self.image(i, 1)


def write_images(path: Path, n: int, hw: tuple[int, int], seed: int, **field: Any) -> Path:
    """``n`` RGB images of one size ``hw`` (``image``) with labels ``i % 10`` (``label``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    DatasetWriter(
        str(path), {"image": RGBImageField(**field), "label": IntField()}, num_workers=1
    ).from_indexed_dataset(_Images(n, hw, seed))
    return path


def write_pairs(path: Path, n: int, hw: tuple[int, int], seed: int) -> Path:
    """The paired-image layout of examples/paired_images: two ``RGBImageField(write_mode='smart')``
    fields ``input`` (JPEG above 1024 raw bytes) and ``target`` (raw under the default
    threshold)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    DatasetWriter(
        str(path),
        {
            "input": RGBImageField(write_mode="smart", smart_threshold=1024),
            "target": RGBImageField(write_mode="smart"),
        },
        num_workers=1,
    ).from_indexed_dataset(_Pairs(n, hw, seed))
    return path


def in_process(path: str | os.PathLike[str], *args: Any, **kw: Any) -> Any:
    """``beton_serve.loader.Loader`` with the arguments a script gave ``beton_client.Loader``
    (``serve=`` and the serving keywords dropped, the order mapped by name)."""
    from beton_serve.loader import Loader, OrderOption

    for key in ("serve", "server", "transport", "copy", "spawn", "reconnect"):
        kw.pop(key, None)
    order = kw.get("order")
    if order is not None:
        kw["order"] = OrderOption[getattr(order, "name", str(order))]
    pipelines: Mapping[str, Any] | None = kw.get("pipelines")
    if pipelines is not None:
        kw["pipelines"] = dict(pipelines)
    return Loader(path, *args, **kw)
