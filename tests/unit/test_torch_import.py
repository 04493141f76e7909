# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""The first ``import torch`` of a process leaves no Loader behind (``beton_client._torch``).

Importing torch leaves reference cycles through frames of its import, and each frame keeps the
frame that called it. When a Loader's construction was what imported torch, the Loader stayed
alive after ``close()`` until the next garbage collection. The Loaders now import torch on a
short-lived thread first. Checked in a fresh interpreter (torch not imported yet), with the
collector off, for the in-process and the served Loader.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from beton_client import _torch
from helpers.daemon import daemon_factory, short_tmp  # noqa: F401

pytestmark = pytest.mark.timeout(120)

_FIRST_LOADER = textwrap.dedent(
    """
    import gc, sys, weakref
    sys.path.insert(0, {tests!r})
    gc.disable()
    from helpers.served_epochs import rrc_pipelines
    assert "torch" not in sys.modules
    if {address!r}:
        from beton_client import Loader
        ld = Loader("images_jpg", pipelines=rrc_pipelines(32), batch_size=4, server={address!r})
    else:
        from beton_serve.loader import Loader
        ld = Loader({beton!r}, pipelines=rrc_pipelines(32), batch_size=4, num_workers=1)
    n = 0
    for image, label in ld:
        n += 1
        if n == 2:
            break
    shape = tuple(image.shape)
    del image, label
    ld.close()
    ref = weakref.ref(ld)
    del ld
    print("torch" in sys.modules, shape, ref() is None)
    """
)


def _first_loader(beton: Path, address: str = "") -> str:
    tests = str(Path(__file__).resolve().parents[1])
    code = _FIRST_LOADER.format(tests=tests, address=address, beton=str(beton))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=100, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


@pytest.mark.slow
def test_the_first_in_process_loader_is_freed_by_reference_counting(fixtures_dir: Path) -> None:
    # Before: "True (4, 32, 32, 3) False" (the frames of torch's import held the Loader)
    assert _first_loader(fixtures_dir / "images_jpg.beton") == "True (4, 32, 32, 3) True"


@pytest.mark.slow
def test_the_first_served_loader_is_freed_by_reference_counting(
    daemon_factory, fixtures_dir: Path
) -> None:
    d = daemon_factory([fixtures_dir / "images_jpg.beton"], args=["--workers", "1"])
    got = _first_loader(fixtures_dir / "images_jpg.beton", address=d.address)
    assert got == "True (4, 32, 32, 3) True"


def test_a_thread_importing_a_module_imports_torch_in_place(tmp_path: Path) -> None:
    # A Loader built at a module's top level: torch must not be imported on another thread,
    # which would wait for the module this thread is importing if torch imported it in turn.
    (tmp_path / "bs_mid_import.py").write_text(
        "from beton_client import _torch\nDURING = _torch._importing()\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        import bs_mid_import  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("bs_mid_import", None)
    assert bs_mid_import.DURING is True
    assert _torch._importing() is False


def test_a_failed_import_reaches_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    threads: list[str] = []

    def import_module(name: str) -> None:
        import threading

        threads.append(threading.current_thread().name)
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(_torch.importlib, "import_module", import_module)
    with pytest.raises(ImportError, match="No module named 'torch'"):
        _torch.import_torch()
    assert threads == ["beton-import-torch"]  # imported off the caller's stack
