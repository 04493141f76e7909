"""Shared test configuration.

* ``gpu`` tests are skipped, with a visible reason, when CUDA is not available.
* An autouse guard fails any test that leaves a ``beton-*`` segment in ``/dev/shm``, a live child
  process, or a running ``beton-*`` thread behind, or leaves this process's count of idle
  workspace bytes (``pipeline._plan``) unequal to what its free lists hold.
* The compile cache (issue 14) of the whole run, and of every daemon a test starts (they inherit
  the environment), is one fresh temporary directory: the suite never reads or writes the user's
  ``~/.cache/beton-serve``, and later tests reuse what earlier ones compiled. Tests of the cache
  itself point ``BETON_SERVE_CACHE_DIR`` elsewhere.
* ``BETON_SERVE_PREWARM=0`` unless set: the cold-compile helper processes run only in the
  tests of ``beton_serve._prewarm`` (tests/unit/test_prewarm.py), which turn them on.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

SHM = Path("/dev/shm")

_CACHE_DIR: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _CACHE_DIR
    # No parallel cold-compile helper processes (beton_serve._prewarm) outside the tests that
    # turn it on: a helper outlives the test that started it by a few seconds.
    os.environ.setdefault("BETON_SERVE_PREWARM", "0")
    if "BETON_SERVE_CACHE_DIR" not in os.environ:
        import tempfile

        _CACHE_DIR = tempfile.mkdtemp(prefix="beton-test-cache-")
        os.environ["BETON_SERVE_CACHE_DIR"] = _CACHE_DIR


def pytest_unconfigure(config: pytest.Config) -> None:
    if _CACHE_DIR is not None:
        import shutil

        shutil.rmtree(_CACHE_DIR, ignore_errors=True)
        os.environ.pop("BETON_SERVE_CACHE_DIR", None)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("gpu" in item.keywords for item in items) and not _cuda_available():
        skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def _segments() -> set[str]:
    if not SHM.is_dir():
        return set()
    return {p.name for p in SHM.iterdir() if p.name.startswith("beton-")}


def _segment_owner(name: str) -> int | None:
    """The PID embedded in a ``beton-<pid>-<purpose>-<n>`` segment name, if any."""
    parts = name.split("-")
    if len(parts) >= 2 and parts[1].isdigit():
        return int(parts[1])
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ours(name: str, pids: set[int]) -> bool:
    """Whether a new segment belongs to this test: made by us or our children, or orphaned.

    Segments of unrelated live processes (another test session on the same machine) are ignored
    and never unlinked.
    """
    owner = _segment_owner(name)
    if owner is None:
        return True
    return owner == os.getpid() or owner in pids or not _pid_alive(owner)


def _children() -> set[int]:
    """Live (non-zombie) direct children of this process, from /proc."""
    me = os.getpid()
    out: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...; comm may contain spaces, so split after the last ')'.
        rest = stat.rsplit(")", 1)[-1].split()
        if len(rest) >= 2 and int(rest[1]) == me and rest[0] != "Z":
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            # multiprocessing's resource tracker and forkserver live as long as the test session.
            if b"resource_tracker" in cmdline or b"forkserver" in cmdline:
                continue
            out.add(int(entry.name))
    return out


def _beton_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("beton-") and t.is_alive()}


@pytest.fixture(autouse=True)
def resource_guard(request: pytest.FixtureRequest):
    """Fail the test if it leaks shared memory, child processes or beton threads."""
    segs0, kids0, threads0 = _segments(), _children(), _beton_threads()
    seen_kids: set[int] = set()
    yield
    deadline = time.monotonic() + 3.0
    while True:
        kids = _children() - kids0
        seen_kids |= kids
        segs = {n for n in _segments() - segs0 if _ours(n, seen_kids)}
        threads = _beton_threads() - threads0
        if not (segs or kids or threads) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    problems = []
    if segs:
        problems.append(f"shared-memory segments left in /dev/shm: {sorted(segs)}")
        for name in segs:  # clean up so one leak does not fail every later test
            try:
                (SHM / name).unlink()
            except OSError:
                pass
    if kids:
        problems.append(f"child processes left running: {sorted(kids)}")
    if threads:
        problems.append(f"beton threads left running: {sorted(threads)}")
    plan_mod = sys.modules.get("beton_serve.pipeline._plan")
    if plan_mod is not None:  # only once a test used pipelines in this process
        sets = plan_mod._FREE_SETS
        with sets:
            listed = sum(ws.nbytes for v in sets.free.values() for ws in v)
            counted = sets.free_bytes
            sets.free_bytes = listed  # so that one miscount does not fail every later test
        if listed != counted:
            problems.append(
                f"idle workspace bytes counted {counted:,}, the free lists hold {listed:,}"
            )
    if problems:
        pytest.fail("resource leak: " + "; ".join(problems), pytrace=False)


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """The FFCV-written fixtures (copied from shared/fixtures/ffcv)."""
    return ROOT / "tests" / "data" / "ffcv"


@pytest.fixture
def restore_op_registry():
    """Plugins a test imports register ops in this process's default registry: remove them
    again at its end, so that later tests (test_registry lists the built-ins) see only the
    built-ins."""
    from beton_serve.pipeline.registry import default_registry

    reg = default_registry()
    with reg._lock:
        classes, lazy = dict(reg._classes), dict(reg._lazy)
    yield
    with reg._lock:
        reg._classes.clear()
        reg._classes.update(classes)
        reg._lazy.clear()
        reg._lazy.update(lazy)
