"""Default worker counts follow the CPUs this process may run on (its affinity mask: a
container's cpuset, ``taskset``), not the host's count: ``os.cpu_count()`` made a daemon pinned
to 2 of 64 cores start 64 decode threads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "ffcv" / "images_raw.beton"

_CHILD = r"""
import json, os, sys
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
from beton_wire.limits import usable_cpus
from beton_serve.daemon import Daemon
from beton_serve.engine import Engine
from beton_serve.writer import DatasetWriter
from beton_serve.fields import IntField
out = {"cpu_count": os.cpu_count(), "usable": usable_cpus()}
engine = Engine()
out["engine"] = engine.num_workers
engine.close()
out["writer"] = DatasetWriter(sys.argv[2], {"label": IntField()}).num_workers
daemon = Daemon.create({"rows": [sys.argv[1]]}, sweep=False)
try:
    out["daemon"] = daemon.workers
finally:
    daemon.close()
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs sched_setaffinity and at least 2 usable CPUs",
)
def test_a_pinned_process_defaults_to_its_own_cpus(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(FIXTURE), str(tmp_path / "w.beton")],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["cpu_count"] >= 2  # the host's count, which the defaults must not use
    assert got == {**got, "usable": 1, "engine": 1, "writer": 1, "daemon": 1}
