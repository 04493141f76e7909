"""Conformance: ``custom_fields`` (a field class of the training script's own, type 255 in the
file) reads the same on every backend (issue 12 §3, issue 13 §3).

The daemon of this module has this tests directory on its ``PYTHONPATH``, so the class can be
imported by its module path (``conformance._custom_fields.TaggedInt``), as issue 13 §2 allows
for the training script's own code when the peer has the daemon's uid.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
from beton_serve.fields.decoders import IntDecoder, NDArrayDecoder
from beton_serve.transforms import ToTensor
from helpers.daemon import DaemonProcess
from helpers.labelled import write_labelled

from conformance._backends import (
    BACKENDS,
    assert_same_epochs,
    column,
    epochs,
    make_loader,
    module_daemon,
)
from conformance._custom_fields import TaggedInt, write_custom

pytestmark = pytest.mark.slow

N, BASE = 23, 500
TESTS_DIR = str(Path(__file__).resolve().parents[1])


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("conf-custom")
    return write_labelled(d / "plain.beton", 5, 0), write_custom(d / "custom.beton", N, BASE)


@contextmanager
def _tests_on_pythonpath() -> Iterator[None]:
    """``PYTHONPATH`` with this tests directory first, for a daemon started inside."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS_DIR, old) if p)
    try:
        yield
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


@pytest.fixture(scope="module")
def daemon(files: tuple[Path, Path]) -> Iterator[DaemonProcess]:
    with ExitStack() as stack:
        with _tests_on_pythonpath():
            # started with the plain file only: the custom one is opened on demand
            d = stack.enter_context(module_daemon([files[0]]))
        yield d


def pipes() -> dict[str, Any]:
    return {"vec": [NDArrayDecoder(), ToTensor()], "label": [IntDecoder(), ToTensor()]}


@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_field_class_reads_alike(
    files: tuple[Path, Path], daemon: DaemonProcess, backend: str
) -> None:
    custom = files[1]
    kw: dict[str, Any] = {
        "batch_size": 4,
        "order": "RANDOM",
        "seed": 9,
        "drop_last": False,
        "custom_fields": {"label": TaggedInt},
    }
    with make_loader("inproc", custom, pipes(), **kw) as ref:
        want = epochs(ref, 2)
    assert sorted(int(x) for x in column(want[0], 1).reshape(-1)) == list(range(BASE, BASE + N))
    with make_loader(backend, custom, pipes(), address=daemon.address, **kw) as ld:
        got = epochs(ld, 2)
    assert_same_epochs(got, want, f"{backend} vs in-process")
