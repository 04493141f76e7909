"""Random Loaders, served against in-process, bit for bit: a seeded fuzz over the FFCV fixtures.

Each trial draws a file, a pipeline per field (decoder, with its JPEG backend and resize,
augmentations, normalisation, tensor ops, in random combinations and parameters; on the mixed
file, the bytes and JSON fields too and some fields left out with ``None``), an order and seed, a batch size, ``drop_last``,
``batches_ahead``, sometimes ``indices`` (with repeats) or ``distributed`` (``RANK`` and
``WORLD_SIZE`` set for both Loaders), and a transport (sometimes with ``copy=True``); then reads two epochs
from the daemon and from the in-process Loader and compares every output's bits, or, when one
side refuses, requires the same error type from the other. A third of the trials also stop
part-way through the first epoch, checkpoint, and resume on a new Loader of a random
transport; some of the others read two identical served Loaders in lock step (the daemon's
sharing groups), and some resize their crops before the second epoch (progressive resizing).
A third of the trials go to a second daemon with a tight stream memory budget and sharing
groups that detach a member one batch behind (:data:`TIGHT`); a stream it refuses with
``ResourceExhausted`` is skipped. A fifth of the plain trials instead follow a random epoch
schedule on one Loader (``conformance._backends.epoch_schedule``): epochs read again, out of order and back in time
through ``next_epoch``, some left after a few batches. A last test reads two or three identical
served Loaders (a sharing group), each on its own random epoch schedule, in a random interleaving:
each must read what the in-process Loader reads on its schedule, and a member's batch must not
change while the others read on.

The first version of this fuzz found that two compile-cache entries compiled in different
processes could share Numba symbol names (a flip of another probability failed with
``'descr' is NULL``; ``tests/unit/test_compile_cache.py`` has the deterministic test). The seeds
are fixed so that a failure reproduces: ``BETON_FUZZ_TRIALS`` sets the trials per seed (default
25), ``BETON_FUZZ_SEEDS`` the seeds (default ``0,1,2,3``).
"""

from __future__ import annotations

import functools
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from beton_serve.fields.decoders import (
    BytesDecoder,
    CenterCropRGBImageDecoder,
    FloatDecoder,
    IntDecoder,
    NDArrayDecoder,
    RandomResizedCropRGBImageDecoder,
    SimpleRGBImageDecoder,
)
from beton_serve.transforms import (
    Convert,
    Cutout,
    ImageMixup,
    LabelMixup,
    NormalizeImage,
    RandomBrightness,
    RandomContrast,
    RandomHorizontalFlip,
    RandomSaturation,
    RandomTranslate,
    ToTensor,
    ToTorchImage,
)
from helpers.daemon import DaemonProcess

