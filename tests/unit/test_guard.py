"""The resource guard itself: it sees segments, children and threads."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import conftest
import pytest


def test_guard_sees_child_processes() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        assert proc.pid in conftest._children()
    finally:
        proc.kill()
        proc.wait(timeout=5)
    assert proc.pid not in conftest._children()


def test_guard_sees_beton_threads() -> None:
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="beton-test-thread", daemon=True)
    t.start()
    try:
        assert "beton-test-thread" in conftest._beton_threads()
    finally:
        stop.set()
        t.join(timeout=5)
    assert "beton-test-thread" not in conftest._beton_threads()


def test_guard_sees_segments() -> None:
    from multiprocessing import shared_memory

    seg = shared_memory.SharedMemory(name="beton-guardtest-0", create=True, size=16)
    try:
        assert "beton-guardtest-0" in conftest._segments()
    finally:
        seg.close()
        seg.unlink()
    assert "beton-guardtest-0" not in conftest._segments()


_ORPHAN = r"""
import os, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from helpers.daemon import start_daemon
d = start_daemon([sys.argv[2]], Path(sys.argv[3]))
print(d.pid, flush=True)
os._exit(0)  # as pytest-timeout ends a hung run: no fixture stops the daemon
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.split()[1] in ("Z", "X") for line in f if line.startswith("State:"))
    except FileNotFoundError:
        return True


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_test_daemon_stops_when_the_process_that_started_it_is_gone(
    tmp_path: Path, fixtures_dir: Path
) -> None:
    work = Path(tempfile.mkdtemp(prefix="bs-", dir="/tmp"))  # a short socket path
    try:
        out = subprocess.run(
            [sys.executable, "-c", _ORPHAN, str(Path(conftest.__file__).parent),
             str(fixtures_dir / "images_jpg.beton"), str(work)],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        pid = int(out.stdout.split()[0])
        deadline = time.monotonic() + 30
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"the orphaned daemon {pid} was still running after 30 s")
        assert not list(Path("/dev/shm").glob(f"beton-{pid}-*"))  # it drained and cleaned up
    finally:
        shutil.rmtree(work, ignore_errors=True)
