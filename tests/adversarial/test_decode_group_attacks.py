# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""Decode groups (issue 16) under attack: a member killed with SIGKILL mid-epoch, and members
that leave the group mid-epoch over and over.

A group holds decoded images for its members. A member that vanishes must leave nothing pinned:
the others keep their exact batches, and once every member has gone the group and its bytes are
gone too.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from beton_serve.engine import Engine, OrderOption
from beton_serve.fields import decode_cache as dc
from beton_serve.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
from beton_serve.loader import Loader
from beton_serve.transforms import RandomHorizontalFlip, ToTensor
from helpers.child import child_env
from helpers.daemon import daemon_factory, short_tmp, wait_for  # noqa: F401
from helpers.sweep_images import write_sweep_file

N = 48
BATCH = 8
SEED = 11
SIZES = (160, 176, 192)  # the survivors; the victim runs 224


@pytest.fixture(scope="module")
def jpeg_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_sweep_file(tmp_path_factory.mktemp("dga") / "sweep.beton", N, offset=100)


def _pipelines(size: int) -> dict:
    return {
        "image": [
            RandomResizedCropRGBImageDecoder((size, size), share_decode=True),
            RandomHorizontalFlip(),
            ToTensor(),
        ],
        "label": [IntDecoder(), ToTensor()],
    }


