"""Conformance with random image augmentations: client tails, ``ToDevice``, progressive resizing
through ``decoder.output_size``, ``recompile`` and resume give the same pixels on every backend
(issue 12 §3, issue 13 §3).

Random crops and flips make every pixel a function of (seed, epoch, sample id): an epoch, a
batch or a sample out of place shows up as different pixels. The file is the FFCV-written
``images_jpg`` fixture (64 JPEGs of many sizes, labels, weights).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from beton_serve.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
from beton_serve.pipeline.allocation_query import AllocationQuery
from beton_serve.pipeline.operation import Operation
from beton_serve.pipeline.state import State
from beton_serve.transforms import (
    Convert,
    NormalizeImage,
    RandomHorizontalFlip,
    Squeeze,
    ToDevice,
    ToTensor,
    ToTorchImage,
)
from helpers.daemon import DaemonProcess

from conformance._backends import (
    BACKENDS,
    assert_same_batches,
    assert_same_epochs,
    epoch,
    epochs,
    make_loader,
    module_daemon,
)

pytestmark = pytest.mark.slow

MEAN = np.array([0.485, 0.456, 0.406]) * 255
STD = np.array([0.229, 0.224, 0.225]) * 255
BATCH = 8


@pytest.fixture(scope="module")
def beton(fixtures_dir: Path) -> Path:
    return fixtures_dir / "images_jpg.beton"


@pytest.fixture(scope="module")
def daemon(beton: Path) -> Iterator[DaemonProcess]:
    with module_daemon([beton]) as d:
        yield d


class Normalize(torch.nn.Module):
    """torchvision's ``Normalize(mean, std)`` on an NCHW float batch."""

    def __init__(self, mean: np.ndarray, std: np.ndarray) -> None:
        super().__init__()
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


class InvertRed(Operation):
    """A training script's own Numba-stage op (before ``ToTensor``): ``255 - red``, per pixel.

    The daemon of this module cannot import this module (the tests directory is not on its
    path), so served it runs where issue 13 §2 says: in the client, compiled locally.
    """

    def generate_code(self) -> Callable[..., Any]:
        def invert_red(images: Any, dst: Any) -> Any:
            for i in range(images.shape[0]):
                dst[i] = images[i]
                dst[i, :, :, 0] = 255 - images[i, :, :, 0]
            return dst

        return invert_red

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery]:
        shape = previous_state.shape
        if shape is None:
            raise ValueError("InvertRed needs a decoded image before it")
        return previous_state, AllocationQuery(shape, previous_state.dtype)


class Halve(Operation):
    """A training script's own op after the ToTensor boundary (plain Python on the batch)."""

    def generate_code(self) -> Callable[..., Any]:
        def halve(images: torch.Tensor, _dst: Any) -> torch.Tensor:
            return images.float().mul_(0.5)

        return halve

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, None]:
        return replace(previous_state, dtype=torch.float32), None


def _label_tail() -> list[Any]:
    return [IntDecoder(), ToTensor(), Squeeze(), ToDevice("cpu", non_blocking=True)]


#: name -> the image pipeline after its (random) decoder and flip.
TAILS: dict[str, Callable[[], list[Any]]] = {
    "numpy": lambda: [],
    "to_tensor": lambda: [ToTensor()],
    "torch_image": lambda: [ToTensor(), ToTorchImage()],
    "torch_image_nchw": lambda: [ToTensor(), ToTorchImage(channels_last=False)],
    "convert_fp16": lambda: [ToTensor(), ToTorchImage(), Convert(torch.float16)],
    "imagenet_fp16": lambda: [
        ToTensor(),
        ToDevice("cpu", non_blocking=True),
        ToTorchImage(),
        NormalizeImage(MEAN, STD, np.float16),
    ],
    "normalize_before_to_tensor": lambda: [NormalizeImage(MEAN, STD, np.float32), ToTensor()],
    "torch_module": lambda: [
        ToTensor(),
        ToTorchImage(),
        Convert(torch.float32),
        Normalize(MEAN, STD),
    ],
    "lambda": lambda: [ToTensor(), lambda x: x.flip(1)],
    "custom_op_before_boundary": lambda: [InvertRed(), ToTensor()],
    "custom_op_after_boundary": lambda: [ToTensor(), ToTorchImage(), Halve()],
}
#: Tails whose served output differs from in-process today (the observed difference).
SERVED_XFAIL: dict[str, str] = {}
#: Tails that fail on every backend today, the in-process reference included.
ALL_XFAIL: dict[str, str] = {}


