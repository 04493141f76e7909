"""Random Loaders with the rarer ops, served against in-process, bit for bit: a second fuzz.

``test_fuzz.py`` draws the common pipelines over the FFCV fixtures. This one draws what it
leaves out, over the fixtures and a file of photo-sized JPEGs written here (up to 900 px, so
that crop decoders pick every DCT scale, 1/8 to 8/8, and output sizes up to 200 px):

* ``RandomResizedCrop`` (the transform), ``Poison`` (with masks small enough to send, and masks
  over the client's per-op limit, which run in the training process: route c), ``ReplaceLabel``
  (a few ids, or tens of thousands: route c again), ``LabelMixup`` with ``MixupToOneHot``,
  ``Squeeze``, ``View``, a ``torch.nn.Module`` (wrapped as ``ModuleWrapper``);
* user ops: a Numba op from a module the daemon imports (route b), the same op from a module
  it cannot import (route c, with every op after it), and torch ops after the boundary with
  and without ``with_indices``;
* branches (``PipelineSpec(source=<op>)``: a second view from any op of the image pipeline
  that runs in the daemon, with ops of its own);
* ``os_cache=False`` as well as ``True``.

Each trial reads two epochs from the daemon and from the in-process Loader and compares every
output's bits, or, when one side refuses, requires the same error type from the other; a
quarter of them also checkpoint part-way and resume on a new Loader of a random backend, and a
fifth of the others follow a random epoch schedule on one Loader instead (epochs read again, out
of order, some left early: ``conformance._backends.epoch_schedule``).
``BETON_FUZZ_OPS_TRIALS`` sets the trials per seed (default 20), ``BETON_FUZZ_OPS_SEEDS`` the
seeds (default ``0,1,2``).
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from beton_serve.fields import IntField, RGBImageField
from beton_serve.fields.decoders import (
    CenterCropRGBImageDecoder,
    IntDecoder,
    RandomResizedCropRGBImageDecoder,
    SimpleRGBImageDecoder,
)
from beton_serve.pipeline import PipelineSpec
from beton_serve.transforms import (
    Convert,
    ImageMixup,
    LabelMixup,
    MixupToOneHot,
    NormalizeImage,
    Poison,
    RandomHorizontalFlip,
    RandomResizedCrop,
    ReplaceLabel,
    Squeeze,
    ToTensor,
    ToTorchImage,
    View,
)
from beton_serve.writer import DatasetWriter
from helpers.daemon import DaemonProcess, start_daemon
from helpers.user_ops import write_ops_module

from conformance._backends import (
    assert_same_batches,
    assert_same_schedules,
    epoch,
    epoch_schedule,
    make_loader,
    resumed,
    run_schedule,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TRIALS = int(os.environ.get("BETON_FUZZ_OPS_TRIALS", "20"))
SEEDS = [int(s) for s in os.environ.get("BETON_FUZZ_OPS_SEEDS", "0,1,2").split(",") if s]
#: file -> (image field, label field or None, samples, all images one size)
FILES = {
    "images_raw": ("image", "label", 64, False),
    "images_jpg": ("image", "label", 64, False),
    "images_smart": ("image", "label", 64, False),
    "image_pairs": ("input", None, 16, True),
    "photos": ("image", "label", 24, False),
}
CLASSES = 10  # the photos' labels are 0..9


class Scale(torch.nn.Module):
    """A torch module in a pipeline (the planner wraps it as ``ModuleWrapper``)."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() * self.factor + 1.0


