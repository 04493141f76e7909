"""torch, imported the first time off the calling thread's stack (:func:`import_torch`)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from types import ModuleType
from typing import Any

#: Where the import system's own frames come from (CPython's frozen importlib).
_BOOTSTRAP = "<frozen importlib._bootstrap>"


def import_torch() -> ModuleType:
    """``torch``, as ``import torch`` gives it.

    The first import of a process runs on a short-lived thread, which this one waits for. Why:
    importing torch (2.13 measured) leaves reference cycles through frames of its import, and
    each frame keeps the frame that called it, up the importing thread's stack. Imported from a
    Loader's construction, it kept that Loader, its engine and its batch buffers alive after
    ``close()`` until the next garbage collection (session 59, ``tests/unit/test_torch_import.py``).
    On a thread of its own, the import's frames end at that thread's.

    A thread that is itself importing a module (a Loader built at a module's top level) imports
    torch here, as before: torch importing that module in turn on another thread would wait for
    this one, which waits for it.

    Raises:
        ImportError: torch is not installed (or fails to import).
    """
    mod = sys.modules.get("torch")
    if mod is not None:
        return mod
    if _importing():
        import torch

        return torch
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(importlib.import_module("torch"))
        except BaseException as exc:  # handed to the caller, raised there
            box.append(exc)

    thread = threading.Thread(target=run, name="beton-import-torch", daemon=True)
    thread.start()
    thread.join()
    got = box.pop()
    if isinstance(got, BaseException):
        try:
            raise got
        finally:
            got = None  # no cycle through this frame and the error's traceback
    return got  # type: ignore[no-any-return]


def torch_if_installed() -> ModuleType | None:
    """``torch`` through :func:`import_torch`, or ``None`` when it is not installed.

    Raises:
        ImportError: torch is installed but fails to import.
    """
    if "torch" not in sys.modules and importlib.util.find_spec("torch") is None:
        return None
    return import_torch()


def _importing() -> bool:
    """Whether the calling thread is in the middle of importing a module."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename == _BOOTSTRAP and frame.f_code.co_name == "_find_and_load":
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False