def _backend_tail_params() -> list[Any]:
    out = []
    for b in BACKENDS:
        name = b if isinstance(b, str) else b.values[0]
        marks = [] if isinstance(b, str) else list(b.marks)
        for tail in TAILS:
            reason = ALL_XFAIL.get(tail) or (SERVED_XFAIL.get(tail) if name != "inproc" else None)
            m = [*marks, pytest.mark.xfail(strict=True, reason=reason)] if reason else marks
            out.append(pytest.param(name, tail, marks=m, id=f"{name}-{tail}"))
    return out


def image_pipes(tail: str, size: int = 16) -> tuple[dict[str, Any], Any]:
    """``(pipelines, decoder)``: the decoder is returned so that a test can resize it."""
    decoder = RandomResizedCropRGBImageDecoder((size, size))
    label = [IntDecoder()] if tail == "numpy" else _label_tail()
    pipes = {
        "image": [decoder, RandomHorizontalFlip(0.5), *TAILS[tail]()],
        "label": label,
        "weight": None,
    }
    return pipes, decoder


def _run(
    backend: str, beton: Path, daemon: DaemonProcess, tail: str, n: int, **kw: Any
) -> list[list]:
    pipes, _ = image_pipes(tail)
    kw = {"batch_size": BATCH, "order": "RANDOM", "seed": 21, **kw}
    with make_loader(backend, beton, pipes, address=daemon.address, **kw) as ld:
        return epochs(ld, n)


#: In-process results by configuration, computed once per module: every backend's run (the
#: ``inproc`` one included, a fresh Loader) is compared with the same reference.
_REFERENCE: dict[Any, Any] = {}


def _reference(key: Any, compute: Callable[[], Any]) -> Any:
    if key not in _REFERENCE:
        _REFERENCE[key] = compute()
    return _REFERENCE[key]


@pytest.mark.parametrize(("backend", "tail"), _backend_tail_params())
def test_client_tails(beton: Path, daemon: DaemonProcess, backend: str, tail: str) -> None:
    if backend == "cuda_ipc" and tail == "numpy":
        pytest.skip("not applicable: cuda_ipc carries GPU tensors, this tail yields numpy arrays")
    want = _reference(("tail", tail), lambda: _run("inproc", beton, daemon, tail, 2))
    got = _run(backend, beton, daemon, tail, 2)
    assert_same_epochs(got, want, f"{backend} vs in-process, tail {tail}")
    assert want[0][0] != want[1][0], "the augmentations did not change between epochs"


