"""A full ``/dev/shm``: a typed error for the stream that does not fit, nothing left behind, and
the daemon serves on, exactly.

The stream memory budget (``max_ring_bytes``, ``test_ring_budget.py``) bounds what the daemon's
own streams take; it cannot know what other programs put in ``/dev/shm``. When ``/dev/shm`` is
full, a ring's ``posix_fallocate`` fails (the ring is allocated up front, so that a worker never
takes SIGBUS writing a page tmpfs cannot give), and:

* the stream's open fails with ``TransportError`` naming ``/dev/shm`` and the space it needed,
  and the half-made segment is removed;
* a stream that fits is served bit for bit as the in-process Loader;
* identical streams whose sharing arena cannot be allocated share by copying, exactly.

The daemon and its clients run in a private mount namespace (``unshare -m``) whose ``/dev/shm``
is a 3 MiB tmpfs, so this needs root (and ``unshare``); it is skipped otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TESTS = Path(__file__).resolve().parents[1]

_SCRIPT = r"""
import json, os, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import numpy as np
from beton_client import Loader, OrderOption, TransportError
from beton_serve.fields.decoders import CenterCropRGBImageDecoder, IntDecoder
from beton_serve.loader import Loader as InProcessLoader
from beton_serve.loader import OrderOption as InProcessOrder
from helpers.daemon import start_daemon

beton, workdir = Path(sys.argv[2]), Path(sys.argv[3])
SHM = Path("/dev/shm")
out = {}


def pipes():
    return {"image": [CenterCropRGBImageDecoder((32, 32), 0.8)], "label": [IntDecoder()]}


def served(address, batch_size, ahead=3):
    return Loader(beton.stem, batch_size=batch_size, order=OrderOption.RANDOM, seed=5,
                  pipelines=pipes(), server=address, spawn=False, batches_ahead=ahead)


def epoch(ld):
    return [(np.array(x), np.array(y)) for x, y in ld]


def same(a, b):
    return len(a) == len(b) and all(
        np.array_equal(x1, x2) and np.array_equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b))


with InProcessLoader(str(beton), batch_size=8, order=InProcessOrder.RANDOM, seed=5,
                     pipelines=pipes(), num_workers=1) as ref_ld:
    ref = epoch(ref_ld)

# A budget far above the tmpfs: only the tmpfs can refuse.
d = start_daemon([beton], workdir, args=["--max-ring-bytes", str(1 << 30)])
try:
    base = sorted(os.listdir(SHM))  # the daemon's notice socket
    filler = SHM / "filler"
    free = os.statvfs(SHM).f_bavail * os.statvfs(SHM).f_frsize
    filler.write_bytes(b"x" * (free - (256 << 10)))  # leave 256 KiB
    try:
        served(d.address, batch_size=64)  # 4 slots of ~200 KiB: more than is left
        out["big"] = "opened"
    except TransportError as exc:
        out["big"] = f"{type(exc).__name__}: {exc}"
    out["after_refusal"] = sorted(os.listdir(SHM))
    filler.write_bytes(b"")
    # Room for one ring of 8-image batches (16 slots of ~25 KiB) and not for an arena beside
    # two of them: two identical streams share, by copying.
    free = os.statvfs(SHM).f_bavail * os.statvfs(SHM).f_frsize
    filler.write_bytes(b"x" * (free - (900 << 10)))
    a, b = served(d.address, 8), served(d.address, 8)
    try:
        got_a, got_b = [], []
        for x, y in zip(a, b):
            got_a.append(tuple(np.array(t) for t in x))
            got_b.append(tuple(np.array(t) for t in y))
        out["pair_exact"] = same(got_a, ref) and same(got_b, ref)
        out["pair_batches"] = len(got_a)
    finally:
        a.close()
        b.close()
    filler.unlink()
    with served(d.address, 8) as ld:
        out["alone_exact"] = same(epoch(ld), ref)
    out["daemon_alive"] = d.proc.poll() is None
    out["log"] = d.log()
finally:
    rc = d.stop()
out["stop_rc"] = rc
out["left"] = sorted(os.listdir(SHM))
out["base"] = base
print("RESULT " + json.dumps(out))
"""


def _can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
        capture_output=True,
        timeout=30,
    )
    return probe.returncode == 0


def test_a_full_dev_shm_refuses_the_stream_that_does_not_fit_and_serves_the_rest(
    fixtures_dir: Path, tmp_path: Path
) -> None:
    if not _can_unshare():
        pytest.skip("needs root and unshare -m (a private /dev/shm)")
    script = tmp_path / "shm_full.py"
    script.write_text(_SCRIPT)
    work = Path("/tmp") / f"bs-shm-{os.getpid()}"  # a Unix socket path must stay short
    work.mkdir(mode=0o700, exist_ok=True)
    try:
        cmd = (
            "mount -t tmpfs -o size=3m,mode=1777 tmpfs /dev/shm && exec "
            f"{sys.executable} {script} {TESTS} {fixtures_dir / 'images_smart.beton'} {work}"
        )
        proc = subprocess.run(
            ["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True, timeout=150
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    out = json.loads(lines[0][len("RESULT ") :])
    assert out["big"].startswith("TransportError: "), out["big"]
    assert "/dev/shm" in out["big"] and "No space left" in out["big"]
    assert out["after_refusal"] == sorted([*out["base"], "filler"])  # the half-made ring removed
    assert out["pair_batches"] == 8 and out["pair_exact"]
    assert "this group shares by copying" in out["log"] or "no shared-memory arena" in out["log"]
    assert out["alone_exact"] and out["daemon_alive"] and out["stop_rc"] == 0
    assert out["left"] == []  # a clean stop unlinks everything, the notice socket too
