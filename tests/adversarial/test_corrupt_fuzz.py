"""Corrupt JPEGs, served against in-process: the same pixels, or the same error naming the same
sample, and a daemon that serves on.

Each trial copies a JPEG fixture (``images_jpg``, ``images_smart``), spoils 1 to 4 of its JPEG
samples at random (a flipped bit, a zeroed or random span, an early end-of-image marker, garbage
over the header), and reads two epochs with a crop decoder from a daemon (which opens the copy
on demand) and from the in-process Loader, half the trials under a bad-sample budget of 3 (the
daemon's ``--bad-sample-budget``, the Loader's ``bad_sample_budget``). Both must return the
same bits, and when one fails, the other fails after the same batches (compared bit for bit)
with the same error type naming the same spoilt sample: without a budget the first bad sample in
batch order, however the daemon split the batch over its workers; under a budget the first bad
sample of the batch that exhausts it, however many batches were in flight at once and whichever
finished first (the budget is charged in batch order, as each batch is delivered: it used to be
charged as batches finished, so the two Loaders could fail at different batches).

The first run of this fuzz found that a corrupt header left the worker's TurboJPEG handle
failing every later JPEG (``tests/unit/test_tj3.py`` has the deterministic tests).
``BETON_FUZZ_TRIALS`` sets the trials per seed (default 15), ``BETON_FUZZ_SEEDS`` the seeds.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from beton_serve.fields.decoders import (
    CenterCropRGBImageDecoder,
    IntDecoder,
    RandomResizedCropRGBImageDecoder,
)
from beton_serve.format import BetonReader
from beton_serve.transforms import RandomHorizontalFlip, ToTensor
from conformance._backends import assert_same_epochs, make_loader, module_daemon, snap
from helpers.daemon import DaemonProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TRIALS = int(os.environ.get("BETON_FUZZ_TRIALS", "15"))
SEEDS = [int(s) for s in os.environ.get("BETON_FUZZ_SEEDS", "0,1,2").split(",") if s]
BUDGET = 3
_SAMPLE = re.compile(r"sample (\d+)")


@pytest.fixture(scope="module")
def daemons(fixtures_dir: Path) -> Iterator[tuple[DaemonProcess, DaemonProcess]]:
    files = [fixtures_dir / "images_jpg.beton"]
    with (
        module_daemon(files) as plain,
        module_daemon(files, args=["--bad-sample-budget", str(BUDGET)]) as budget,
    ):
        yield plain, budget


def _spans(path: Path) -> dict[int, tuple[int, int, int]]:
    """Sample -> (first byte, end, mode) of its image in ``path`` (the next image's start, or the
    allocation table's, bounds each: spoiling the table past the last image made the file, not
    a sample, fail, naming a good sample)."""
    r = BetonReader(str(path))
    try:
        md = r.metadata["f0"]
        ptrs = md["data_ptr"].astype(np.int64)
        modes = md["mode"]
        size = int(r.header.alloc_table_ptr)
    finally:
        r.close()
    order = np.argsort(ptrs)
    out = {}
    for k, i in enumerate(order):
        end = int(ptrs[order[k + 1]]) if k + 1 < len(order) else size
        out[int(i)] = (int(ptrs[i]), end, int(modes[i]))
    return out


def _spoil(src: Path, dst: Path, r: random.Random) -> list[tuple[int, str]]:
    shutil.copy(src, dst)
    spans = _spans(dst)
    jpegs = sorted(i for i, (_, _, mode) in spans.items() if mode == 0)
    done = []
    with open(dst, "r+b") as f:
        for _ in range(r.randint(1, 4)):
            i = r.choice(jpegs)
            a, b, _ = spans[i]
            kind = r.choice(["flip", "zero", "eoi", "garbage", "header"])
            off = a if kind == "header" else r.randrange(a, max(a + 1, b - 16))
            if kind == "flip":
                f.seek(off)
                data = bytes([f.read(1)[0] ^ (1 << r.randrange(8))])
            elif kind == "zero":
                data = b"\0" * r.randint(1, 64)
            elif kind == "eoi":
                data = b"\xff\xd9"
            else:
                data = bytes(r.randrange(256) for _ in range(r.randint(1, 64)))
            f.seek(off)
            f.write(data[: max(1, b - off)])
            done.append((i, kind))
    return done


def _pipelines(seed: int) -> dict[str, list]:
    r = random.Random(seed)
    h, w = r.randint(8, 40), r.randint(8, 40)
    dec: Any = (
        CenterCropRGBImageDecoder((h, w), r.uniform(0.3, 1.0))
        if r.random() < 0.5
        else RandomResizedCropRGBImageDecoder((h, w))
    )
    ops = [dec]
    if r.random() < 0.5:
        ops.append(RandomHorizontalFlip())
    if r.random() < 0.5:
        ops.append(ToTensor())
    return {"image": ops, "label": [IntDecoder()]}


def _run(make: Any) -> tuple[list[list[Any]], BaseException | None]:
    """Two epochs of ``make()``'s Loader, snapshotted: every batch delivered, and the error
    that ended them (``None``: both epochs complete)."""
    got: list[list[Any]] = []
    try:
        with make() as ld:
            for _ in range(2):
                got.append([])
                for b in ld:
                    got[-1].append(snap(b))
    except Exception as exc:
        return got, exc
    return got, None


@pytest.mark.parametrize("seed", SEEDS)
def test_corrupt_jpegs_give_the_same_bits_or_the_same_error(
    daemons: tuple[DaemonProcess, DaemonProcess], fixtures_dir: Path, tmp_path: Path, seed: int
) -> None:
    r = random.Random(seed)
    plain, budgeted = daemons
    compared = 0
    for trial in range(TRIALS):
        src = fixtures_dir / r.choice(["images_jpg.beton", "images_smart.beton"])
        path = tmp_path / f"spoilt-{trial}.beton"
        done = _spoil(src, path, r)
        pseed = r.randrange(1 << 30)
        budget = r.random() < 0.5
        kw = {
            "order": r.choice(["SEQUENTIAL", "RANDOM"]),
            "seed": r.randrange(100),
            "batch_size": r.choice([1, 4, 8, 16]),
            "drop_last": False,
        }
        transport = r.choice(["shm", "grpc"])
        d = budgeted if budget else plain
        what = f"seed {seed} trial {trial}: {src.name} {done} budget={budget} {transport} {kw}"
        extra = {"bad_sample_budget": BUDGET} if budget else {}
        want, want_exc = _run(lambda: make_loader("inproc", path, _pipelines(pseed), **kw, **extra))  # noqa: B023
        got, got_exc = _run(
            lambda: make_loader(transport, path, _pipelines(pseed), address=d.address, **kw)  # noqa: B023
        )
        # The same batches, bit for bit, up to the same point (an error ends both alike).
        assert_same_epochs(got, want, what)
        if want_exc is not None or got_exc is not None:
            assert type(got_exc).__name__ == type(want_exc).__name__, (
                f"{what}: {got_exc!r} != {want_exc!r}"
            )
            named = [[int(x) for x in _SAMPLE.findall(str(e))[:1]] for e in (got_exc, want_exc)]
            spoilt = {i for i, _ in done}
            assert all(set(x) <= spoilt for x in named), f"{what}: a good sample named: {named}"
            # Without a budget: the batch's first bad sample, however the batch was split; under
            # one: the first bad sample of the batch that exhausts it, in batch order.
            assert named[0] == named[1], (
                f"{what}: {got_exc!r} names another sample than {want_exc!r}"
            )
        else:
            compared += 1
        path.unlink()
    assert compared >= 2  # not every trial ended in an error
    assert plain.proc.poll() is None and budgeted.proc.poll() is None
    errors = [x for x in (plain.log() + budgeted.log()).splitlines() if "level=error" in x]
    assert not errors, errors[:3]