@pytest.mark.parametrize("recompile", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_progressive_resizing_between_epochs(
    beton: Path, daemon: DaemonProcess, backend: str, recompile: bool
) -> None:
    """ffcv-imagenet's ``decoder.output_size = (res, res)`` before each epoch takes effect."""
    sizes = [16, 24, 12]

    def run(b: str) -> list[list]:
        pipes, decoder = image_pipes("convert_fp16", sizes[0])
        got = []
        with make_loader(
            b,
            beton,
            pipes,
            address=daemon.address,
            batch_size=BATCH,
            order="QUASI_RANDOM",
            seed=5,
            recompile=recompile,
        ) as ld:
            for res in sizes:
                decoder.output_size = (res, res)
                got.append(epoch(ld))
        return got

    want = _reference(("resize", recompile), lambda: run("inproc"))
    got = run(backend)
    for res, batches in zip(sizes, got, strict=True):
        assert batches[0][0].shape == (BATCH, 3, res, res)
    assert_same_epochs(got, want, f"{backend} vs in-process")


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_op_parameter_changed_between_epochs_takes_effect_on_every_backend(
    beton: Path, daemon: DaemonProcess, backend: str
) -> None:
    """``flip.flip_prob = 1.0`` between epochs: a daemon's stream was re-opened with the new
    value while the in-process Loader kept the compiled one, so their epoch 1 differed. Each
    now gives what a Loader built with the new value gives for that epoch."""

    def run(b: str, change: bool) -> list[list]:
        pipes, _ = image_pipes("torch_image")
        flip = pipes["image"][1]
        if not change:
            flip.flip_prob = 1.0
        kw = {"batch_size": BATCH, "order": "RANDOM", "seed": 21}
        with make_loader(b, beton, pipes, address=daemon.address, **kw) as ld:
            if not change:
                ld.next_epoch = 1
                return [epoch(ld)]
            first = epoch(ld)
            flip.flip_prob = 1.0
            return [first, epoch(ld)]

    want = _reference("flip_prob", lambda: _run("inproc", beton, daemon, "torch_image", 1))
    want_after = _reference("flip_prob_1", lambda: run("inproc", change=False))
    assert (
        want_after[0]
        != _reference(
            ("tail", "torch_image"), lambda: _run("inproc", beton, daemon, "torch_image", 2)
        )[1]
    ), "flip_prob 1.0 changed nothing"
    got = run(backend, change=True)
    assert_same_epochs(got, want + want_after, f"{backend}, flip_prob changed before epoch 1")


@pytest.mark.parametrize("ahead", [1, 6])
@pytest.mark.parametrize("backend", BACKENDS)
def test_batches_ahead_and_os_cache(
    beton: Path, daemon: DaemonProcess, backend: str, ahead: int
) -> None:
    kw = {"batches_ahead": ahead, "os_cache": ahead == 1, "drop_last": False}
    want = _reference(
        ("ahead", ahead), lambda: _run("inproc", beton, daemon, "torch_image", 1, **kw)
    )
    got = _run(backend, beton, daemon, "torch_image", 1, **kw)
    assert_same_epochs(got, want, f"{backend} vs in-process")


PAIRS = [
    ("shm", "inproc"),
    ("inproc", "grpc"),
    ("grpc", "shm"),
    ("inproc", "shm"),
    pytest.param(("cuda_ipc", "inproc"), marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}-to-{p[1]}")
def test_resume_with_augmentations_across_backends(
    beton: Path, daemon: DaemonProcess, pair: tuple[str, str]
) -> None:
    """A checkpoint mid-epoch on one backend resumes on another, with ffcv-imagenet's
    progressive resizing: the resumed script sets the epoch's resolution before iterating."""
    src, dst = pair
    kw: dict[str, Any] = {"batch_size": BATCH, "order": "RANDOM", "seed": 77, "drop_last": False}
    sizes = (16, 24)

    def loader(b: str) -> tuple[Any, Any]:
        pipes, decoder = image_pipes("convert_fp16", sizes[0])
        return make_loader(b, beton, pipes, address=daemon.address, **kw), decoder

    def ref() -> list[list]:
        ld, decoder = loader("inproc")
        with ld:
            out = []
            for res in sizes:
                decoder.output_size = (res, res)
                out.append(epoch(ld))
            return out

    reference = _reference("resume", ref)
    a, decoder = loader(src)
    with a:
        epoch(a)
        decoder.output_size = (sizes[1], sizes[1])
        head = epoch(a, 3)
        state = a.state_dict()
    b, decoder = loader(dst)
    with b:
        b.load_state_dict(state)
        decoder.output_size = (sizes[1], sizes[1])
        rest = epoch(b)
    assert rest[0][0].shape == (BATCH, 3, sizes[1], sizes[1])
    assert_same_batches(head + rest, reference[1], f"{src} then {dst}: epoch 1")


@pytest.mark.parametrize("backend", ["inproc", "shm"])
def test_a_sample_listed_twice_gets_the_same_augmentation_within_an_epoch(
    beton: Path, daemon: DaemonProcess, backend: str
) -> None:
    """As docs/architecture.md "Randomness" says: draws depend on the sample's index, so a
    duplicate in ``indices`` repeats its original's crop and flip (FFCV draws each copy
    independently), while another epoch draws again."""
    pipes, _ = image_pipes("numpy", 24)
    kw: dict[str, Any] = {"batch_size": 4, "order": "SEQUENTIAL", "seed": 5, "drop_last": False}
    with make_loader(
        backend, beton, pipes, address=daemon.address, indices=[7, 3, 7, 7], **kw
    ) as ld:
        (e0,) = epoch(ld)
        (e1,) = epoch(ld)

    def arr(o: Any) -> np.ndarray:
        return np.frombuffer(o.data, np.dtype(o.dtype)).reshape(o.shape)

    images, labels, again = arr(e0[0]), arr(e0[1]), arr(e1[0])
    assert images.shape == (4, 24, 24, 3)
    assert labels[0] == labels[2] == labels[3] != labels[1]
    assert np.array_equal(images[0], images[2]) and np.array_equal(images[0], images[3])
    assert not np.array_equal(images[0], again[0])
