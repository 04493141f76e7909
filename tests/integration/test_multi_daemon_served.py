# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""Several real daemons serving one Loader: batch b from daemon b mod S, failover when one dies."""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from beton_client import Loader, OrderOption
from beton_serve.fields.decoders import CenterCropRGBImageDecoder, SimpleRGBImageDecoder
from beton_serve.transforms import RandomHorizontalFlip, ToTensor
from helpers.daemon import daemon_factory, free_port, short_tmp  # noqa: F401

pytestmark = pytest.mark.slow


def _pipelines() -> dict:
    return {
        "input": [SimpleRGBImageDecoder(), RandomHorizontalFlip(0.5), ToTensor()],
        "target": [CenterCropRGBImageDecoder((20, 20), 0.75), ToTensor()],
    }


def _two(daemon_factory, short_tmp: Path, fixtures_dir: Path) -> tuple[list, list[str]]:
    daemons, targets = [], []
    for name in ("a", "b"):
        port = free_port()
        daemons.append(
            daemon_factory(
                [fixtures_dir / "image_pairs.beton"],
                socket=str(short_tmp / f"{name}.sock"),
                args=["--listen", f"127.0.0.1:{port}"],
            )
        )
        targets.append(f"127.0.0.1:{port}")
    return daemons, targets


KW: dict = dict(batch_size=2, seed=99, order=OrderOption.RANDOM, drop_last=False)


def _reference(address: str) -> tuple[list[tuple], list[np.ndarray]]:
    """Two epochs from one daemon over shm."""
    out, ids = [], []
    with Loader("image_pairs", pipelines=_pipelines(), server=address, **KW) as ld:
        for _ in range(2):
            for b in ld:
                out.append(tuple(x.clone() for x in b))
                ids.append(ld.last_sample_ids.copy())
    return out, ids


def _check(got: list[tuple], want: list[tuple]) -> None:
    assert len(got) == len(want)
    for x, y in zip(got, want, strict=True):
        for u, v in zip(x, y, strict=True):
            assert u.dtype == v.dtype and u.shape == v.shape
            assert torch.equal(u, v)


def test_two_daemons_share_the_epoch_identically_to_one(
    daemon_factory, short_tmp: Path, fixtures_dir: Path
) -> None:
    daemons, targets = _two(daemon_factory, short_tmp, fixtures_dir)
    want, want_ids = _reference(daemons[0].address)
    got, ids = [], []
    with Loader("image_pairs", pipelines=_pipelines(), server=targets, **KW) as ld:
        assert ld.chosen_transport == "grpc"
        n = len(ld)
        for _ in range(2):
            for b in ld:
                got.append(tuple(x.clone() for x in b))
                ids.append(ld.last_sample_ids.copy())
        # each daemon made its own share: batch b from daemon b mod 2
        sent = [
            sum(s.batches_sent for s in d.stats().streams if s.transport == "grpc") for d in daemons
        ]
    _check(got, want)
    assert [i.tolist() for i in ids] == [i.tolist() for i in want_ids]
    assert sent == [2 * ((n + 1) // 2), 2 * (n // 2)]


def test_a_daemon_killed_mid_epoch_loses_and_repeats_nothing(
    daemon_factory, short_tmp: Path, fixtures_dir: Path
) -> None:
    daemons, targets = _two(daemon_factory, short_tmp, fixtures_dir)
    want, want_ids = _reference(daemons[0].address)
    n = len(want) // 2
    got, ids = [], []
    with Loader("image_pairs", pipelines=_pipelines(), server=targets, **KW) as ld:
        it = iter(ld)
        for _ in range(3):
            got.append(tuple(x.clone() for x in next(it)))
            ids.append(ld.last_sample_ids.copy())
        assert daemons[1].stop(signal.SIGKILL) != 0
        for b in it:
            got.append(tuple(x.clone() for x in b))
            ids.append(ld.last_sample_ids.copy())
        assert len(got) == n
        # the next epoch comes from the survivor alone
        for b in ld:
            got.append(tuple(x.clone() for x in b))
            ids.append(ld.last_sample_ids.copy())
    _check(got, want)
    first = np.concatenate(ids[:n]).tolist()
    assert sorted(first) == list(range(len(first)))  # the epoch: nothing lost or repeated
    assert [i.tolist() for i in ids] == [i.tolist() for i in want_ids]


def test_daemons_serving_other_files_under_one_name_are_refused(
    daemon_factory, short_tmp: Path
) -> None:
    """Two daemons each serving a ``train.beton`` of the same size and schema but other
    contents: the Loader read batch b from daemon b mod 2, two datasets interleaved. It now
    refuses to start, naming both addresses; a copy of the same file is accepted."""
    import shutil

    from beton_client import SpecError
    from beton_serve.fields.decoders import IntDecoder
    from helpers.labelled import write_labelled

    a = write_labelled(short_tmp / "a" / "train.beton", 40, base=0)
    b = write_labelled(short_tmp / "b" / "train.beton", 40, base=10_000)
    (short_tmp / "c").mkdir()
    c = Path(shutil.copy(a, short_tmp / "c" / "train.beton"))
    targets = {}
    for name, path in (("a", a), ("b", b), ("c", c)):
        port = free_port()
        daemon_factory(
            [path], socket=str(short_tmp / f"{name}.sock"), args=["--listen", f"127.0.0.1:{port}"]
        )
        targets[name] = f"127.0.0.1:{port}"
    pipes = {"vec": None, "label": [IntDecoder(), ToTensor()]}
    kw = dict(batch_size=4, order=OrderOption.SEQUENTIAL, pipelines=pipes)
    with pytest.raises(SpecError, match="serves another file under this name"):
        Loader("train", server=[targets["a"], targets["b"]], **kw)
    with Loader("train", server=[targets["a"], targets["c"]], **kw) as ld:
        labels = [int(x) for (lab,) in ld for x in lab.reshape(-1)]
    assert labels == list(range(40))
