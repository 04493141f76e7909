"""Files opened on demand (``daemon._opener``), attacked from a peer that is not the daemon's user.

* A file the daemon's user opened on demand outside every data root stays closed to other
  peers: not found by name or by path, and not listed in their error messages.
* A path checked inside a data root but opened outside it (a directory swapped for a symlink
  between the check and the open) is refused: the check is made on where the mapped file is.
* A file replaced by rename while it is opened is never served under the other file's
  identity: reader, identity and watch are one file, or it is opened again.
* The files opened on demand are bounded: the idle ones are closed to make room, and when
  every one has a stream, another is refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from beton_serve.daemon import DatasetTable, EngineBackend, _datasets
from beton_serve.daemon._on_demand import FilePolicy
from beton_serve.daemon._opener import DatasetOpener
from beton_serve.errors import SpecError, UnknownDataset
from beton_wire.file_identity import FileIdentity
from helpers.labelled import write_labelled


class _Plans:
    """What the opener uses of ``PlanRegistry``: a compile thread and ``drop``."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(1)
        self.dropped: list[str] = []

    def on_compile_thread(self, fn: Any, *args: Any) -> asyncio.Future[Any]:
        return asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def drop(self, ds: Any) -> None:
        self.dropped.append(ds.name)

    def import_refusal(self, req: Any) -> str | None:
        return None


def _run(go: Any, table: DatasetTable, plans: _Plans) -> None:
    try:
        asyncio.run(go())
    finally:
        table.close()
        plans.pool.shutdown()


def _req(path: Path | None = None, *, owner: bool, dataset: str = "") -> Any:
    f = FileIdentity.of(path) if path is not None else None
    return SimpleNamespace(
        custom_fields=(), file=f, dataset=dataset or (path.stem if path else ""), owner_peer=owner
    )


@pytest.fixture
def tree(tmp_path: Path) -> SimpleNamespace:
    root = tmp_path / "root"
    t = SimpleNamespace(
        tmp=tmp_path,
        root=root,
        public=write_labelled(root / "public.beton", 8, 0),
        inside=write_labelled(root / "k" / "sub" / "x.beton", 8, 100),
        secret=write_labelled(tmp_path / "private" / "secret.beton", 8, 7000),
        outside=write_labelled(tmp_path / "out" / "x.beton", 8, 9000),
    )
    return t


def _opener(tree: SimpleNamespace, **policy: Any) -> tuple[DatasetOpener, DatasetTable, _Plans]:
    table = DatasetTable({"public": [str(tree.public)]}, EngineBackend())
    plans = _Plans()
    files = FilePolicy(enabled=True, data_roots=(os.path.realpath(tree.root),), **policy)
    return DatasetOpener(table, EngineBackend(), files, plans), table, plans  # type: ignore[arg-type]


def test_a_file_the_owner_opened_stays_closed_to_other_peers(tree: SimpleNamespace) -> None:
    opener, table, plans = _opener(tree)

    async def go() -> None:
        with pytest.raises(SpecError, match="outside this daemon's data roots"):
            await opener.dataset_for(_req(tree.secret, owner=False), same_host=True)
        secret = await opener.dataset_for(_req(tree.secret, owner=True), same_host=True)
        assert secret.name == "secret" and not secret.open_to_all
        # By name and by path: refused as before, and not listed.
        with pytest.raises(UnknownDataset) as by_name:
            await opener.dataset_for(_req(owner=False, dataset="secret"), same_host=True)
        assert "secret" not in str(by_name.value).replace("'secret';", "")
        assert str(by_name.value).endswith("this daemon serves ['public']")
        with pytest.raises(SpecError, match="outside this daemon's data roots") as by_path:
            await opener.dataset_for(_req(tree.secret, owner=False), same_host=True)
        assert str(by_path.value).split("it serves ")[1].startswith("'public': ")
        served = str(by_path.value).split("it serves ")[1].split(". Serve the file")[0]
        assert "secret" not in served
        # The owner still gets it by name; a file under a root is served to everyone.
        assert await opener.dataset_for(_req(owner=True, dataset="secret"), True) is secret
        inside = await opener.dataset_for(_req(tree.inside, owner=False), same_host=True)
        assert await opener.dataset_for(_req(owner=False, dataset="x"), True) is inside

    _run(go, table, plans)


