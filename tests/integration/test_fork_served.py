"""A process forked from a trainer that holds a served Loader (``beton_client._forks``).

The child inherits the Loader's gRPC channel, its stream's notice socket and its shared-memory
mappings, which belong to the parent. Before: a child that iterated the Loader took the parent's
batches (both then failed with "out-of-order batch"), and a child that simply exited hung in
gRPC's channel close (run by the Loader's finalizer at exit) while its parent waited for it.
Now the child's ``iter()``/``next()`` raise ``RuntimeError`` saying what to do, its ``close()``
and its exit leave the parent's stream alone, a new Loader in the child works, and the parent
reads on, every batch bit for bit against a reference. Each run is a fresh process (the child
exits through the interpreter's normal exit, with its finalizers).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conformance._backends import module_daemon
from helpers.child import child_env
from helpers.daemon import DaemonProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

_SCRIPT = r"""
import os, sys
from beton_client import Loader, OrderOption, ServeOptions
from beton_serve.fields.decoders import CenterCropRGBImageDecoder, IntDecoder
from beton_serve.transforms import ToTensor

path, address, transport, child_does = sys.argv[1:5]

def make():
    pipes = {"image": [CenterCropRGBImageDecoder((16, 16), 1.0), ToTensor()],
             "label": [IntDecoder(), ToTensor()], "weight": None}
    return Loader(path, batch_size=4, num_workers=2, seed=3, pipelines=pipes,
                  order=OrderOption.RANDOM, serve=ServeOptions(server=address, transport=transport))

def snap(batches):
    return [(i.clone(), l.clone()) for i, l in batches]

def same(got, want):
    return len(got) == len(want) and all(
        (a[0] == b[0]).all() and (a[1] == b[1]).all() for a, b in zip(got, want))

with make() as ref:
    want = [snap(ref) for _ in range(2)]
ld = make()
it = iter(ld)
first = snap(next(it) for _ in range(3))  # each cloned before the next
pid = os.fork()
if pid == 0:
    out = []
    try:
        if child_does == "iterate":
            for call in (lambda: next(it), lambda: iter(ld)):
                try:
                    call()
                    out.append("no error")
                except RuntimeError as exc:
                    out.append("forked" if "forked from it" in str(exc) else repr(exc))
        elif child_does == "close":
            ld.close()
            out.append("closed")
        elif child_does == "new":
            with make() as mine:
                got = [snap(mine) for _ in range(2)]
            out.append("new " + ("SAME" if all(map(same, got, want)) else "DIFFERENT"))
        print("child", " ".join(out), flush=True)
    except BaseException as exc:
        print("child error", repr(exc), flush=True)
    sys.exit(0)  # the interpreter's exit: atexit, the Loader's finalizers
_, status = os.waitpid(pid, 0)
print("child status", status, flush=True)
rest = snap(it)
print("parent epoch 0", "SAME" if same(first + rest, want[0]) else "DIFFERENT", flush=True)
print("parent epoch 1", "SAME" if same(snap(ld), want[1]) else "DIFFERENT", flush=True)
ld.close()
"""


@pytest.fixture(scope="module")
def daemon(fixtures_dir: Path) -> Iterator[DaemonProcess]:
    with module_daemon([fixtures_dir / "images_jpg.beton"]) as d:
        yield d


@pytest.mark.parametrize("child_does", ["iterate", "close", "new", "nothing"])
@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_a_forked_child_leaves_its_parents_served_loader_alone(
    daemon: DaemonProcess, fixtures_dir: Path, transport: str, child_does: str
) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-X",
            "faulthandler",
            "-c",
            _SCRIPT,
            str(fixtures_dir / "images_jpg.beton"),
            daemon.address,
            transport,
            child_does,
        ],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stderr[-3000:]
    want_child = {
        "iterate": "child forked forked",
        "close": "child closed",
        "new": "child new SAME",
    }
    if child_does in want_child:
        assert want_child[child_does] in lines, (lines, proc.stderr[-3000:])
    assert "child status 0" in lines, (lines, proc.stderr[-3000:])
    assert "parent epoch 0 SAME" in lines and "parent epoch 1 SAME" in lines, lines
    assert daemon.proc.poll() is None
