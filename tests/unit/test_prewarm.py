"""The parallel cold compile (``beton_serve._prewarm``, issue 14 §2).

On an empty compile cache a crop decoder starts a helper process that compiles the area resize
(and the counter RNG's draws, the TurboJPEG batch kernel) into the cache
while this process compiles its own sampler, the upscale and the ops after the decoder; the
in-process Loader starts the helper before it opens its file. Checked here in fresh
processes (the test process has its kernels compiled already): the helper really writes the
entries the decoders then load, the Loader's batches are the same bytes as without it, and
every failure of the helper (non-zero exit, a hang, no helper at all) leaves the process
compiling by itself. The test session runs with ``BETON_SERVE_PREWARM=0`` (conftest); these
tests turn it on in their own processes.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from beton_serve import _prewarm
from beton_serve.errors import FormatError
from beton_serve.fields import IntField, RGBImageField
from beton_serve.fields.decoders import (
    CenterCropRGBImageDecoder,
    IntDecoder,
    RandomResizedCropRGBImageDecoder,
)
from beton_serve.loader import Loader
from beton_serve.transforms import RandomHorizontalFlip
from beton_serve.writer import DatasetWriter
from helpers.child import child_env, run_json

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


class _Images:
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        rng = np.random.default_rng(i)
        return rng.integers(0, 256, size=(60 + 3 * i, 70 + 2 * i, 3), dtype=np.uint8), i


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prewarm") / "img.beton"
    DatasetWriter(
        str(path), {"image": RGBImageField(write_mode="jpg"), "label": IntField()}
    ).from_indexed_dataset(_Images())
    return path


def _env(cache: Path, prewarm: str = "1") -> dict[str, str]:
    return child_env(BETON_SERVE_CACHE_DIR=str(cache), BETON_SERVE_PREWARM=prewarm)


_LOADER_SCRIPT = r"""
import json, sys
import numpy as np
from beton_serve import _prewarm
from beton_serve._kernels import crop, resize
from beton_serve.fields.decoders import (CenterCropRGBImageDecoder, IntDecoder,
                                         RandomResizedCropRGBImageDecoder)
from beton_serve.loader import Loader
from beton_serve.transforms import RandomHorizontalFlip
path, out = sys.argv[1], sys.argv[2]
ahead, _ahead = [], _prewarm.ahead
_prewarm.ahead = lambda fn: ahead.append(_ahead(fn)) or ahead[-1]
arrays = {}
for name, dec in (("rrc", RandomResizedCropRGBImageDecoder((24, 24))),
                  ("center", CenterCropRGBImageDecoder((24, 24), 0.875))):
    with Loader(path, batch_size=4, num_workers=2, seed=5,
                pipelines={"image": [dec, RandomHorizontalFlip()], "label": [IntDecoder()]}) as ld:
        for b, (img, label) in enumerate(ld):
            arrays[f"{name}{b}"] = np.array(img)
            arrays[f"{name}{b}_label"] = np.array(label)
np.savez(out, **arrays)
joined = _prewarm.join(120)
from beton_serve import _tj3
from beton_serve.pipeline.compile_cache import default_store, entry_key
try:
    kernel, args = _tj3._kernel_and_args(_tj3.load())
    kernel_entry = default_store().has(entry_key(kernel, args))
except Exception:
    kernel_entry = None  # no TurboJPEG 3 here