def test_a_directory_swapped_for_a_symlink_while_opening_is_refused(
    tree: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    opener, table, plans = _opener(tree)
    sub = tree.inside.parent
    real_open = opener._open_sync

    def swap_then_open(*args: Any) -> Any:  # between the check and the open
        sub.rename(sub.with_name("sub-real"))
        sub.symlink_to(tree.outside.parent)
        return real_open(*args)

    monkeypatch.setattr(opener, "_open_sync", swap_then_open)

    async def go() -> None:
        with pytest.raises(SpecError) as info:
            await opener.dataset_for(_req(tree.inside, owner=False), same_host=True)
        # Refused: the file it named was replaced, or it lies outside the roots; never served.
        assert "replaced" in str(info.value) or "outside" in str(info.value)
        # Not findable by name either (it was the file outside).
        with pytest.raises(UnknownDataset):
            await opener.dataset_for(_req(owner=False, dataset="x"), same_host=True)

    _run(go, table, plans)


def test_the_mapped_file_decides_not_the_path_that_was_checked(tree: SimpleNamespace) -> None:
    """Whatever the check of the named path said (here: a policy whose path check admits
    everything, as a check raced by a swap would), the file the daemon mapped lies outside the
    roots, and that refuses it; the client named that very file, so no identity check helps."""
    opener, table, plans = _opener(tree)
    real_policy = opener.files
    opener.files = SimpleNamespace(  # type: ignore[assignment]
        refusal=lambda f, owner_peer: None,
        serve_refusal=real_policy.serve_refusal,
        max_open=real_policy.max_open,
    )
    sub = tree.inside.parent
    sub.rename(sub.with_name("sub-real"))
    sub.symlink_to(tree.outside.parent)
    named = dataclasses.replace(FileIdentity.of(tree.outside), path=str(sub / "x.beton"))

    async def go() -> None:
        req = SimpleNamespace(custom_fields=(), file=named, dataset="x", owner_peer=False)
        with pytest.raises(SpecError, match="outside this daemon's data roots"):
            await opener.dataset_for(req, same_host=True)
        with pytest.raises(UnknownDataset):  # adopted for its owner, hidden from this peer
            await opener.dataset_for(_req(owner=False, dataset="x"), same_host=True)

    _run(go, table, plans)


def test_a_file_replaced_while_opened_is_opened_again(
    tree: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader and the watch each open the path: a rename between them made the dataset
    describe and map one file and watch another, and the wrong file was served under the named
    one. (The dataset's identity is the reader's own, so it always names the mapped file.)"""
    import shutil

    table = DatasetTable({"public": [str(tree.public)]}, EngineBackend())
    real_watch = _datasets.FileWatch
    calls = {"n": 0}

    def rename_over(path: Path) -> None:
        fresh = tree.tmp / f"fresh{calls['n']}.beton"
        shutil.copy(tree.outside, fresh)
        os.replace(fresh, path)  # a new inode at the path, after the reader mapped the old one

    def renamed_once(paths: list[str]) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            rename_over(tree.inside)
        return real_watch(paths)

    monkeypatch.setattr(_datasets, "FileWatch", renamed_once)
    try:
        ds = table.open_file(str(tree.inside))
        try:
            assert calls["n"] == 2  # opened again
            st = os.stat(tree.inside)
            assert (ds.files[0].device, ds.files[0].inode) == (st.st_dev, st.st_ino)
            assert tuple(ds.readers[0].identity) == (
                ds.files[0].device,
                ds.files[0].inode,
                ds.files[0].size,
                ds.files[0].mtime_ns,
            )
            assert ds.files[0].fingerprint == FileIdentity.of(tree.outside).fingerprint
        finally:
            table.remove(ds)

        def renamed_every_time(paths: list[str]) -> Any:
            calls["n"] += 1
            rename_over(tree.inside)
            return real_watch(paths)

        monkeypatch.setattr(_datasets, "FileWatch", renamed_every_time)
        with pytest.raises(SpecError, match="kept being replaced"):
            table.open_file(str(tree.inside))
    finally:
        table.close()


def test_files_opened_on_demand_are_bounded(
    tree: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    from beton_serve.daemon import _opener as opener_module

    opener, table, plans = _opener(tree, max_open=2)
    files = [write_labelled(tree.root / "many" / f"v{i}.beton", 4, 10 * i) for i in range(4)]
    busy: set[int] = set()
    opener.busy = lambda: busy

    async def go() -> None:
        a = await opener.dataset_for(_req(files[0], owner=False), True)
        b = await opener.dataset_for(_req(files[1], owner=False), True)
        # Handed out a moment ago (its stream may not be registered yet): not closed.
        with pytest.raises(SpecError, match=r"already has 2 files opened on demand"):
            await opener.dataset_for(_req(files[2], owner=False), True)
        monkeypatch.setattr(opener_module, "HANDOUT_GRACE_S", 0.0)
        busy.add(id(b))
        c = await opener.dataset_for(_req(files[2], owner=False), True)  # a closes (idle)
        names = {d.name for d in table}  # type: ignore[attr-defined]
        assert names == {"public", b.name, c.name} and a.name in plans.dropped
        busy.add(id(c))
        with pytest.raises(SpecError, match=r"already has 2 files opened on demand"):
            await opener.dataset_for(_req(files[3], owner=False), True)

    _run(go, table, plans)


def test_an_on_demand_name_stays_with_its_files(tree: SimpleNamespace) -> None:
    """``ds@2`` closed when idle went to the next file with that stem, which also took the
    first file's counters: metrics mixed two files under one name (found by an audit)."""
    opener, table, plans = _opener(tree)
    a = write_labelled(tree.root / "a" / "ds.beton", 4, 0)
    b = write_labelled(tree.root / "b" / "ds.beton", 4, 100)
    c = write_labelled(tree.root / "c" / "ds.beton", 4, 200)

    async def go() -> None:
        first = await opener.dataset_for(_req(a, owner=False), True)
        second = await opener.dataset_for(_req(b, owner=False), True)
        assert (first.name, second.name) == ("ds", "ds@2")
        second.count(batches=5, samples=2000)
        opener._close(second, "for the test")
        third = await opener.dataset_for(_req(c, owner=False), True)
        assert third.name == "ds@3" and third.counts()[0] == 0  # not b's name, nor its counts
        again = await opener.dataset_for(_req(b, owner=False), True)
        assert again.name == "ds@2" and again.counts()[:2] == (2000, 5)  # b's, going on

    _run(go, table, plans)


def test_a_data_root_that_is_not_a_directory_is_logged_and_works_once_made(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A typo'd or not-yet-mounted ``data_root`` was accepted in silence; every other user's
    open was then refused with no hint why. Now it is logged at start, kept, and honoured once
    the directory exists."""
    later, afile = tmp_path / "mnt" / "data", tmp_path / "plain.txt"
    afile.write_text("x")
    present = tmp_path / "present"
    present.mkdir()
    with caplog.at_level("WARNING", logger="beton_serve.daemon._on_demand"):
        policy = FilePolicy.build(
            enabled=True, data_roots=[str(later), str(afile), str(present)], idle_close_s=1
        )
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2, warned
    assert str(later) in warned[0] and "does not exist" in warned[0]
    assert str(afile) in warned[1] and "is not a directory" in warned[1]
    later.mkdir(parents=True)
    data = write_labelled(later / "d.beton", 3, 0)
    assert policy.refusal(FileIdentity.of(str(data)), owner_peer=False) is None