from conformance._backends import (
    assert_same_batches,
    assert_same_schedules,
    epoch,
    epoch_schedule,
    make_loader,
    module_daemon,
    resumed,
    run_interleaved,
    run_schedule,
    shared_schedules,
    snap,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

#: file -> (fields, samples); image_pairs' images all have one size per field.
FILES = {
    "images_raw": (("image", "label"), 64),
    "images_jpg": (("image", "label", "weight"), 64),
    "images_smart": (("image", "label"), 64),
    "image_pairs": (("input", "target"), 16),
    "mixed_fields": (("int", "float", "array", "blob", "meta"), 50),
}
TRIALS = int(os.environ.get("BETON_FUZZ_TRIALS", "25"))
SEEDS = [int(s) for s in os.environ.get("BETON_FUZZ_SEEDS", "0,1,2,3").split(",") if s]


@pytest.fixture(scope="module")
def daemon(fixtures_dir: Path) -> Iterator[DaemonProcess]:
    with module_daemon([fixtures_dir / f"{f}.beton" for f in FILES]) as d:
        yield d


#: A second daemon on a tight stream memory budget (shallow rings, arenas refused: groups share
#: by copying) whose sharing groups detach a member one batch behind.
TIGHT = ["--max-ring-bytes", "1500000", "--share-retain", "1", "--share-max-lag", "1"]


@pytest.fixture(scope="module")
def tight(fixtures_dir: Path) -> Iterator[DaemonProcess]:
    with module_daemon([fixtures_dir / f"{f}.beton" for f in FILES], args=TIGHT) as d:
        yield d


def _image_ops(r: random.Random, fixed_size: bool, mixup: tuple[float, bool] | None) -> list:
    h, w = r.randint(4, 40), r.randint(4, 40)
    kind = r.choice(["cc", "rrc", "simple"] if fixed_size else ["cc", "rrc"])
    # the JPEG decoder and resize: tj3 crop- and scale-aware (auto), the simplejpeg whole-image
    # path, FFCV's exact mode (cv2 resize, no DCT scaling)
    dec = r.choice(
        [
            {},
            {"jpeg_backend": "simplejpeg"},
            {"resize": "cv2", "dct_scale": False},
            {"jpeg_backend": "simplejpeg", "resize": "cv2"},
        ]
    )
    if kind == "cc":
        ops: list[Any] = [CenterCropRGBImageDecoder((h, w), r.uniform(0.3, 1.0), **dec)]
    elif kind == "rrc":
        scale = (r.uniform(0.05, 0.5), 1.0)
        ratio = (r.uniform(0.5, 1.0), r.uniform(1.0, 2.0))
        ops = [RandomResizedCropRGBImageDecoder((h, w), scale=scale, ratio=ratio, **dec)]
    else:
        ops = [SimpleRGBImageDecoder()]
    fill = (r.randrange(256), r.randrange(256), r.randrange(256))
    extras = [
        lambda: RandomTranslate(r.randint(1, 6), fill),
        lambda: Cutout(r.randint(1, 8), fill),
        lambda: RandomBrightness(r.uniform(0.05, 0.6), r.choice([0.0, 0.5, 1.0])),
        lambda: RandomContrast(r.uniform(0.05, 0.6), r.choice([0.0, 0.5, 1.0])),
        lambda: RandomSaturation(r.uniform(0.05, 0.6), r.choice([0.0, 0.5, 1.0])),
        lambda: RandomHorizontalFlip(r.choice([0.0, 0.5, 1.0, r.random()])),
    ]
    for make in r.sample(extras, r.randint(0, 3)):
        ops.append(make())
    if mixup is not None:
        ops.append(ImageMixup(*mixup))
    if r.random() < 0.3:
        mean = np.array([r.uniform(0, 255) for _ in range(3)])
        std = np.array([r.uniform(20, 80) for _ in range(3)])
        ops.append(NormalizeImage(mean, std, r.choice([np.float32, np.float16])))
    if r.random() < 0.7:
        ops.append(ToTensor())
        if r.random() < 0.5:
            ops.append(ToTorchImage())
            if r.random() < 0.5 and not isinstance(ops[-3], NormalizeImage):
                ops.append(Convert(r.choice([torch.float16, torch.float32])))
    return ops


def _pipelines(file: str, seed: int) -> dict[str, list | None]:
    """Fresh ops for ``file``, drawn from ``seed`` (called once per Loader: a Loader owns its
    ops)."""
    r = random.Random(seed)
    fields, _ = FILES[file]
    mixup = (r.uniform(0.1, 1.0), r.random() < 0.5) if r.random() < 0.2 else None
    out: dict[str, list | None] = {}
    for name in fields:
        if name == "label":
            ops: list[Any] = [IntDecoder()]
            if mixup is not None and "image" in fields:
                ops.append(LabelMixup(*mixup))
            if r.random() < 0.5:
                ops.append(ToTensor())
            out[name] = ops
        elif name in ("weight", "float"):
            out[name] = [FloatDecoder()]
        elif name == "int":
            out[name] = [IntDecoder()] + ([ToTensor()] if r.random() < 0.5 else [])
        elif name == "array":
            out[name] = [NDArrayDecoder()] + ([ToTensor()] if r.random() < 0.5 else [])
        elif name in ("blob", "meta"):  # BytesField, JSONField (whose decoder is BytesDecoder)
            out[name] = [BytesDecoder()] + ([ToTensor()] if r.random() < 0.5 else [])
        else:
            fixed = file == "image_pairs"
            out[name] = _image_ops(r, fixed, mixup if name == "image" else None)
    if file == "mixed_fields":  # FFCV skips a field whose pipeline is None
        for name in r.sample(fields, r.randint(0, 3)):
            out[name] = None
    return out


def _draw(r: random.Random) -> tuple[str, int, dict[str, Any], str, dict[str, Any], dict]:
    file = r.choice(sorted(FILES))
    n = FILES[file][1]
    kw: dict[str, Any] = {
        "order": r.choice(["SEQUENTIAL", "RANDOM", "QUASI_RANDOM"]),
        "seed": r.randrange(1000),
        "batch_size": r.choice([1, 2, 3, 5, 7, 8, 16, 33, 64, 100]),
        "drop_last": r.random() < 0.5,
        "batches_ahead": r.randint(1, 5),
    }
    if r.random() < 0.4:
        if r.random() < 0.5:
            kw["indices"] = sorted(r.sample(range(n), r.randint(1, n)))
        else:  # repeats, any order
            kw["indices"] = [r.randrange(n) for _ in range(r.randint(1, 2 * n))]
    env: dict[str, str] = {}
    if r.random() < 0.25:
        world = r.randint(1, 5)
        kw["distributed"] = True
        env = {"RANK": str(r.randrange(world)), "WORLD_SIZE": str(world)}
    transport = r.choice(["shm", "grpc"])
    served: dict[str, Any] = {}
    if r.random() < 0.2:
        served["copy"] = True
    return file, r.randrange(1 << 30), kw, transport, served, env


def _distributed_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    """Set a trial's ``RANK`` and ``WORLD_SIZE`` (both Loaders read them), or clear them."""
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


class _Factory:
    """Makes one trial's Loader of one backend; keeps the pipelines of the last one made (a
    Loader owns its ops: progressive resizing sets its decoders' ``output_size``)."""

    def __init__(
        self, backend: str, *, path: Path, pseed: int, kw: dict, served: dict, address: str
    ) -> None:
        self.backend = backend
        self.path = path
        self.pseed = pseed
        self.kw = kw if backend == "inproc" else {**kw, **served}  # served: served-only options
        self.address = address
        self.pipes: dict[str, list | None] = {}

    def __call__(self) -> Any:
        self.pipes = _pipelines(self.path.stem, self.pseed)
        return make_loader(self.backend, self.path, self.pipes, address=self.address, **self.kw)


def _resize(pipes: dict[str, list | None], size: tuple[int, int] | None) -> None:
    """Progressive resizing (ffcv-imagenet): set every crop decoder's ``output_size``."""
    for ops in pipes.values():
        if (
            size is not None
            and ops
            and isinstance(ops[0], RandomResizedCropRGBImageDecoder | CenterCropRGBImageDecoder)
        ):
            ops[0].output_size = size


def _run(
    make: _Factory, n_epochs: int = 2, size: tuple[int, int] | None = None
) -> list[list] | BaseException:
    try:
        with make() as ld:
            out = []
            for e in range(n_epochs):
                if e == 1:
                    _resize(make.pipes, size)
                out.append(epoch(ld))
            return out
    except Exception as exc:
        return exc


def _pair(
    make: _Factory, n_epochs: int = 2, size: tuple[int, int] | None = None
) -> list[list] | BaseException:
    """Two identical Loaders opened together and read in lock step (a sharing group on the
    daemon: each batch decoded once, read by both); both must see the same batches, which are
    returned once."""
    try:
        a = make()
        pa = make.pipes
        with a, make() as b:
            pb = make.pipes
            out = []
            for e in range(n_epochs):
                if e == 1:
                    _resize(pa, size)
                    _resize(pb, size)
                ia, ib = iter(a), iter(b)
                xs, ys = [], []
                for x, y in zip(ia, ib, strict=True):
                    xs.append(snap(x))
                    ys.append(snap(y))
                assert_same_batches(ys, xs, "the second member of the pair")
                out.append(xs)
            return out
    except Exception as exc:
        return exc


@pytest.mark.parametrize("seed", SEEDS)
def test_random_loaders_served_equal_in_process(
    daemon: DaemonProcess,
    tight: DaemonProcess,
    fixtures_dir: Path,
    seed: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    r = random.Random(seed)
    checked = 0
    for trial in range(TRIALS):
        file, pseed, kw, transport, served, env = _draw(r)
        _distributed_env(monkeypatch, env)
        resume_at = r.randint(0, 3) if r.random() < 0.33 else None
        pair = resume_at is None and r.random() < 0.3
        size = (
            (r.randint(4, 40), r.randint(4, 40)) if resume_at is None and r.random() < 0.3 else None
        )
        again = r.choice(["shm", "grpc", "inproc"])
        path = fixtures_dir / f"{file}.beton"
        what = f"seed {seed} trial {trial}: {file} {transport} {kw} {served} {env} p={pseed}"
        d = tight if r.random() < 0.3 else daemon
        if d is tight:
            what += ", on the tight daemon"

        loader = functools.partial(
            _Factory, path=path, pseed=pseed, kw=kw, served=served, address=d.address
        )

        # Drawn apart from ``r``, so that the other draws of a seed stay what they were.
        rs = random.Random(f"schedule {seed} {trial}")
        steps = epoch_schedule(rs) if resume_at is None and not pair and rs.random() < 0.2 else None
        if size is not None and steps is None:
            what += f", epoch 1 resized to {size}"
        got: Any
        if steps is not None:
            what += f", schedule {steps}"
            want = run_schedule(loader("inproc"), steps)
            got = run_schedule(loader(transport), steps)
            if d is tight and type(got).__name__ == "ResourceExhausted":
                continue
            checked += assert_same_schedules(got, want, what)
            continue
        want = _run(loader("inproc"), 2 if resume_at is None else 3, size)
        if pair:
            what += ", two identical Loaders in lock step"
            got = _pair(loader(transport), 2, size)
        elif resume_at is None:
            got = _run(loader(transport), 2, size)
        else:
            what += f", resumed at batch {resume_at} on {again}"
            got = resumed(loader(transport), loader(again), resume_at)
        if d is tight and type(got).__name__ == "ResourceExhausted":
            continue  # a ring the tight budget cannot hold: refused, as it should be
        if isinstance(want, BaseException) or isinstance(got, BaseException):
            assert type(got).__name__ == type(want).__name__, f"{what}: {got!r} != {want!r}"
            continue
        if resume_at is not None and not want[0]:
            continue  # no batch to checkpoint between (an epoch of 0 batches counts as passed)
        if resume_at is not None:
            first, e, b, got = got
            assert_same_batches(first, want[0][:resume_at], f"{what}, before the checkpoint")
            assert (e, b) == ((0, resume_at) if resume_at < len(want[0]) else (1, 0)), what
            want = [want[e][b:], want[e + 1]]
        for e, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_batches(g, w, f"{what}, epoch {e}")
        checked += 1
    assert checked >= TRIALS // 2  # most trials compared batches, not only errors
    assert daemon.proc.poll() is None and tight.proc.poll() is None


@pytest.mark.parametrize("seed", SEEDS)
def test_sharing_members_on_their_own_schedules_read_what_they_would_alone(
    daemon: DaemonProcess,
    tight: DaemonProcess,
    fixtures_dir: Path,
    seed: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two or three identical served Loaders (shm or grpc, drawn per Loader) share their decodes
    on the daemon, but each follows its own epoch schedule (epochs read again, out of order,
    left early), and they are read in a random interleaving. Each must read, bit for bit, what the in-process Loader reads on the
    same schedule, and a batch one member holds must not change while the others read on."""
    r = random.Random(f"sharing schedules {seed}")
    checked = 0
    trials = max(1, TRIALS // 3)
    for trial in range(trials):
        file, pseed, kw, transport, served, env = _draw(r)
        _distributed_env(monkeypatch, env)
        d = tight if r.random() < 0.3 else daemon
        schedules = shared_schedules(r, r.choice([2, 2, 3]))
        what = (
            f"seed {seed} trial {trial}: {file} {transport} {kw} {served} {env} p={pseed}, "
            f"schedules {schedules}" + (", on the tight daemon" if d is tight else "")
        )
        loader = functools.partial(
            _Factory,
            path=fixtures_dir / f"{file}.beton",
            pseed=pseed,
            kw=kw,
            served=served,
            address=d.address,
        )
        # Members on other transports too (one group may serve shm and grpc streams alike).
        rt = random.Random(f"{what} transports")
        transports = [transport] + [rt.choice([transport, "shm", "grpc"]) for _ in schedules[1:]]
        what += f", transports {transports}"
        makes = [loader(t) for t in transports]
        got = run_interleaved(makes, schedules, random.Random(f"{what} order"))
        if d is tight and type(got).__name__ == "ResourceExhausted":
            continue  # rings the tight budget cannot hold: refused, as they should be
        for m, steps in enumerate(schedules):
            want = run_schedule(loader("inproc"), steps)
            mine = got if isinstance(got, BaseException) else got[m]
            checked += assert_same_schedules(mine, want, f"{what}, member {m}")
    assert checked >= trials // 2  # most trials compared batches, not only errors
    assert daemon.proc.poll() is None and tight.proc.poll() is None
