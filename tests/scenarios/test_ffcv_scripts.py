"""FFCV training-script set-ups, served through auto-spawn, with a train and a val file each
(issue 13 §5).

Every test starts with no daemon: ``beton_client.Loader(path)`` finds none at the per-user
socket (isolated per test by ``XDG_RUNTIME_DIR``, see ``scenarios._spawned``), spawns one for its
file, and the second file is opened by that same daemon. Each Loader's output is compared, bit
for bit, with an in-process ``beton_serve.loader.Loader`` built from the same arguments, through
the same loop (epochs, progressive resizing, ranks). Memory layout (strides) is the conformance
suite's subject (``tests/conformance``); here values, dtypes and shapes are compared.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from beton_client import Loader, OrderOption
from beton_serve.fields.decoders import (
    CenterCropRGBImageDecoder,
    IntDecoder,
    NDArrayDecoder,
    RandomResizedCropRGBImageDecoder,
    SimpleRGBImageDecoder,
)
from beton_serve.pipeline.operation import Operation
from beton_serve.pipeline.state import State
from beton_serve.transforms import (
    Convert,
    Cutout,
    NormalizeImage,
    RandomHorizontalFlip,
    RandomTranslate,
    Squeeze,
    ToDevice,
    ToTensor,
    ToTorchImage,
)
from beton_wire.address import default_socket_path
from conformance._backends import assert_same_batches, column, epoch
from helpers.daemon import daemons_serving
from helpers.labelled import write_labelled

from scenarios._spawned import in_process, stop_spawned, write_images, write_pairs

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DEVICE = torch.device("cpu")  # 'cuda:0' in the scripts; this machine's tests run on the CPU


@pytest.fixture
def spawn_socket(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The per-user default socket, moved into a fresh private directory: no daemon serves it
    when the test starts, and every daemon spawned on it is stopped when the test ends.

    The directory is under /tmp rather than tmp_path: a Unix socket path has at most 107 bytes.
    """
    runtime = Path(tempfile.mkdtemp(prefix="bs-xdg-", dir="/tmp"))
    os.chmod(runtime, 0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.delenv("BETON_SERVE_ADDRESS", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    sock = default_socket_path(os.environ)
    assert sock.startswith(str(runtime)), sock
    assert not daemons_serving(sock)
    try:
        yield sock
    finally:
        stop_spawned(sock)
        shutil.rmtree(runtime, ignore_errors=True)
    assert not daemons_serving(sock)


def assert_one_daemon(sock: str) -> None:
    """Exactly one daemon was spawned, and it serves every file of the scenario."""
    pids = daemons_serving(sock)
    assert len(pids) == 1, f"daemons serving {sock}: {pids}"


def compare(served: list[list], local: list[list], what: str) -> None:
    assert len(served) == len(local), f"{what}: {len(served)} epochs, expected {len(local)}"
    for e, (g, w) in enumerate(zip(served, local, strict=True)):
        assert_same_batches(g, w, f"{what}, epoch {e}", strides=False)


# -- a. the seed document's paired-image example, with its custom op -------------------------
MEAN = [0.5 * 255, 0.5 * 255, 0.5 * 255]
STD = [0.25 * 255, 0.25 * 255, 0.25 * 255]


class Normalize(torch.nn.Module):
    """``torchvision.transforms.Normalize(mean, std)`` on an NCHW batch (torchvision's
    arithmetic: mean and std in the input's dtype, ``(x - mean) / std``)."""

    def __init__(self, mean: list[float], std: list[float]) -> None:
        super().__init__()
        self.mean, self.std = list(mean), list(std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = torch.as_tensor(self.mean, dtype=x.dtype, device=x.device).view(-1, 1, 1)
        std = torch.as_tensor(self.std, dtype=x.dtype, device=x.device).view(-1, 1, 1)
        return x.sub(mean).div(std)


class NormalizeFirstChannel(Operation):
    """The seed document's custom op: channel 0 of each image to zero mean and unit variance.

    An FFCV ``Operation`` defined in the training script, after ToTensor/ToTorchImage/Convert
    (FFCV's non-jit stage: ``generate_code()``'s function is called on the torch batch).
    """

    def __init__(self, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps

    def generate_code(self) -> Callable[..., Any]:
        eps = self.eps

        def normalize_first_channel(images: torch.Tensor, _dst: Any) -> torch.Tensor:
            first = images[:, 0]
            mean = first.mean(dim=(1, 2), keepdim=True)
            std = first.std(dim=(1, 2), keepdim=True)
            out = images.clone()
            out[:, 0] = (first - mean) / (std + eps)
            return out

        return normalize_first_channel

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, None]:
        if previous_state.jit_mode:
            raise ValueError("NormalizeFirstChannel works on torch tensors: put it after ToTensor")
        return replace(previous_state), None


def paired_pipelines() -> dict[str, Any]:
    """The seed's snippet (issue 4 §6), ``cuda:0`` -> cpu, with NormalizeFirstChannel."""
    return {
        "input": [
            SimpleRGBImageDecoder(),
            ToTensor(),
            ToTorchImage(),
            ToTensor(),
            Convert(torch.float32),
            Normalize(MEAN, STD),
            NormalizeFirstChannel(),
            ToDevice(DEVICE),
        ],
        "target": [
            SimpleRGBImageDecoder(),
            ToTensor(),
            ToTorchImage(),
            Convert(torch.float32),
            Normalize(MEAN, STD),
            ToDevice(DEVICE),
        ],
    }


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("pairs")
    return write_pairs(d / "train.beton", 24, (24, 32), 1), write_pairs(
        d / "val.beton", 8, (24, 32), 2
    )


def test_paired_images_with_custom_op(spawn_socket: str, pair_files: tuple[Path, Path]) -> None:
    train, val = pair_files

    def loaders(make: Callable[..., Any]) -> tuple[Any, Any]:
        tr = make(
            str(train),
            batch_size=4,
            num_workers=4,
            order=OrderOption.RANDOM,
            seed=3,
            pipelines=paired_pipelines(),
            drop_last=True,
        )
        va = make(
            str(val),
            batch_size=4,
            num_workers=4,
            order=OrderOption.SEQUENTIAL,
            pipelines=paired_pipelines(),
            drop_last=False,
        )
        return tr, va

    def script(make: Callable[..., Any]) -> tuple[list, list]:
        tr, va = loaders(make)
        with tr, va:
            runs: tuple[list, list] = ([], [])
            for _ in range(2):
                runs[0].append(epoch(tr))
                runs[1].append(epoch(va))
        return runs[0], runs[1]

    served = script(Loader)
    assert_one_daemon(spawn_socket)
    local = script(in_process)
    compare(served[0], local[0], "paired train")
    compare(served[1], local[1], "paired val")
    first = served[0][0][0][0].array()
    assert first.shape == (4, 3, 24, 32)
    np.testing.assert_allclose(first[:, 0].mean(axis=(1, 2)), 0, atol=1e-4)


# -- b. FFCV's ImageNet training script -----------------------------------------------------
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406]) * 255
IMAGENET_STD = np.array([0.229, 0.224, 0.225]) * 255
DEFAULT_CROP_RATIO = 224 / 256
RESOLUTIONS = [16, 24]  # get_resolution(epoch): the progressive-resizing schedule


def imagenet_train(make: Callable[..., Any], path: Path) -> tuple[Any, Any]:
    """ffcv-imagenet's ``create_train_loader`` (``distributed=True``, QUASI_RANDOM,
    ``os_cache=False``); returns ``(loader, decoder)``."""
    decoder = RandomResizedCropRGBImageDecoder((RESOLUTIONS[0], RESOLUTIONS[0]))
    image_pipeline = [
        decoder,
        RandomHorizontalFlip(),
        ToTensor(),
        ToDevice(DEVICE, non_blocking=True),
        ToTorchImage(),
        NormalizeImage(IMAGENET_MEAN, IMAGENET_STD, np.float16),
    ]
    label_pipeline = [IntDecoder(), ToTensor(), Squeeze(), ToDevice(DEVICE, non_blocking=True)]
    loader = make(
        str(path),
        batch_size=8,
        num_workers=2,
        order=OrderOption.QUASI_RANDOM,
        os_cache=False,
        drop_last=True,
        pipelines={"image": image_pipeline, "label": label_pipeline},
        distributed=True,
        seed=0,
    )
    return loader, decoder


def imagenet_val(make: Callable[..., Any], path: Path) -> Any:
    """ffcv-imagenet's ``create_val_loader``."""
    res = RESOLUTIONS[-1]
    image_pipeline = [
        CenterCropRGBImageDecoder((res, res), ratio=DEFAULT_CROP_RATIO),
        ToTensor(),
        ToDevice(DEVICE, non_blocking=True),
        ToTorchImage(),
        NormalizeImage(IMAGENET_MEAN, IMAGENET_STD, np.float16),
    ]
    label_pipeline = [IntDecoder(), ToTensor(), Squeeze(), ToDevice(DEVICE, non_blocking=True)]
    return make(
        str(path),
        batch_size=8,
        num_workers=2,
        order=OrderOption.SEQUENTIAL,
        drop_last=False,
        pipelines={"image": image_pipeline, "label": label_pipeline},
        distributed=True,
    )


def test_imagenet_training_script_loaders(
    spawn_socket: str, fixtures_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    train, val = fixtures_dir / "images_jpg.beton", fixtures_dir / "images_smart.beton"
    monkeypatch.setenv("WORLD_SIZE", "2")

    def script(make: Callable[..., Any]) -> dict[str, list]:
        ranks = []
        for rank in (0, 1):  # two ranks of one node, stepping through the epochs together
            monkeypatch.setenv("RANK", str(rank))
            ranks.append((*imagenet_train(make, train), imagenet_val(make, val)))
        out: dict[str, list] = {f"{k} rank {r}": [] for k in ("train", "val") for r in (0, 1)}
        try:
            for res in RESOLUTIONS:
                for rank, (tr, decoder, _) in enumerate(ranks):
                    decoder.output_size = (res, res)
                    out[f"train rank {rank}"].append(epoch(tr))
            for rank, (_, _, va) in enumerate(ranks):
                out[f"val rank {rank}"].append(epoch(va))
        finally:
            for tr, _, va in ranks:
                tr.close()
                va.close()
        return out

    served = script(Loader)
    assert_one_daemon(spawn_socket)
    local = script(in_process)
    for key in served:
        compare(served[key], local[key], key)
    for e, res in enumerate(RESOLUTIONS):
        first = served["train rank 0"][e][0][0]
        assert (first.shape, first.dtype) == ((8, 3, res, res), "float16")
    assert len(served["train rank 0"][0]) == 64 // 2 // 8
    assert served["val rank 1"][0][0][0].shape == (8, 3, RESOLUTIONS[-1], RESOLUTIONS[-1])


# -- c. FFCV's CIFAR script -------------------------------------------------------------------
CIFAR_MEAN = [125.307, 122.961, 113.8575]
CIFAR_FILL = (125, 122, 113)  # tuple(map(int, CIFAR_MEAN)) in the script
CIFAR_STD = [51.5865, 50.847, 51.255]


def cifar_loader(make: Callable[..., Any], path: Path, name: str) -> Any:
    """ffcv-cifar's ``make_dataloaders``, for ``name`` in ``train``/``test``."""
    label_pipeline = [IntDecoder(), ToTensor(), ToDevice(DEVICE), Squeeze()]
    image_pipeline: list[Any] = [SimpleRGBImageDecoder()]
    if name == "train":
        image_pipeline.extend(
            [
                RandomHorizontalFlip(),
                RandomTranslate(padding=2, fill=CIFAR_FILL),
                Cutout(4, CIFAR_FILL),
            ]
        )
    image_pipeline.extend(
        [
            ToTensor(),
            ToDevice(DEVICE, non_blocking=True),
            ToTorchImage(),
            Convert(torch.float16),
            Normalize(CIFAR_MEAN, CIFAR_STD),  # torchvision.transforms.Normalize in the script
        ]
    )
    ordering = OrderOption.RANDOM if name == "train" else OrderOption.SEQUENTIAL
    return make(
        str(path),
        batch_size=8,
        num_workers=2,
        order=ordering,
        drop_last=(name == "train"),
        pipelines={"image": image_pipeline, "label": label_pipeline},
        seed=1,
    )


@pytest.fixture(scope="module")
def cifar_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("cifar")
    return (
        write_images(d / "cifar_train.beton", 36, (32, 32), 10),
        write_images(d / "cifar_test.beton", 20, (32, 32), 11),
    )


def test_cifar_training_script_loaders(spawn_socket: str, cifar_files: tuple[Path, Path]) -> None:
    train, test = cifar_files

    def script(make: Callable[..., Any]) -> tuple[list, list]:
        with cifar_loader(make, train, "train") as tr, cifar_loader(make, test, "test") as te:
            runs: tuple[list, list] = ([], [])
            for _ in range(2):
                runs[0].append(epoch(tr))
                runs[1].append(epoch(te))
        return runs

    served = script(Loader)
    assert_one_daemon(spawn_socket)
    local = script(in_process)
    compare(served[0], local[0], "cifar train")
    compare(served[1], local[1], "cifar test")
    assert len(served[0][0]) == 36 // 8 and len(served[1][0]) == -(-20 // 8)
    assert served[0][0][0][0].dtype == "float16" and served[0][0][0][0].shape == (8, 3, 32, 32)
    assert served[0][0] != served[0][1], "the augmentations did not change between epochs"


# -- d. the Lightning DataModule (its no-lightning form) -------------------------------------
def _datamodule_class() -> Any:
    spec = importlib.util.spec_from_file_location(
        "lightning_datamodule_example", ROOT / "examples" / "lightning_datamodule.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.BetonDataModule


@pytest.mark.parametrize("first", ["val", "train"])
def test_lightning_datamodule_in_both_loader_orders(
    spawn_socket: str, fixtures_dir: Path, monkeypatch: pytest.MonkeyPatch, first: str
) -> None:
    import beton_client

    cls = _datamodule_class()
    train, val = fixtures_dir / "images_jpg.beton", fixtures_dir / "images_smart.beton"

    def script() -> dict[str, list]:
        dm = cls(str(train), str(val), batch_size=8, res=16, seed=4)
        made = {}
        for name in (first, "train" if first == "val" else "val"):  # Lightning: val first
            made[name] = dm.val_dataloader() if name == "val" else dm.train_dataloader()
        out: dict[str, list] = {"train": [], "val": []}
        try:
            for _ in range(2):
                out["train"].append(epoch(made["train"]))
                out["val"].append(epoch(made["val"]))
        finally:
            for ld in made.values():
                ld.close()
        return out

    served = script()
    assert_one_daemon(spawn_socket)
    with monkeypatch.context() as m:
        m.setattr(beton_client, "Loader", in_process)
        local = script()
    for key in ("train", "val"):
        compare(served[key], local[key], f"datamodule {key} ({first} created first)")
    assert served["train"][0][0][0].shape == (8, 3, 16, 16)
    assert len(served["val"][0]) == 64 // 8


# -- e. two files with the same stem in different folders -------------------------------------
def test_same_stem_in_two_folders_served_by_one_daemon(spawn_socket: str, tmp_path: Path) -> None:
    a = write_labelled(tmp_path / "a" / "data.beton", 12, 0)
    b = write_labelled(tmp_path / "b" / "data.beton", 17, 1000)

    def pipes() -> dict[str, Any]:
        return {"vec": [NDArrayDecoder(), ToTensor()], "label": [IntDecoder(), ToTensor()]}

    def script(make: Callable[..., Any]) -> dict[str, list]:
        kw = {"batch_size": 5, "order": OrderOption.RANDOM, "seed": 2, "drop_last": False}
        with (
            make(str(a), pipelines=pipes(), **kw) as la,
            make(str(b), pipelines=pipes(), **kw) as lb,
        ):
            out: dict[str, list] = {"a": [], "b": []}
            for _ in range(2):  # interleaved epochs: both streams open at once
                out["a"].append(epoch(la))
                out["b"].append(epoch(lb))
        return out

    served = script(Loader)
    assert_one_daemon(spawn_socket)
    local = script(in_process)
    for key in ("a", "b"):
        compare(served[key], local[key], f"{key}/data.beton")
    labels_a = sorted(int(x) for x in column(served["a"][0], 1).reshape(-1))
    labels_b = sorted(int(x) for x in column(served["b"][0], 1).reshape(-1))
    assert labels_a == list(range(12))
    assert labels_b == list(range(1000, 1017))


def test_a_spawned_daemon_stopped_cleanly_leaves_no_files(
    spawn_socket: str, tmp_path: Path
) -> None:
    """Issue 13 §4: after SIGTERM the socket's directory holds no socket, lock or log file."""
    data = write_labelled(tmp_path / "data.beton", 6, 0)
    with Loader(str(data), batch_size=3, pipelines={"vec": None}) as ld:
        assert sum(len(b[0]) for b in ld) == 6
    assert_one_daemon(spawn_socket)
    assert stop_spawned(spawn_socket)
    left = sorted(p.name for p in Path(spawn_socket).parent.iterdir())
    assert left == [], f"left in {Path(spawn_socket).parent}: {left}"
