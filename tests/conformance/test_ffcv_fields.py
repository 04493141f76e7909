"""Every field type FFCV writes, read through the Loader on every backend, against what FFCV 1.0.2
itself decodes from the same file (``mixed_fields.expected.npz``).

``mixed_fields`` holds an ``IntField`` (with 0, -1, 2**63-1 and -2**63), a ``FloatField`` (with
-0.0, +-inf, NaN and the smallest subnormal), an ``NDArrayField`` (3 x 4 float32, one with NaN and
inf), a ``BytesField`` (one NUL byte, the longest 513 bytes of 0xFF) and a ``JSONField`` (an empty
object, non-ASCII text, a top-level list). The pipelines are the defaults (``pipelines={}``: each
field's own decoder), the batch size leaves a short last batch, and the rows are compared bit for
bit (NaN payloads included) with FFCV's, padding bytes of the bytes and JSON rows too. The
format-level reader tests check the same rows; this checks what a training loop receives.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers.daemon import DaemonProcess

from conformance._backends import BACKENDS, make_loader, module_daemon

pytestmark = pytest.mark.timeout(120)

FIELDS = ("int", "float", "array", "blob", "meta")


@pytest.fixture(scope="module")
def beton(fixtures_dir: Path) -> Path:
    return fixtures_dir / "mixed_fields.beton"


@pytest.fixture(scope="module")
def daemon(beton: Path) -> Iterator[DaemonProcess]:
    with module_daemon([beton]) as d:
        yield d


def _bits(a: np.ndarray) -> np.ndarray:
    """The bytes of ``a`` (so NaN payloads and -0.0 compare as bits)."""
    return np.ascontiguousarray(a).view(np.uint8)


@pytest.mark.parametrize("order", ["SEQUENTIAL", "RANDOM"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_field_type_reads_as_ffcv_decodes_it(
    beton: Path, fixtures_dir: Path, daemon: DaemonProcess, backend: str, order: str
) -> None:
    want = np.load(fixtures_dir / "mixed_fields.expected.npz")
    batches, ids = [], []
    with make_loader(
        backend, beton, {}, address=daemon.address, batch_size=7, drop_last=False, order=order
    ) as ld:
        for b in ld:
            batches.append(tuple(np.asarray(x).copy() for x in b))
            ids.append(np.asarray(ld.last_sample_ids).astype(np.int64))
    assert [len(b[0]) for b in batches] == [7] * 7 + [1]
    assert all(len(b) == len(FIELDS) for b in batches)
    order_ids = np.concatenate(ids)
    assert sorted(order_ids.tolist()) == list(range(50))
    if order == "SEQUENTIAL":
        assert order_ids.tolist() == list(range(50))
    for i, name in enumerate(FIELDS):
        got = np.concatenate([b[i] for b in batches])
        ref = want[name][order_ids]
        assert got.dtype == ref.dtype and got.shape == ref.shape, (name, got.dtype, got.shape)
        assert np.array_equal(_bits(got), _bits(ref)), f"{backend}, {order}: field {name!r} differs"
