"""A real ``beton-serve`` daemon subprocess for tests, always stopped (SIGTERM, then kill) and waited for.

Usage::

    def test_x(daemon_factory):
        d = daemon_factory([fixtures_dir / "mixed_fields.beton"])
        loader = Loader("mixed_fields", 8, server=d.address)

The socket lives in a short private directory under /tmp (Unix socket paths are limited to 108
bytes, and pytest's tmp_path can be longer).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket as socket_mod
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from helpers.cycles import DAEMON_HOOK

SHM = Path("/dev/shm")
#: The daemon's command line. A test daemon also stops (SIGTERM, a clean drain) when the process
#: that started it is gone: pytest-timeout ends a hung run with ``os._exit``, and fixtures then
#: never stop their daemons, which used to linger (~400 MB each) until someone killed them.
_LAUNCH = (
    """
import os, signal, sys, threading, time
parent = os.getppid()
def watch_parent():
    while os.getppid() == parent:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)
threading.Thread(target=watch_parent, name="test-parent-watch", daemon=True).start()
"""
    + DAEMON_HOOK
    + """
from beton_serve.cli import main
sys.exit(main())
"""
)


@dataclass
class DaemonProcess:
    """A running daemon: its process, address, socket path and log file."""

    proc: subprocess.Popen[bytes]
    socket: str
    log_path: Path
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return "unix://" + self.socket

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def segments(self) -> list[str]:
        """This daemon's shared-memory segments (its rings and arenas; not its notice socket or
        its live marker)."""
        return [n for n in self.shm_files() if "-notice-" not in n and not n.endswith("-live")]

    def shm_files(self) -> list[str]:
        """Every file of this daemon under /dev/shm: rings and the notice socket."""
        return sorted(p.name for p in SHM.glob(f"beton-{self.pid}-*"))

    def stats(self, address: str | None = None):
        """The Stats RPC's reply (asked at ``address``: default, the Unix socket)."""
        from beton_wire.v1 import beton_pb2 as pb
        from beton_wire.v1 import beton_pb2_grpc as pb_grpc

        with grpc.insecure_channel(address or self.address) as ch:
            return pb_grpc.BetonServeStub(ch).Stats(pb.StatsRequest(), timeout=5)

    def cyclic_garbage(self, timeout: float = 10.0) -> dict[str, int]:
        """How many objects of each of our types were in reference cycles in the daemon since
        it started or since the last call (``helpers.cycles``); the daemon must have been
        started with ``BETON_TEST_GC_REPORT`` set to a file path, which turns its collector
        off."""
        report = Path(os.environ["BETON_TEST_GC_REPORT"])
        report.unlink(missing_ok=True)
        self.proc.send_signal(signal.SIGUSR1)
        wait_for(report.exists, timeout)
        counts = (line.split(" ", 1) for line in report.read_text().splitlines() if line)
        return {name: int(n) for n, name in counts}

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        """Send ``sig`` and wait; escalate to SIGKILL after ``timeout``. Returns the exit status."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return int(self.proc.returncode)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a daemon's ``--listen``)."""
    with socket_mod.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def daemons_serving(socket: str) -> list[int]:
    """PIDs of live (not zombie) ``beton-serve serve`` processes whose command line names
    ``socket``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if state != "Z" and socket.encode() in cmd and b"serve" in cmd:
            pids.append(int(entry.name))
    return pids


def wait_for(pred, timeout: float, step: float = 0.02) -> float:
    """Poll ``pred()`` until it is true; returns the seconds it took (``AssertionError`` after
    ``timeout``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return time.monotonic() - t0
        time.sleep(step)
    raise AssertionError(f"condition not met within {timeout} s")


def wait_until_serving(address: str, proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
    """Block until a channel to ``address`` is ready; fail if ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode}")
        ch = grpc.insecure_channel(address)
        try:
            grpc.channel_ready_future(ch).result(timeout=0.2)
            return
        except grpc.FutureTimeoutError:
            pass
        finally:
            ch.close()
    raise TimeoutError(f"no daemon answered at {address} within {timeout} s")


def start_daemon(
    files: Sequence[str | os.PathLike[str]],
    workdir: Path,
    *,
    args: Sequence[str] = (),
    socket: str | None = None,
    wait: bool = True,
    timeout: float = 60.0,
) -> DaemonProcess:
    """Start ``beton-serve serve FILES --socket ...`` (2 workers unless ``args`` say otherwise)."""
    sock = socket or str(workdir / "d.sock")
    log_path = workdir / f"daemon-{time.monotonic_ns()}.log"
    cmd = [sys.executable, "-c", _LAUNCH, "serve", *map(str, files), "--socket", sock]
    if "--workers" not in args:
        cmd += ["--workers", "2"]
    cmd += list(args)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    d = DaemonProcess(proc, sock, log_path)
    if wait:
        try:
            wait_until_serving(d.address, proc, timeout)
        except BaseException:
            d.stop(signal.SIGKILL)
            raise RuntimeError(f"daemon did not start:\n{d.log()}") from None
    return d


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short private directory under /tmp (for Unix sockets), removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix="bs-", dir="/tmp"))
    os.chmod(d, 0o700)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def daemon_factory(short_tmp: Path) -> Iterator:
    """``start(files, **kw) -> DaemonProcess``; every daemon is stopped and waited for at the end."""
    started: list[DaemonProcess] = []

    def start(files: Sequence[str | os.PathLike[str]], **kw: object) -> DaemonProcess:
        kw.setdefault("socket", None)
        d = start_daemon(files, short_tmp, **kw)  # type: ignore[arg-type]
        started.append(d)
        return d

    try:
        yield start
    finally:
        for d in started:
            d.stop()
            for name in d.shm_files():  # a daemon killed on purpose may leave its segments
                with contextlib.suppress(OSError):
                    (SHM / name).unlink()


@pytest.fixture(scope="module")
def daemon(fixtures_dir: Path) -> Iterator[DaemonProcess]:
    """One daemon per test module serving the FFCV fixtures mixed_fields, image_pairs and
    images_smart (module-scoped: started before, and stopped after, the per-test leak guard)."""
    d_dir = Path(tempfile.mkdtemp(prefix="bs-", dir="/tmp"))
    os.chmod(d_dir, 0o700)
    files = [
        fixtures_dir / f for f in ("mixed_fields.beton", "image_pairs.beton", "images_smart.beton")
    ]
    d = start_daemon(files, d_dir)
    try:
        yield d
    finally:
        d.stop()
        shutil.rmtree(d_dir, ignore_errors=True)


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` in MiB (``VmRSS`` of ``/proc/PID/status``)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")
