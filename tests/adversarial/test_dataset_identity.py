# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""Issue 11 §1-2: a daemon never serves one dataset's samples for another's.

* Two files with the same schema (train and val always have one), served at once and opened
  with the same pipeline and batch size, in both orders and with sharing on and off: each
  client gets its own file's labels and pixels and its own batch count (the compiled-plan cache
  used to hand the second dataset the first one's reader).
* ``Loader(path)`` names a file: a file with the daemon's stem elsewhere is refused with both
  paths in the message; a hard link or symlink to the served file is the same file; a served
  file replaced on disk (new inode) is no longer the file the daemon has open.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from beton_client import Loader as ServedLoader
from beton_client.errors import SpecError as ClientSpecError
from beton_serve.fields.decoders import IntDecoder, NDArrayDecoder
from beton_serve.loader import Loader as InProcessLoader
from beton_serve.transforms import ToTensor
from helpers.daemon import daemon_factory, short_tmp  # noqa: F401
from helpers.labelled import write_labelled

pytestmark = pytest.mark.slow

BATCH = 8


_write = write_labelled


def _pipelines(tensor: bool) -> dict[str, list[object]]:
    tail = [ToTensor()] if tensor else []
    return {
        "vec": [NDArrayDecoder(), *tail],
        "label": [IntDecoder(), *tail],
    }


def _epoch_served(target: str, address: str) -> list[tuple[np.ndarray, np.ndarray]]:
    loader = ServedLoader(
        target, BATCH, pipelines=_pipelines(True), server=address, spawn=False, seed=3
    )
    try:
        return [(np.asarray(v).copy(), np.asarray(y).copy()) for v, y in loader]
    finally:
        loader.close()