def _solo(path: Path, size: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Two epochs of the in-process Loader, alone in a fresh decode cache."""
    engine = Engine(num_workers=2)
    ld = Loader(
        str(path),
        batch_size=BATCH,
        order=OrderOption.RANDOM,
        seed=SEED,
        engine=engine,
        pipelines=_pipelines(size),
    )
    try:
        return [(x.numpy().copy(), y.numpy().copy()) for _ in range(2) for x, y in ld]
    finally:
        ld.close()
        engine.close()


_VICTIM = r"""
import sys, time
from beton_client import Loader, OrderOption
from beton_serve.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
from beton_serve.transforms import RandomHorizontalFlip, ToTensor
pipes = {"image": [RandomResizedCropRGBImageDecoder((224, 224), share_decode=True),
                   RandomHorizontalFlip(), ToTensor()],
         "label": [IntDecoder(), ToTensor()]}
ld = Loader("sweep", batch_size=int(sys.argv[2]), order=OrderOption.RANDOM, seed=int(sys.argv[3]),
            pipelines=pipes, server=sys.argv[1], spawn=False)
it = iter(ld)
next(it)
print("ready", flush=True)
time.sleep(120)  # killed here, holding its stream and its place in the group
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_member_killed_mid_epoch_leaves_the_others_exact_and_nothing_pinned(
    jpeg_file: Path, daemon_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from beton_client import Loader as Client
    from beton_client import OrderOption as ClientOrder

    monkeypatch.setattr(dc, "_default", [dc.DecodeCache()])
    refs = {s: _solo(jpeg_file, s) for s in SIZES}
    d = daemon_factory([jpeg_file])
    victim = subprocess.Popen(
        [sys.executable, "-c", _VICTIM, d.address, str(BATCH), str(SEED)],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    clients = []
    try:
        assert victim.stdout is not None
        line = victim.stdout.readline()
        assert line.strip() == "ready", victim.stderr.read() if victim.stderr else line

        def group() -> list:
            return [g for g in d.stats().decode_groups if g.field == "image"]

        clients = [
            Client(
                "sweep",
                batch_size=BATCH,
                order=ClientOrder.RANDOM,
                seed=SEED,
                pipelines=_pipelines(s),
                server=d.address,
                spawn=False,
            )
            for s in SIZES
        ]
        outs: list[list] = [[] for _ in SIZES]
        for e in range(2):
            its = [iter(c) for c in clients]
            for b in range(-(-N // BATCH)):
                if e == 1 and b == 2:
                    # The victim is a member, and the group holds images decoded for it. Its
                    # stream stopped in its epoch 0 (or its look-ahead into epoch 1) once the
                    # ring was full; the survivors' streams run on into epoch 1's tail and
                    # epoch 2, whose images the victim has yet to take. (At a fixed point of
                    # epoch 0 the survivors may already stand where the victim stands: then
                    # nothing is held.)
                    wait_for(
                        lambda: [(g.members, g.live_bytes > 0) for g in group()] == [(4, True)], 15
                    )
                    victim.send_signal(signal.SIGKILL)
                    victim.wait(10)
                for i, it in enumerate(its):
                    x, y = next(it)
                    outs[i].append((x.numpy().copy(), y.numpy().copy()))
            assert all(next(it, None) is None for it in its)
        # the daemon noticed the vanished client: it left the group
        wait_for(lambda: [g.members for g in group()] == [3], 15)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait(10)
        for c in clients:
            c.close()
    for s, out in zip(SIZES, outs, strict=True):
        ref = refs[s]
        assert len(out) == len(ref)
        for (x1, y1), (x2, y2) in zip(out, ref, strict=True):
            assert np.array_equal(y1, y2) and np.array_equal(x1, x2)
    # every member gone: no group, no decoded image held
    wait_for(lambda: not group(), 15)
    assert d.proc.poll() is None  # and the daemon serves on


_CYCLES = r"""
import json, os, sys
from beton_serve.fields import decode_cache as dc
from beton_serve.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
from beton_serve.loader import Loader, OrderOption
path, cycles = sys.argv[1], int(sys.argv[2])

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6

def mk(size, seed):
    pipes = {"image": [RandomResizedCropRGBImageDecoder((size, size), share_decode=True)],
             "label": [IntDecoder()]}
    return Loader(path, batch_size=4, num_workers=2, order=OrderOption.RANDOM, seed=seed,
                  pipelines=pipes)

shared = 0
def pair(i):
    # two members of one group; each leaves mid-epoch at its own point, one of them first
    global shared
    with mk(24, i % 3) as a, mk(16, i % 3) as b:
        ia, ib = iter(a), iter(b)
        for _ in range(1 + i % 3):
            x, _ = next(ia)
            assert x.shape == (4, 24, 24, 3) and x.any()
        x, _ = next(ib)
        assert x.shape == (4, 16, 16, 3) and x.any()
        shared += sum(g.hits for g in dc.default_decode_cache().stats())
        if i % 2:
            a.close()
            next(ib)

for i in range(20):
    pair(i)
base_rss, base_fds = rss_mb(), len(os.listdir("/proc/self/fd"))
for i in range(cycles):
    pair(i)
cache = dc.default_decode_cache()
cache.stats()  # an operation: members of collected streams queued to leave have left
print(json.dumps({"rss": rss_mb() - base_rss, "fds": len(os.listdir("/proc/self/fd")) - base_fds,
                  "groups": len(cache._groups), "bytes": cache.nbytes, "lru": len(cache._lru),
                  "shared": shared}))
"""


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_members_leaving_mid_epoch_1000_times_leave_no_group_or_bytes(jpeg_file: Path) -> None:
    import json

    from helpers.child import run_child

    out = run_child(_CYCLES, str(jpeg_file), "1000", env=child_env(), timeout=360).stdout
    grown = json.loads(out.strip().splitlines()[-1])
    assert grown["shared"] > 0, grown  # the pairs did share decodes
    assert (grown["groups"], grown["bytes"], grown["lru"]) == (0, 0, 0), grown
    assert grown["fds"] <= 0, grown
    assert grown["rss"] <= 8.0, grown


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_thousand_served_members_leave_no_group_fd_or_memory_in_the_daemon(
    jpeg_file: Path, daemon_factory
) -> None:
    """1,000 served share_decode streams, in pairs that form a group and leave it mid-epoch
    (one closed, one dropped without close): the daemon ends with no group, no decoded bytes,
    its baseline descriptors and RSS within 8 MB."""
    import gc
    import os

    from beton_client import Loader as Client
    from beton_client import OrderOption as ClientOrder

    d = daemon_factory([jpeg_file])

    def client(size: int, seed: int) -> Client:
        return Client(
            "sweep",
            batch_size=4,
            order=ClientOrder.RANDOM,
            seed=seed,
            pipelines={
                "image": [
                    RandomResizedCropRGBImageDecoder((size, size), share_decode=True),
                    ToTensor(),
                ],
                "label": [IntDecoder(), ToTensor()],
            },
            server=d.address,
            spawn=False,
        )

    def pair(i: int) -> int:
        a, b = client(24, i % 3), client(16, i % 3)
        ia, ib = iter(a), iter(b)
        x, _ = next(ia)
        assert tuple(x.shape) == (4, 24, 24, 3) and bool(x.any())
        y, _ = next(ib)
        assert tuple(y.shape) == (4, 16, 16, 3) and bool(y.any())
        a.close()
        if i % 2:
            b.close()
        else:
            del ib, b  # dropped without close: the stream ends with the client's last reference
        return 0

    def fds() -> int:
        return len(os.listdir(f"/proc/{d.pid}/fd"))

    def rss_mb() -> float:
        for line in open(f"/proc/{d.pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    for i in range(30):  # warm-up: plans, allocator pools
        pair(i)
    gc.collect()
    wait_for(lambda: not d.stats().streams, 15)
    base_fds, base_rss = fds(), rss_mb()
    for i in range(30, 530):
        pair(i)
    gc.collect()
    wait_for(lambda: not d.stats().streams, 15)
    st = d.stats()
    assert not [g for g in st.decode_groups if g.members], st.decode_groups
    wait_for(lambda: fds() <= base_fds, 10)
    assert rss_mb() <= base_rss + 8.0, (base_rss, rss_mb())
    assert st.streams_opened >= 2 * 530
