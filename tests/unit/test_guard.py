"""The resource guard itself: it sees segments, children and threads."""

from __future__ import annotations

import subprocess
import sys
import threading

import conftest


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