print(json.dumps({
    "joined": joined,
    "kernel_entry": kernel_entry,
    "rrc_hits": sum(crop.rrc_batch._cache_hits.values()),
    "rrc_misses": sum(crop.rrc_batch._cache_misses.values()),
    "center_hits": sum(crop.center_crop_batch._cache_hits.values()),
    "center_misses": sum(crop.center_crop_batch._cache_misses.values()),
    "resize_hits": sum(resize.area_resize._cache_hits.values()),
    "resize_misses": sum(resize.area_resize._cache_misses.values()),
    "resize_compiled": len(resize.area_resize.overloads),
    "ahead": ahead,
}))
"""


def _run_loader(data: Path, cache: Path, out: Path, prewarm: str) -> dict[str, Any]:
    return run_json(_LOADER_SCRIPT, str(data), str(out), env=_env(cache, prewarm))  # type: ignore[no-any-return]


def _reference(data: Path) -> dict[str, np.ndarray]:
    arrays = {}
    for name, dec in (
        ("rrc", RandomResizedCropRGBImageDecoder((24, 24))),
        ("center", CenterCropRGBImageDecoder((24, 24), 0.875)),
    ):
        with Loader(
            str(data),
            batch_size=4,
            num_workers=2,
            seed=5,
            pipelines={"image": [dec, RandomHorizontalFlip()], "label": [IntDecoder()]},
        ) as ld:
            for b, (img, label) in enumerate(ld):
                arrays[f"{name}{b}"] = np.array(img)
                arrays[f"{name}{b}_label"] = np.array(label)
    return arrays


def test_cold_cache_loader_takes_the_resize_from_the_helper_and_matches(
    data: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cc"
    stats = _run_loader(data, cache, tmp_path / "a.npz", "1")
    assert stats["joined"]
    # the helper compiled the area resize into the cache; this process only loaded it
    assert stats["resize_hits"] == 1 and stats["resize_misses"] == 0, stats
    assert stats["resize_compiled"] >= 1
    # each Loader's own sampler was compiled here (no helper has it)
    assert stats["rrc_hits"] == 0 and stats["rrc_misses"] == 1, stats
    assert stats["center_hits"] == 0 and stats["center_misses"] == 1, stats
    # the first plan's flip and label decoder compiled while the crop kernels did (the
    # second Loader's may find nothing under way any more)
    assert stats["ahead"][0] is True, stats
    assert (cache / "prewarm.lock").exists()
    # the helper also compiled the TurboJPEG batch kernel into the cache (when there is one)
    assert stats["kernel_entry"] in (True, None), stats
    got = dict(np.load(tmp_path / "a.npz"))
    ref = _reference(data)
    assert set(got) == set(ref) and len(ref) == 8  # 2 pipelines x 2 batches x (image, label)
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)

    # a warm cache: nothing is started, everything is loaded, the same bytes again
    stats2 = _run_loader(data, cache, tmp_path / "b.npz", "1")
    assert stats2["rrc_hits"] == 1 and stats2["rrc_misses"] == 0
    assert stats2["center_hits"] == 1 and stats2["center_misses"] == 0
    assert stats2["resize_misses"] == 0  # (called at all only without the batch kernel)
    assert stats2["ahead"] == [False, False]  # warm: nothing compiles ahead
    again = dict(np.load(tmp_path / "b.npz"))
    for k in ref:
        np.testing.assert_array_equal(again[k], ref[k], err_msg=k)


def test_prewarm_off_compiles_everything_here(data: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cc"
    stats = _run_loader(data, cache, tmp_path / "a.npz", "0")
    assert stats["rrc_hits"] == 0 and stats["rrc_misses"] == 1, stats
    assert not (cache / "prewarm.lock").exists()


def test_two_helpers_at_once_both_finish(tmp_path: Path) -> None:
    cache = tmp_path / "cc"
    cmd = [sys.executable, "-m", "beton_serve._prewarm", "resize"]
    procs = [
        subprocess.Popen(cmd, env=_env(cache, "0"), stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert all("done resize" in o for o in outs), outs
    assert list((cache / "kernels").glob("*.nbk"))


def test_unknown_group_and_unusable_cache_are_refused(tmp_path: Path) -> None:
    bad = subprocess.run(
        [sys.executable, "-m", "beton_serve._prewarm", "nope"],
        env=_env(tmp_path / "cc", "0"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "unknown group" in bad.stdout
    foreign = tmp_path / "file"
    foreign.write_text("not a directory")
    refused = subprocess.run(
        [sys.executable, "-m", "beton_serve._prewarm", "resize"],
        env=_env(foreign, "0"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "cannot be used" in refused.stdout


@pytest.mark.parametrize("sampler", ["rrc", "center"])
@pytest.mark.parametrize("tj3", [True, False])
def test_the_lanes_split_every_kernel_once(sampler: str, tj3: bool) -> None:
    helper, local = _prewarm.lanes(sampler, tj3)
    assert not set(helper) & set(local)
    other = {"rrc", "center"} - {sampler}  # left to its own first use
    assert set(helper) | set(local) == set(_prewarm.GROUPS) - other - (set() if tj3 else {"tj3"})
    assert sampler in local and "resize" in helper  # the decoder loads "resize" only
    # what a first batch waits for comes first, at full priority; the rest after it
    fg = [g in _prewarm.FOREGROUND for g in helper]
    assert fg == sorted(fg, reverse=True) and fg[0]


@pytest.mark.parametrize("cls", [RandomResizedCropRGBImageDecoder, CenterCropRGBImageDecoder])
def test_a_shared_decode_never_asks_for_the_batch_kernel(cls: Any) -> None:
    """The TurboJPEG batch kernel runs only in a decoder's own loop: with ``share_decode`` the
    group decodes, and neither the early helper nor the decoder's own start may compile it."""
    from beton_serve.jpeg import resolve_backend

    if resolve_backend("auto") != "tj3":
        pytest.skip("no TurboJPEG 3 here")
    args = ((24, 24),) if cls is RandomResizedCropRGBImageDecoder else ((24, 24), 0.875)
    own = cls(*args, jpeg_backend="tj3")
    shared = cls(*args, jpeg_backend="tj3", share_decode=True)
    assert "tj3" in own._prewarm_lanes()[0]
    assert shared._prewarm_lanes() == (
        tuple(g for g in own._prewarm_lanes()[0] if g != "tj3"),
        own._prewarm_lanes()[1],
    )