def _epoch_in_process(path: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    loader = InProcessLoader(str(path), BATCH, pipelines=_pipelines(False), seed=3)
    return [(np.asarray(v).copy(), np.asarray(y).copy()) for v, y in loader]


def _same(a: list[tuple[np.ndarray, np.ndarray]], b: list[tuple[np.ndarray, np.ndarray]]) -> None:
    assert len(a) == len(b)
    for (va, ya), (vb, yb) in zip(a, b, strict=True):
        np.testing.assert_array_equal(va, vb)
        np.testing.assert_array_equal(ya.reshape(-1), yb.reshape(-1))


@pytest.fixture
def two_files(tmp_path: Path) -> tuple[Path, Path]:
    # Same schema, different sizes and values: train labels 0..63, val labels 1000..1023.
    return _write(tmp_path / "a" / "train.beton", 64, 0), _write(
        tmp_path / "a" / "val.beton", 24, 1000
    )


@pytest.mark.parametrize("share", [True, False], ids=["share", "no-share"])
@pytest.mark.parametrize("first", ["train", "val"])
def test_same_schema_datasets_each_get_their_own_samples(
    daemon_factory, two_files, first: str, share: bool
) -> None:
    train, val = two_files
    d = daemon_factory([train, val], args=() if share else ("--no-share",))
    expected = {"train": _epoch_in_process(train), "val": _epoch_in_process(val)}
    order = ["train", "val"] if first == "train" else ["val", "train"]
    for name in order:
        path = train if name == "train" else val
        # By path and by name: both resolve to the right file.
        for target in (str(path), name):
            got = _epoch_served(target, d.address)
            _same(got, expected[name])
    labels = {n: np.concatenate([y.reshape(-1) for _, y in expected[n]]) for n in expected}
    assert labels["train"].max() < 1000 <= labels["val"].min()  # the two really differ


def test_a_file_with_the_daemons_stem_elsewhere_is_never_served_in_its_place(
    daemon_factory, tmp_path: Path
) -> None:
    served = _write(tmp_path / "served" / "train.beton", 32, 0)
    other = _write(tmp_path / "other" / "train.beton", 32, 5000)  # same stem, same schema
    # A daemon that opens no other file refuses it, naming both paths.
    strict = daemon_factory([served], args=["--no-open-on-demand"])
    with pytest.raises(ClientSpecError) as info:
        ServedLoader(
            str(other), BATCH, pipelines=_pipelines(True), server=strict.address, spawn=False
        )
    msg = str(info.value)
    assert str(other) in msg and str(served) in msg, msg
    _same(_epoch_served(str(served), strict.address), _epoch_in_process(served))
    # By default the daemon's own user gets the file it named, opened on demand.
    d = daemon_factory([served], socket=str(Path(strict.socket).with_name("open.sock")))
    _same(_epoch_served(str(other), d.address), _epoch_in_process(other))
    _same(_epoch_served(str(served), d.address), _epoch_in_process(served))
    _same(_epoch_served("train", d.address), _epoch_in_process(served))  # the name: the first


def test_links_to_the_served_file_are_the_same_file(daemon_factory, tmp_path: Path) -> None:
    served = _write(tmp_path / "served" / "data.beton", 32, 7)
    hard = tmp_path / "elsewhere" / "renamed.beton"
    hard.parent.mkdir()
    os.link(served, hard)
    soft = tmp_path / "elsewhere" / "soft.beton"
    soft.symlink_to(served)
    d = daemon_factory([served])
    expected = _epoch_in_process(served)
    _same(_epoch_served(str(hard), d.address), expected)
    _same(_epoch_served(str(soft), d.address), expected)


def test_a_replaced_file_is_not_the_one_the_daemon_has_open(daemon_factory, tmp_path: Path) -> None:
    served = _write(tmp_path / "served" / "train.beton", 32, 0)
    strict = daemon_factory([served], args=["--no-open-on-demand"])
    d = daemon_factory([served], socket=str(Path(strict.socket).with_name("open.sock")))
    for daemon in (strict, d):
        _same(_epoch_served(str(served), daemon.address), _epoch_in_process(served))
    # Rewritten by rename (the safe way): both daemons still map the old inode.
    fresh = _write(tmp_path / "tmp" / "train.beton", 32, 9000)
    os.replace(fresh, served)
    with pytest.raises(ClientSpecError) as info:
        ServedLoader(
            str(served), BATCH, pipelines=_pipelines(True), server=strict.address, spawn=False
        )
    assert "another file" in str(info.value)
    # The other one opens the new file: the Loader gets what the path holds now, never the old.
    _same(_epoch_served(str(served), d.address), _epoch_in_process(served))


def test_file_identity_across_hosts_compares_size_and_fingerprint(tmp_path: Path) -> None:
    from beton_wire.file_identity import FileIdentity

    a = _write(tmp_path / "a" / "train.beton", 32, 0)
    copy = tmp_path / "copy" / "train.beton"
    copy.parent.mkdir()
    copy.write_bytes(a.read_bytes())
    other = _write(tmp_path / "b" / "train.beton", 32, 77)  # same schema and size, other values
    ia, ic, io = FileIdentity.of(a), FileIdentity.of(copy), FileIdentity.of(other)
    assert ia.size == io.size
    assert ia.same_file(FileIdentity.of(a), same_host=True)
    assert not ia.same_file(ic, same_host=True)  # a copy is another file on one host
    assert ia.same_file(ic, same_host=False)  # ... and the same data seen from another host
    assert not ia.same_file(io, same_host=False)


@pytest.mark.timeout(180)
def test_a_file_replaced_during_a_restart_is_refused_not_resumed(
    daemon_factory, tmp_path: Path
) -> None:
    """An operator regenerates the dataset (a new file renamed over the old one) and restarts the
    daemon while a trainer is mid-epoch. The trainer's Loader must not resume its epoch on the
    new file's samples: that would be another dataset's batches with no error."""
    import signal

    from beton_client import RetryPolicy

    n = 640  # 80 batches: more than the client's ring holds, so the new daemon serves some
    served = _write(tmp_path / "served" / "train.beton", n, 0)
    d1 = daemon_factory([served])
    policy = RetryPolicy(budget_s=30.0, initial_s=0.05, max_s=0.5, after_shutdown=True)
    loader = ServedLoader(
        str(served),
        BATCH,
        pipelines=_pipelines(True),
        server=d1.address,
        spawn=False,
        seed=3,
        reconnect=policy,
    )
    try:
        it = iter(loader)
        labels = [np.asarray(next(it)[1]).reshape(-1).copy() for _ in range(2)]
        assert all((x < n).all() for x in labels)
        d1.proc.send_signal(signal.SIGTERM)
        assert d1.proc.wait(30) == 0
        fresh = _write(tmp_path / "tmp" / "train.beton", n, 9000)
        os.replace(fresh, served)
        daemon_factory([served], socket=d1.socket)
        rest = []
        with pytest.raises(ClientSpecError, match="it was replaced") as info:
            for _, y in it:
                rest.append(np.asarray(y).reshape(-1).copy())
        # What was read after the restart came from the original file (batches the old daemon
        # had published), in order; the reconnect itself is refused, naming both files.
        got = np.concatenate([*labels, *rest])
        assert np.array_equal(got, np.arange(len(got))), got
        assert str(served) in str(info.value)
    finally:
        loader.close()