class _Photos:
    """Photo-like images of many sizes (smooth shapes and noise), labels 0..9."""

    def __init__(self, n: int) -> None:
        import cv2

        rng = np.random.default_rng(2026)
        self.rows = []
        for i in range(n):
            h, w = (int(v) for v in rng.integers(60, 900, 2))
            low = rng.integers(0, 256, (max(2, h // 40), max(2, w // 40), 3), dtype=np.uint8)
            img = cv2.resize(low, (w, h), interpolation=cv2.INTER_CUBIC)
            img = np.clip(img.astype(np.int16) + rng.integers(-12, 13, img.shape), 0, 255)
            self.rows.append((img.astype(np.uint8), i % CLASSES))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.rows[i]


@pytest.fixture(scope="module")
def world(fixtures_dir: Path) -> Iterator[tuple[DaemonProcess, dict[str, Path], Any, Any]]:
    """``(daemon, paths, importable ops, private ops)``: a daemon over the fixtures and the
    photos, whose ``PYTHONPATH`` has the first ops module and not the second."""
    root = Path(tempfile.mkdtemp(prefix="bs-", dir="/tmp"))
    os.chmod(root, 0o700)
    tag = f"{os.getpid()}_{random.randrange(1 << 30)}"
    shared = write_ops_module(root / "shared", f"fuzz_ops_shared_{tag}")
    private = write_ops_module(root / "private", f"fuzz_ops_private_{tag}")
    paths = {f: fixtures_dir / f"{f}.beton" for f in FILES if f != "photos"}
    paths["photos"] = root / "photos.beton"
    DatasetWriter(
        str(paths["photos"]),
        {"image": RGBImageField(write_mode="jpg", jpeg_quality=85), "label": IntField()},
    ).from_indexed_dataset(_Photos(FILES["photos"][2]))
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(root / "shared")
    try:
        d = start_daemon(list(paths.values()), root)
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before
    try:
        yield d, paths, shared, private
    finally:
        d.stop()
        sys.modules.pop(shared.__name__, None)
        sys.modules.pop(private.__name__, None)
        shutil.rmtree(root, ignore_errors=True)


def _size(r: random.Random, big: bool) -> tuple[int, int]:
    if big and r.random() < 0.5:
        return r.randint(64, 200), r.randint(64, 200)
    return r.randint(4, 40), r.randint(4, 40)


def _image_ops(
    r: random.Random, file: str, mods: tuple[Any, Any], mixup: tuple[float, bool] | None
) -> list[Any]:
    shared, private = mods
    fixed = FILES[file][3]
    h, w = _size(r, file == "photos")
    dec = r.choice([{}, {"jpeg_backend": "simplejpeg"}, {"resize": "cv2", "dct_scale": False}])
    kind = r.choice(["cc", "rrc", "simple"] if fixed else ["cc", "rrc"])
    if kind == "cc":
        ops: list[Any] = [CenterCropRGBImageDecoder((h, w), r.uniform(0.2, 1.0), **dec)]
    elif kind == "rrc":
        scale = (r.uniform(0.02, 0.5), 1.0)
        ratio = (r.uniform(0.5, 1.0), r.uniform(1.0, 2.0))
        ops = [RandomResizedCropRGBImageDecoder((h, w), scale=scale, ratio=ratio, **dec)]
    else:
        ops = [SimpleRGBImageDecoder()]
        h, w = 24, 32  # image_pairs' inputs
    if r.random() < 0.3:  # the transform, after any decoder
        side = r.randint(4, 48)
        scale = (r.uniform(0.05, 0.6), 1.0)
        ops.append(RandomResizedCrop(scale, (3 / 4, 4 / 3), side, resize=r.choice(["area", "cv2"])))
        h = w = side
    extras = [
        lambda: RandomHorizontalFlip(r.choice([0.5, 1.0])),
        lambda: shared.Posterize(r.randint(1, 7), invert=r.random() < 0.5),
        lambda: private.Posterize(r.randint(1, 7)),
        lambda: _poison(r, h, w, FILES[file][2]),
    ]
    for make in r.sample(extras, r.randint(0, 3)):
        ops.append(make())
    if mixup is not None:
        ops.append(ImageMixup(*mixup))
    if r.random() < 0.2:
        mean = np.array([r.uniform(0, 255) for _ in range(3)])
        std = np.array([r.uniform(20, 80) for _ in range(3)])
        ops.append(NormalizeImage(mean, std, np.float32))
    if r.random() < 0.8:
        ops.append(ToTensor())
        tail = r.random()
        if tail < 0.25:
            ops.append(View(torch.int8 if ops[-2].__class__ is not NormalizeImage else torch.int32))
        elif tail < 0.75:
            ops.append(ToTorchImage())
            if r.random() < 0.6:
                ops.append(Convert(torch.float32))
                if r.random() < 0.5:
                    ops.append(
                        shared.NormalizeFirstChannel(100.0, 50.0)
                        if r.random() < 0.5
                        else Scale(0.25)
                    )
        else:
            ops.append(Scale(r.choice([0.5, 2.0])))
    return ops


def _poison(r: random.Random, h: int, w: int, n: int) -> Poison:
    rng = np.random.default_rng(r.randrange(1 << 30))
    # a mask of floats at h*w >= ~4,700 px is over the client's 256 KiB per op: route c
    mask = rng.uniform(0, 255, (h, w, 3))
    alpha = rng.uniform(0, 1, (h, w))
    ids = sorted(r.sample(range(n), r.randint(0, n)))
    clamp = r.choice([(0, 255), (20.0, 230.5)])
    return Poison(mask, alpha, ids, clamp)


def _pipelines(file: str, seed: int, mods: tuple[Any, Any]) -> dict[str, Any]:
    """Fresh ops for ``file`` from ``seed`` (a Loader owns its ops)."""
    r = random.Random(seed)
    image, label, n, _ = FILES[file]
    onehot = file == "photos" and r.random() < 0.3
    mixup = (r.uniform(0.1, 1.0), r.random() < 0.5) if onehot or r.random() < 0.1 else None
    out: dict[str, Any] = {image: _image_ops(r, file, mods, mixup)}
    if file == "image_pairs":
        out["target"] = [SimpleRGBImageDecoder(), ToTensor()] if r.random() < 0.5 else None
    if label is not None:
        out[label] = _label_ops(r, n, mods, mixup, onehot)
    if r.random() < 0.3 and not any(_in_client(op, mods) for op in out[image]):
        out["view"] = _branch(r, out[image], mods)
    return out


def _in_client(op: Any, mods: tuple[Any, Any]) -> bool:
    """A Numba-stage op the training process runs when served (route c): the daemon refuses
    branches in a pipeline family with one (``_plans._check_branch_families``)."""
    big = isinstance(op, Poison | ReplaceLabel) and len(json.dumps(op.spec_params())) > 262144
    return big or isinstance(op, mods[1].Posterize)


def _label_ops(
    r: random.Random, n: int, mods: tuple[Any, Any], mixup: Any, onehot: bool
) -> list[Any]:
    ops: list[Any] = [IntDecoder()]
    if r.random() < 0.4:
        many = r.random() < 0.3  # tens of thousands of ids: over the per-op limit, route c
        ids = r.sample(range(100_000), 40_000) if many else r.sample(range(n), r.randint(0, n))
        ops.append(ReplaceLabel(ids, r.randrange(CLASSES)))
    if mixup is not None:
        ops.append(LabelMixup(*mixup))
    if r.random() < 0.7 or onehot:
        ops.append(ToTensor())
        if onehot:
            ops.append(MixupToOneHot(CLASSES))
        elif mixup is None and r.random() < 0.5:
            if r.random() < 0.5:
                ops.append(mods[0].AddSampleId())
            ops.append(Squeeze())
    return ops


def _branch(r: random.Random, image_ops: list[Any], mods: tuple[Any, Any]) -> PipelineSpec:
    """A branch from a random Numba-stage op of the image pipeline (before its ToTensor):
    FFCV's second view."""
    daemon_side = []
    for op in image_ops:
        if isinstance(op, ToTensor | ImageMixup):
            break
        daemon_side.append(op)
    source = r.choice(daemon_side)
    ops: list[Any] = []
    if r.random() < 0.5:
        ops.append(RandomHorizontalFlip(r.choice([0.5, 1.0])))
    if r.random() < 0.3:
        ops.append(mods[0].Posterize(r.randint(1, 7)))
    if r.random() < 0.7:
        ops.append(ToTensor())
    return PipelineSpec(source, transforms=ops)


def _run(make: Any, n_epochs: int) -> list[list] | BaseException:
    try:
        with make() as ld:
            return [epoch(ld) for _ in range(n_epochs)]
    except Exception as exc:
        return exc


def _loader(
    backend: str, *, path: Path, pseed: int, kw: dict, mods: tuple[Any, Any], address: str
) -> Any:
    pipes = _pipelines(path.stem, pseed, mods)
    return make_loader(backend, path, pipes, address=address, **kw)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_loaders_with_rare_ops_served_equal_in_process(world, seed: int) -> None:
    d, paths, shared, private = world
    r = random.Random(1000 + seed)
    checked = 0
    for trial in range(TRIALS):
        file = r.choice(sorted(FILES))
        n = FILES[file][2]
        kw: dict[str, Any] = {
            "order": r.choice(["SEQUENTIAL", "RANDOM", "QUASI_RANDOM"]),
            "seed": r.randrange(1000),
            "batch_size": r.choice([1, 3, 8, 16, 33]),
            "drop_last": r.random() < 0.5,
            "os_cache": r.random() < 0.5,
        }
        if r.random() < 0.2:
            kw["indices"] = [r.randrange(n) for _ in range(r.randint(1, 2 * n))]
        transport = r.choice(["shm", "grpc"])
        pseed = r.randrange(1 << 30)
        resume_at = r.randint(0, 3) if r.random() < 0.25 else None
        again = r.choice(["shm", "grpc", "inproc"])
        what = f"seed {seed} trial {trial}: {file} {transport} {kw} p={pseed}"
        mods = (shared, private)
        loader = functools.partial(
            _loader, path=paths[file], pseed=pseed, kw=kw, mods=mods, address=d.address
        )
        # Drawn apart from ``r``, so that the other draws of a seed stay what they were.
        rs = random.Random(f"schedule ops {seed} {trial}")
        steps = epoch_schedule(rs) if resume_at is None and rs.random() < 0.2 else None
        got: Any
        if steps is not None:
            what += f", schedule {steps}"
            want = run_schedule(functools.partial(loader, "inproc"), steps)
            got = run_schedule(functools.partial(loader, transport), steps)
            checked += assert_same_schedules(got, want, what)
            continue
        want = _run(functools.partial(loader, "inproc"), 2 if resume_at is None else 3)
        if resume_at is None:
            got = _run(functools.partial(loader, transport), 2)
        else:
            what += f", resumed at batch {resume_at} on {again}"
            got = resumed(
                functools.partial(loader, transport), functools.partial(loader, again), resume_at
            )
        if isinstance(want, BaseException) or isinstance(got, BaseException):
            assert type(got).__name__ == type(want).__name__, f"{what}: {got!r} != {want!r}"
            continue
        if resume_at is not None:
            if not want[0]:
                continue
            first, e, b, got = got
            assert_same_batches(first, want[0][:resume_at], f"{what}, before the checkpoint")
            assert (e, b) == ((0, resume_at) if resume_at < len(want[0]) else (1, 0)), what
            want = [want[e][b:], want[e + 1]]
        for e, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_batches(g, w, f"{what}, epoch {e}")
        checked += 1
    assert checked >= TRIALS // 2  # most trials compared batches, not only errors
    assert d.proc.poll() is None