def test_the_loader_starts_the_helper_before_opening_its_file(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from beton_serve.format import _reader

    events: list[Any] = []
    monkeypatch.setattr(_prewarm, "spawn_early", lambda helper: events.append(tuple(helper)))
    opened = _reader.BetonReader.__init__

    def open_(self: Any, *a: Any, **k: Any) -> None:
        events.append("open")
        opened(self, *a, **k)

    monkeypatch.setattr(_reader.BetonReader, "__init__", open_)
    rrc = RandomResizedCropRGBImageDecoder((24, 24))
    pipes = {"image": [rrc, RandomHorizontalFlip()], "label": [IntDecoder()]}
    with Loader(str(data), batch_size=4, num_workers=1, pipelines=pipes):
        pass
    helper, _ = rrc._prewarm_lanes()
    assert events == [helper, "open"]

    # no crop decoder, or no such file: nothing is started (a typo costs nothing at exit)
    events.clear()
    with Loader(str(data), batch_size=4, num_workers=1, pipelines={"label": [IntDecoder()]}):
        pass
    assert events == ["open"]
    events.clear()
    with pytest.raises(FormatError, match="No such file"):
        Loader(str(tmp_path / "missing.beton"), batch_size=4, pipelines=pipes)
    assert events == ["open"]


def test_the_helper_lowers_its_priority_once_for_background_groups() -> None:
    code = (
        "import os\n"
        "from beton_serve import _prewarm\n"
        "before = os.nice(0)\n"
        "_prewarm._background(); _prewarm._background()\n"
        "print(os.nice(0) - before)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert int(out.stdout) == min(_prewarm.BACKGROUND_NICE, 19 - os.nice(0))


def test_a_helper_with_only_background_groups_yields_from_its_start(tmp_path: Path) -> None:
    # "tj3" first waits (up to 30 s) for the resize and upscale entries an empty cache lacks
    helper = subprocess.Popen(
        [sys.executable, "-m", "beton_serve._prewarm", "tj3"],
        env=_env(tmp_path / "cc", "0"),
        stdout=subprocess.DEVNULL,
    )
    try:
        want = min(os.nice(0) + _prewarm.BACKGROUND_NICE, 19)
        deadline = time.monotonic() + 30
        nice = None
        while time.monotonic() < deadline and nice != want:
            with open(f"/proc/{helper.pid}/stat") as f:
                nice = int(f.read().rsplit(")", 1)[1].split()[16])
            time.sleep(0.02)
        assert nice == want
    finally:
        helper.kill()
        helper.wait(10)


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("BETON_SERVE_CACHE_DIR", str(tmp_path / "cc"))
    _prewarm._reset_for_tests()
    yield
    _prewarm._at_exit()  # stop a helper a test left running
    _prewarm._reset_for_tests()


def test_a_failing_helper_releases_the_waiters_and_is_logged(
    fresh: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(
        _prewarm, "_command", lambda groups: [sys.executable, "-c", "print('boom'); exit(3)"]
    )
    with caplog.at_level(logging.WARNING, logger="beton_serve.prewarm"):
        _prewarm._spawn(["resize"], tmp_path)
        t0 = time.monotonic()
        _prewarm.wait("resize", timeout=30)
        assert time.monotonic() - t0 < 20
        assert _prewarm.join(30)
        deadline = time.monotonic() + 10
        while "exited with 3" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    assert "exited with 3" in caplog.text and "boom" in caplog.text


def test_a_hung_helper_costs_at_most_the_wait_timeout(
    fresh: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(
        _prewarm, "_command", lambda groups: [sys.executable, "-c", "import time; time.sleep(60)"]
    )
    _prewarm._spawn(["resize"], tmp_path)
    with caplog.at_level(logging.WARNING, logger="beton_serve.prewarm"):
        t0 = time.monotonic()
        _prewarm.wait("resize", timeout=0.5)
        waited = time.monotonic() - t0
    assert 0.4 < waited < 10
    assert "did not finish" in caplog.text
    t0 = time.monotonic()
    _prewarm.wait("resize", timeout=30)  # given up once: later callers do not wait again
    assert time.monotonic() - t0 < 0.5
    _prewarm._at_exit()  # what the interpreter's exit does: a helper given up on is stopped
    assert _prewarm.join(10)


def test_no_interpreter_means_no_helper_and_no_wait(
    fresh: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_prewarm, "_command", lambda groups: ["/nonexistent/python"])
    _prewarm._spawn(["resize"], tmp_path)
    t0 = time.monotonic()
    _prewarm.wait("resize", timeout=30)
    assert time.monotonic() - t0 < 0.5


def test_start_does_nothing_when_off_or_without_a_cache(
    fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BETON_SERVE_PREWARM", "0")
    _prewarm.start()
    assert not _prewarm._started and not _prewarm._pending
    monkeypatch.setenv("BETON_SERVE_PREWARM", "1")
    monkeypatch.setenv("BETON_SERVE_CACHE_DIR", "off")
    _prewarm.start()
    assert not _prewarm._pending


_ORPHAN_PARENT = r"""
import sys, time
from beton_serve import _prewarm
_prewarm._spawn(["tj3"], _prewarm.Path(sys.argv[1]))  # tj3 waits up to 30 s for entries
print(_prewarm._procs[0].pid, flush=True)
time.sleep(120)
"""


def test_the_helper_exits_when_the_process_that_started_it_is_killed(tmp_path: Path) -> None:
    # SIGKILL runs no atexit hook: the helper notices its parent is gone by itself
    cache = tmp_path / "cc"
    parent = _parent(_ORPHAN_PARENT, cache)
    try:
        assert parent.stdout is not None
        helper = int(parent.stdout.readline())
        time.sleep(1.5)  # the helper is up, waiting for the resize entries nobody writes
        assert _alive(helper)
    finally:
        parent.kill()
        parent.wait(10)
    assert _exited(helper, 5), "the helper outlived its killed parent"


_COMPILING_PARENT = r"""
import sys, time
from beton_serve import _prewarm

def watch(proc, events):  # the real watcher, telling the test when the helper compiles
    for raw in proc.stdout:
        if raw.startswith(b"compiling resize"):
            print("COMPILING", flush=True)

_prewarm._watch = watch
_prewarm._spawn(["resize"], _prewarm.Path(sys.argv[1]))
print(_prewarm._procs[0].pid, flush=True)
time.sleep(120)
"""


def test_a_helper_compiling_when_its_parent_dies_finishes_that_group_and_exits(
    tmp_path: Path,
) -> None:
    # A trainer that exits (or is killed) right after its first batch: the group the helper is
    # compiling still reaches the cache, so the next process does not compile it again.
    cache = tmp_path / "cc"
    parent = _parent(_COMPILING_PARENT, cache)
    try:
        assert parent.stdout is not None
        helper = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "COMPILING"
    finally:
        parent.kill()
        parent.wait(10)
    assert _exited(helper, 120), "the helper did not exit after its group"
    code = (
        "from beton_serve import _prewarm\n"
        "from beton_serve.pipeline.compile_cache import default_store\n"
        "print(_prewarm._missing(_prewarm._resize_calls(), default_store()))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=_env(cache, "0"),
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert out.stdout.strip() == "False", "the group's entries are not in the cache"


def _parent(script: str, cache: Path) -> subprocess.Popen[str]:
    """A process running ``script`` (which spawns a helper) over a new cache ``cache``."""
    cache.mkdir(mode=0o700)
    return subprocess.Popen(
        [sys.executable, "-c", script, str(cache)],
        env=_env(cache, "0"),
        stdout=subprocess.PIPE,
        text=True,
    )


def _exited(pid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` s for ``pid`` to exit; kill it if it does not (the test stops what
    it started, even when failing)."""
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
        return False
    return True


def _alive(pid: int) -> bool:
    # the helper is re-parented to a reaper that collects it: gone, or a zombie, means exited
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
