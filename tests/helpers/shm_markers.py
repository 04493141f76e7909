"""Live markers of shared-memory segment groups held by another process, for the sweep's tests
(``beton_serve.transport.shm``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_HOLD_MARKER = """
import sys
from pathlib import Path
from beton_serve.transport.shm import ShmNamer
namer = ShmNamer(int(sys.argv[2]), shm_dir=Path(sys.argv[1]), mark_live=True)
print(namer.prefix, flush=True)
sys.stdin.read()  # until the test closes stdin; then exit without namer.close(), as kill -9
"""


def dead_pid() -> int:
    """The pid of a process that ran and was reaped (free unless the kernel reuses it)."""
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return int(done.stdout)


class MarkerHolder:
    """A process holding the live marker of a group named with ``pid`` in ``shm_dir``, with a
    ring file ``<prefix>ring-0`` in it. :meth:`release` ends it without removing anything, as
    ``kill -9`` of a daemon would; the caller sweeps what is left."""

    def __init__(self, shm_dir: Path, pid: int) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _HOLD_MARKER, str(shm_dir), str(pid)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            assert self.proc.stdout is not None
            self.prefix = self.proc.stdout.readline().strip()
            assert self.prefix.startswith(f"beton-{pid}-"), self.prefix
            self.ring = shm_dir / f"{self.prefix}ring-0"
            self.ring.write_bytes(b"x")
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """End the holder (idempotent): the marker's lock is free once this returns."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        assert self.proc.wait(30) == 0
        if self.proc.stdout is not None:
            self.proc.stdout.close()
