# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""Custom FFCV Operations from the training script, served, unchanged (issue 13 §2).

Every route of docs/custom-ops.md through a real daemon, over shm and grpc, against the
in-process Loader, bit for bit (pixels and labels):

* after the ToTensor boundary: an op that normalises channel 0 after ToTensor/ToTorchImage/
  Convert (the seed document's pattern) and an op ``with_indices``, run by the client as FFCV runs
  them;
* route b: a Numba op before ToTensor, defined in a module the daemon can import too, rebuilt by
  the daemon from its automatically recorded constructor arguments;
* route c: the same op from a module the daemon cannot import, and from ``__main__``, run by the
  client, with a random op after it (seed keys from the in-process graph's positions).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from beton_client import Loader
from beton_client.errors import SpecError
from beton_serve.fields import IntField, RGBImageField
from beton_serve.fields.decoders import IntDecoder, SimpleRGBImageDecoder
from beton_serve.loader import Loader as InProcessLoader
from beton_serve.loader import OrderOption
from beton_serve.transforms import (
    Convert,
    RandomHorizontalFlip,
    Squeeze,
    ToTensor,
    ToTorchImage,
)
from beton_serve.writer import DatasetWriter
from helpers.daemon import daemon_factory, short_tmp  # noqa: F401
from helpers.user_ops import write_ops_module

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

N, H, W = 24, 12, 10
BATCH = 8
SEED = 7


class _Images:
    def __init__(self) -> None:
        rng = np.random.default_rng(3)
        self.images = rng.integers(0, 256, (N, H, W, 3), dtype=np.uint8)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return self.images[i], int(i * 3 + 1)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("custom-ops") / "images.beton"
    DatasetWriter(
        str(path), {"image": RGBImageField(write_mode="raw"), "label": IntField()}
    ).from_indexed_dataset(_Images())
    return path


@pytest.fixture(scope="module")
def labels_first(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same samples with the label field first: the image pipeline's nodes come after the
    label pipeline's, tail included."""
    path = tmp_path_factory.mktemp("custom-ops") / "labels_first.beton"
    rows = _Images()

    class Swapped:
        def __len__(self) -> int:
            return N

        def __getitem__(self, i: int):
            image, label = rows[i]
            return label, image

    DatasetWriter(
        str(path), {"label": IntField(), "image": RGBImageField(write_mode="raw")}
    ).from_indexed_dataset(Swapped())
    return path


@pytest.fixture
def mods(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, short_tmp: Path):
    """``(importable, private)``: the daemon's PYTHONPATH has the first module, not the second."""
    shared = tmp_path / "shared"
    private = tmp_path / "private"
    tag = tmp_path.name.replace("-", "_")[-20:]
    a = write_ops_module(shared, f"user_ops_shared_{tag}")
    b = write_ops_module(private, f"user_ops_private_{tag}")
    monkeypatch.setenv("PYTHONPATH", str(shared))
    yield a, b
    sys.modules.pop(a.__name__, None)
    sys.modules.pop(b.__name__, None)


def _epochs(loader, epochs: int = 2) -> list[tuple]:
    out = []
    for _ in range(epochs):
        for batch in loader:
            out.append(
                tuple(x.clone() if isinstance(x, torch.Tensor) else np.array(x) for x in batch)
            )
    return out


def _assert_same(served: list[tuple], local: list[tuple]) -> None:
    assert len(served) == len(local) > 0
    for a, b in zip(served, local, strict=True):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            x = torch.as_tensor(x)
            y = torch.as_tensor(y)
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x.cpu(), y.cpu())


def _compare(dataset: Path, address: str, transport: str, make_pipelines) -> list[tuple]:
    kw = dict(batch_size=BATCH, order=OrderOption.RANDOM, seed=SEED, drop_last=False)
    with InProcessLoader(str(dataset), pipelines=make_pipelines(), **kw) as ref:
        local = _epochs(ref)
    with Loader(
        str(dataset),
        pipelines=make_pipelines(),
        server=address,
        transport=transport,
        spawn=False,
        **kw,
    ) as loader:
        assert loader.chosen_transport == transport
        served = _epochs(loader)
    _assert_same(served, local)
    return served


TRANSPORTS = ["shm", "grpc"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ops_after_the_boundary_run_in_the_client(dataset, mods, daemon_factory, transport):
    ops, _ = mods
    d = daemon_factory([dataset])

    def pipelines():
        return {
            "image": [
                SimpleRGBImageDecoder(),
                RandomHorizontalFlip(0.5),
                ToTensor(),
                ToTorchImage(),
                Convert(torch.float32),
                ops.NormalizeFirstChannel(100.0, 50.0),
            ],
            "label": [IntDecoder(), ToTensor(), ops.AddSampleId(), Squeeze()],
        }

    served = _compare(dataset, d.address, transport, pipelines)
    assert served[0][0].dtype == torch.float32 and served[0][1].ndim == 1


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_importable_numba_op_runs_in_the_daemon(dataset, mods, daemon_factory, transport, caplog):
    ops, _ = mods
    d = daemon_factory([dataset])

    def pipelines():
        return {
            "image": [
                SimpleRGBImageDecoder(),
                ops.Posterize(3, invert=True),
                RandomHorizontalFlip(0.5),
                ToTensor(),
            ],
            "label": [IntDecoder(), ToTensor()],
        }

    with caplog.at_level(logging.INFO, logger="beton_client"):
        _compare(dataset, d.address, transport, pipelines)
    assert "in this process" not in caplog.text  # route b: nothing ran here
    assert "run in the client" not in d.log()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_op_changed_after_it_was_built_runs_as_changed(dataset, mods, daemon_factory, transport):
    """``op = Posterize(3); op.bits = 1``: the daemon rebuilt the op from its recorded
    constructor arguments (3 bits) while the in-process Loader used 1, with no word. The op
    now runs in the client (route c), as changed, and says why."""
    ops, _ = mods
    d = daemon_factory([dataset])

    def pipelines():
        op = ops.Posterize(3, invert=False)
        op.bits, op.invert = 1, True
        return {
            "image": [SimpleRGBImageDecoder(), op, ToTensor()],
            "label": [IntDecoder(), ToTensor()],
        }

    served = _compare(dataset, d.address, transport, pipelines)
    top_bit = served[0][0] & 0xFE  # 1 bit kept (the low bit is the sample id's parity)
    assert set(torch.unique(top_bit).tolist()) <= {0, 128}
    with pytest.raises(NotImplementedError, match=r"Posterize\.bits was changed after the op"):
        pipelines()["image"][1].import_spec()
    unchanged = ops.Posterize(3, invert=True)
    assert unchanged.import_spec()["args"] == [3]  # an op left as built still travels
    defaulted = ops.Posterize(3)
    defaulted.invert = True  # a parameter left at its default counts too
    with pytest.raises(NotImplementedError, match=r"Posterize\.invert was changed"):
        defaulted.import_spec()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_op_the_daemon_cannot_import_runs_in_the_client(
    dataset, mods, daemon_factory, transport, caplog
):
    _, private = mods
    d = daemon_factory([dataset])

    def pipelines():
        # A random op after the handed-back op, and one in the next pipeline: both draw the
        # in-process Loader's numbers (positions of the in-process graph).
        return {
            "image": [
                SimpleRGBImageDecoder(),
                private.Posterize(4),
                RandomHorizontalFlip(0.5),
                ToTensor(),
                ToTorchImage(),
            ],
            "label": [IntDecoder(), ToTensor()],
        }

    with caplog.at_level(logging.INFO, logger="beton_client"):
        _compare(dataset, d.address, transport, pipelines)
    text = caplog.text
    assert "Posterize" in text and "compiled here with Numba" in text
    assert "cannot import module" in text
    assert "ops from #1 run in the client" in d.log()


def test_op_from_main_runs_in_the_client_and_logs_once(dataset, mods, daemon_factory, caplog):
    ops, _ = mods
    d = daemon_factory([dataset])
    script_op = type("ScriptPosterize", (ops.Posterize,), {"__module__": "__main__"})

    def pipelines():
        return {
            "image": [SimpleRGBImageDecoder(), script_op(2), RandomHorizontalFlip(0.5)],
            "label": [IntDecoder(), ToTensor()],
        }

    with caplog.at_level(logging.INFO, logger="beton_client"):
        _compare(dataset, d.address, "shm", pipelines)
        _compare(dataset, d.address, "shm", pipelines)
    lines = [r for r in caplog.records if "ScriptPosterize" in r.getMessage()]
    assert len(lines) == 1
    assert "__main__" in lines[0].getMessage()


def test_a_custom_decoder_that_can_run_nowhere_is_refused(dataset, mods, daemon_factory):
    _, private = mods
    d = daemon_factory([dataset])
    decoder_cls = type("ScriptDecoder", (SimpleRGBImageDecoder,), {"__module__": private.__name__})
    with pytest.raises(SpecError, match=r"can run nowhere.*plugin.*import"):
        Loader(
            str(dataset),
            BATCH,
            pipelines={"image": [decoder_cls(), ToTensor()]},
            server=d.address,
            spawn=False,
        )


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_random_op_after_another_pipelines_tail_draws_in_process_numbers(
    labels_first, mods, daemon_factory, transport
):
    ops, _ = mods
    d = daemon_factory([labels_first])

    def pipelines():
        # Positions: label 0-3 (decoder, ToTensor, AddSampleId, Squeeze), image 4-6: the flip is
        # at 5 only if the label pipeline's client-side ops keep their nodes in the daemon.
        return {
            "label": [IntDecoder(), ToTensor(), ops.AddSampleId(), Squeeze()],
            "image": [SimpleRGBImageDecoder(), RandomHorizontalFlip(0.5), ToTensor()],
        }

    _compare(labels_first, d.address, transport, pipelines)


BIG = 160  # px: a Poison mask of 160x160x3 random floats is ~1.5 MB of JSON, over the 1 MiB limit


@pytest.fixture(scope="module")
def big_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``N`` raw ``BIG x BIG`` images, labels ``3i + 1``."""

    class Rows:
        def __init__(self) -> None:
            self.images = np.random.default_rng(5).integers(0, 256, (N, BIG, BIG, 3), np.uint8)

        def __len__(self) -> int:
            return N

        def __getitem__(self, i: int):
            return self.images[i], int(i * 3 + 1)

    path = tmp_path_factory.mktemp("custom-ops") / "big.beton"
    DatasetWriter(
        str(path), {"image": RGBImageField(write_mode="raw"), "label": IntField()}
    ).from_indexed_dataset(Rows())
    return path


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_builtin_op_with_parameters_too_large_to_send_runs_in_the_client(
    big_dataset, daemon_factory, transport, caplog, monkeypatch
):
    """FFCV's Poison with an image-sized mask (4 MB of JSON at 224 px) and a ReplaceLabel over
    many indices exceed what the client sends per op: they run here (route c), with a random op
    after them, and every batch equals the in-process Loader's (was: SpecError, 'parameters of
    ... bytes exceed the 1048576-byte limit')."""
    from beton_client._ops import MAX_IMPORT_BYTES
    from beton_serve.transforms import Poison, ReplaceLabel

    monkeypatch.setattr("beton_client._tail._LOGGED", set())  # the warning is once per process
    d = daemon_factory([big_dataset])
    rng = np.random.default_rng(11)
    mask = rng.uniform(0, 255, (BIG, BIG, 3))
    alpha = rng.uniform(0, 1, (BIG, BIG))
    many = list(range(1, 120_000, 2))  # odd ids, most of them past the file's end

    def pipelines():
        return {
            "image": [
                SimpleRGBImageDecoder(),
                Poison(mask, alpha, [0, 3, 5, 8, 13, 21], clamp=(10, 240)),
                RandomHorizontalFlip(0.5),
                ToTensor(),
            ],
            "label": [IntDecoder(), ReplaceLabel(many, 7), ToTensor(), Squeeze()],
        }

    with caplog.at_level(logging.WARNING, logger="beton_client"):
        served = _compare(big_dataset, d.address, transport, pipelines)
    text = caplog.text
    for op in ("Poison", "ReplaceLabel"):
        assert f"{op}'s parameters take" in text and f"more than {MAX_IMPORT_BYTES}" in text
    assert "ops from #1 run in the client" in d.log()
    labels = torch.cat([b[1] for b in served])
    assert set(labels.tolist()) == {7} | {3 * i + 1 for i in range(0, N, 2)}  # odd ids replaced


def test_a_branch_from_a_user_op_served(dataset, mods, daemon_factory):
    """A branch from a user's op that the daemon imports (route b) is served, equal to the
    in-process Loader; from one it hands back (route c) it is refused, naming where it runs."""
    from beton_serve.pipeline import PipelineSpec

    ops, private = mods
    d = daemon_factory([dataset])

    def pipelines(mod):
        def make():
            post = mod.Posterize(3)
            return {
                "image": [SimpleRGBImageDecoder(), post, RandomHorizontalFlip(0.5), ToTensor()],
                "label": [IntDecoder(), ToTensor()],
                "view": PipelineSpec(post, transforms=[RandomHorizontalFlip(0.5), ToTensor()]),
            }

        return make

    _compare(dataset, d.address, "shm", pipelines(ops))
    with pytest.raises(SpecError, match=r"which runs in the client"):
        _compare(dataset, d.address, "shm", pipelines(private))
