"""Auto-spawn: 4 processes starting at once with no daemon running spawn exactly one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.daemon import daemons_serving, short_tmp  # noqa: F401

pytestmark = pytest.mark.slow

_CLIENT = """
import sys
from beton_client import Loader
from beton_serve.fields.decoders import IntDecoder
pipes = {"int": [IntDecoder()], "float": None, "array": None, "blob": None, "meta": None}
with Loader(sys.argv[1], batch_size=10, pipelines=pipes, server=sys.argv[2]) as ld:
    print(sum(len(b[0]) for b in ld), flush=True)
"""


def test_four_processes_starting_together_spawn_exactly_one_daemon(
    short_tmp: Path,  # noqa: F811
    fixtures_dir: Path,
) -> None:
    sock = str(short_tmp / "auto.sock")
    target = "unix://" + sock
    beton = str(fixtures_dir / "mixed_fields.beton")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CLIENT, beton, target],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(4)
    ]
    spawned: list[int] = []
    try:
        outs = [p.communicate(timeout=100) for p in procs]
        for p, (out, err) in zip(procs, outs, strict=True):
            assert p.returncode == 0, err.decode()[-2000:]
            assert out.strip() == b"50"
        spawned = daemons_serving(sock)
        assert len(spawned) == 1, spawned
        lock_pid = int(Path(sock + ".lock").read_text().split()[0])
        assert spawned == [lock_pid]
        assert os.getsid(lock_pid) == lock_pid  # detached: its own session
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for pid in spawned or daemons_serving(sock):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while daemons_serving(sock) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in daemons_serving(sock):
            os.kill(pid, signal.SIGKILL)
    assert not daemons_serving(sock)
