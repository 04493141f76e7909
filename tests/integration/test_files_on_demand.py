# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""Issue 13 §1 (part): a daemon opens the file a client names, where the client may make it.

* The daemon's own user on its Unix socket: train and val are two files; a daemon started for
  train serves val too, opened on demand, in either order, each with its own contents.
* A TCP client: only files under ``--data-root``; a symlink under the root that points outside
  it is refused, and so is a file that is not a ``.beton``.
* A file opened on demand is closed after ``--idle-close`` seconds without streams, and opened
  again when named again.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from beton_client import Loader as ServedLoader
from beton_client.errors import SpecError as ClientSpecError
from beton_serve.fields.decoders import IntDecoder, NDArrayDecoder
from beton_serve.loader import Loader as InProcessLoader
from beton_serve.transforms import ToTensor
from helpers.daemon import daemon_factory, free_port, short_tmp  # noqa: F401
from helpers.labelled import write_labelled

pytestmark = pytest.mark.slow

BATCH = 8


_write = write_labelled


def _labels_served(target: str, address: str) -> list[int]:
    pipes = {"vec": [NDArrayDecoder(), ToTensor()], "label": [IntDecoder(), ToTensor()]}
    loader = ServedLoader(target, BATCH, pipelines=pipes, server=address, spawn=False)
    try:
        out: list[int] = []
        for v, y in loader:
            np.testing.assert_array_equal(np.asarray(v)[:, 0], np.asarray(y).reshape(-1))
            out.extend(np.asarray(y).reshape(-1).tolist())
        return out
    finally:
        loader.close()


def _labels_in_process(path: Path) -> list[int]:
    pipes = {"vec": [NDArrayDecoder()], "label": [IntDecoder()]}
    return [
        int(x)
        for _, y in InProcessLoader(str(path), BATCH, pipelines=pipes)
        for x in np.asarray(y).reshape(-1)
    ]


@pytest.mark.parametrize("first", ["train", "val"])
def test_val_is_opened_on_demand_by_a_daemon_started_for_train(
    daemon_factory, tmp_path: Path, first: str
) -> None:
    files = {
        "train": _write(tmp_path / "train.beton", 40, 0),
        "val": _write(tmp_path / "val.beton", 16, 1000),
    }
    d = daemon_factory([files["train"]])
    order = [first, "val" if first == "train" else "train"]
    for name in order:
        assert _labels_served(str(files[name]), d.address) == _labels_in_process(files[name])
    names = {x.name for x in d.stats().datasets}
    assert names == {"train", "val"}
    assert "opened on demand" in d.log()


def test_tcp_clients_open_files_only_under_a_data_root(daemon_factory, tmp_path: Path) -> None:
    root = tmp_path / "root"
    inside = _write(root / "inside.beton", 16, 200)
    outside = _write(tmp_path / "outside" / "outside.beton", 16, 300)
    (root / "escape.beton").symlink_to(outside)
    (root / "notes.txt").write_text("not a dataset")
    served = _write(tmp_path / "served.beton", 8, 0)
    port = free_port()
    d = daemon_factory([served], args=["--listen", f"127.0.0.1:{port}", "--data-root", str(root)])
    tcp = f"127.0.0.1:{port}"
    assert _labels_served(str(inside), tcp) == _labels_in_process(inside)
    for path, why in (
        (outside, "outside this daemon's data roots"),
        (root / "escape.beton", "outside this daemon's data roots"),
    ):
        with pytest.raises(ClientSpecError, match=why):
            _labels_served(str(path), tcp)
    # The daemon's own user on the Unix socket may open it.
    assert _labels_served(str(outside), d.address) == _labels_in_process(outside)
    # ... and the Stats RPC names it, its streams and its counters to that user alone.
    pipes = {"vec": [NDArrayDecoder(), ToTensor()], "label": [IntDecoder(), ToTensor()]}
    with ServedLoader(str(outside), BATCH, pipelines=pipes, server=d.address, spawn=False) as ld:
        next(iter(ld))  # a stream open on it while the stats are asked
        mine, theirs = d.stats(), d.stats(tcp)
    assert {x.name for x in mine.datasets} == {"served", "inside", "outside"}
    assert "outside" in {s.dataset for s in mine.streams}
    assert {x.name for x in theirs.datasets} == {"served", "inside"}
    assert "outside" not in {s.dataset for s in theirs.streams}
    assert "outside" not in str(theirs)


def test_a_file_opened_on_demand_is_closed_when_idle_and_reopened(
    daemon_factory, tmp_path: Path
) -> None:
    served = _write(tmp_path / "train.beton", 8, 0)
    val = _write(tmp_path / "val.beton", 16, 1000)
    d = daemon_factory([served], args=["--idle-close", "0.5"])
    assert _labels_served(str(val), d.address) == _labels_in_process(val)
    first = {x.name: (x.samples_decoded, x.batches_decoded) for x in d.stats().datasets}
    assert first["val"] == (16, 2)
    deadline = time.monotonic() + 30
    while "val" in {x.name for x in d.stats().datasets}:
        assert time.monotonic() < deadline, d.log()[-2000:]
        time.sleep(0.1)
    assert "closed after" in d.log()
    assert _labels_served(str(val), d.address) == _labels_in_process(val)  # opened again
    again = {x.name: (x.samples_decoded, x.batches_decoded) for x in d.stats().datasets}
    assert set(again) >= {"train"}
    # The counters go on from where they were (they restarted at 0, which a dashboard summing
    # the exported counters reads as a drop).
    assert again["val"] == (32, 4)
