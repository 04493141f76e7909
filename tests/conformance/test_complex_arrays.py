"""Complex ``NDArrayField`` s served: FFCV reads any numpy dtype an ``NDArrayField`` holds, and
``complex64`` / ``complex128`` arrays were refused by the served Loader ("the wire cannot carry").
They now travel on every transport, bit for bit as the in-process Loader reads them (NaN
payloads and -0.0 in either part included), as numpy arrays or through ``ToTensor``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers.daemon import DaemonProcess

from conformance._backends import (
    BACKENDS,
    SERVED,
    assert_same_epochs,
    epochs,
    make_loader,
    module_daemon,
)

pytestmark = pytest.mark.timeout(120)

N = 23


def _values() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(11)
    c64 = (rng.standard_normal((N, 3)) + 1j * rng.standard_normal((N, 3))).astype(np.complex64)
    c128 = rng.standard_normal((N, 2, 2)) + 1j * rng.standard_normal((N, 2, 2))
    c64[0, 0] = complex(-0.0, np.nan)
    c128[1, 0, 1] = complex(np.inf, -0.0)
    return c64, c128


@pytest.fixture(scope="module")
def beton(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from beton_serve.fields import IntField, NDArrayField
    from beton_serve.writer import DatasetWriter

    c64, c128 = _values()
    out = tmp_path_factory.mktemp("complex") / "complex.beton"
    DatasetWriter(
        out,
        {
            "c64": NDArrayField(np.dtype("complex64"), (3,)),
            "c128": NDArrayField(np.dtype("complex128"), (2, 2)),
            "label": IntField(),
        },
    ).from_indexed_dataset([(c64[i], c128[i], i) for i in range(N)])
    return out


@pytest.fixture(scope="module")
def daemon(beton: Path) -> Iterator[DaemonProcess]:
    with module_daemon([beton]) as d:
        yield d


def _pipes(to_tensor: bool) -> dict:
    from beton_serve.fields.decoders import IntDecoder, NDArrayDecoder
    from beton_serve.transforms import ToTensor

    tail = [ToTensor()] if to_tensor else []
    return {
        "c64": [NDArrayDecoder(), *tail],
        "c128": [NDArrayDecoder(), *tail],
        "label": [IntDecoder(), *tail],
    }


@pytest.mark.parametrize("to_tensor", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_complex_arrays_read_as_written(
    beton: Path, daemon: DaemonProcess, backend: str, to_tensor: bool
) -> None:
    c64, c128 = _values()
    with make_loader(
        backend, beton, _pipes(to_tensor), address=daemon.address, batch_size=5, drop_last=False
    ) as ld:
        batches = [tuple(np.asarray(x).copy() for x in b) for b in ld]
    got64 = np.concatenate([b[0] for b in batches])
    got128 = np.concatenate([b[1] for b in batches])
    labels = np.concatenate([b[2] for b in batches]).reshape(-1)
    assert labels.tolist() == list(range(N))
    assert got64.dtype == np.complex64 and got64.shape == (N, 3)
    assert got128.dtype == np.complex128 and got128.shape == (N, 2, 2)
    assert got64.tobytes() == c64.tobytes()
    assert got128.tobytes() == c128.tobytes()


@pytest.mark.parametrize("backend", SERVED)
def test_served_equals_in_process_over_random_epochs(
    beton: Path, daemon: DaemonProcess, backend: str
) -> None:
    kw = {"batch_size": 4, "order": "RANDOM", "seed": 3, "drop_last": False}
    with make_loader("inproc", beton, _pipes(True), **kw) as want_ld:
        want = epochs(want_ld, 2)
    with make_loader(backend, beton, _pipes(True), address=daemon.address, **kw) as ld:
        got = epochs(ld, 2)
    assert_same_epochs(got, want, backend)
