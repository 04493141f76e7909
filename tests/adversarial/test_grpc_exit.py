"""Issue 11 §7: a process that leaves a grpc epoch early exits, whatever it does next.

Before the fix, the epoch iterator left by ``break`` drained its owed batches when the garbage
collector finalised it at interpreter shutdown; the drain started a receive-timeout thread, which
never runs at shutdown, and the process hung for good. Each variant runs in a subprocess that must
check its batch and exit 0 within 20 s.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from beton_serve.fields import IntField, NDArrayField
from beton_serve.writer import DatasetWriter
from helpers.daemon import DaemonProcess, start_daemon

pytestmark = pytest.mark.slow

N = 48
EXIT_TIMEOUT_S = 20


class _TinyWriter(DatasetWriter):
    _MIN_PAGE_SIZE = 4096


class _Rows:
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[int, np.ndarray]:
        return i, np.full((4, 4), (i * 5) % 251, np.uint8)


_PRELUDE = """
import sys
import numpy as np
from beton_client import Loader

loader = Loader("tiny", 4, server=sys.argv[1], transport="grpc", spawn=False)

def check(batch, index):
    label, pix = (np.asarray(x) for x in batch)
    ids = np.arange(4 * index, 4 * index + 4)
    assert np.array_equal(np.asarray(loader.last_sample_ids, dtype=np.int64), ids)
    assert np.array_equal(label.reshape(-1), ids)
    assert np.array_equal(pix, np.stack([np.full((4, 4), (i * 5) % 251, np.uint8) for i in ids]))
"""

VARIANTS = {
    "break": """
        for batch in loader:
            check(batch, 0)
            break
    """,
    "break_then_close": """
        for batch in loader:
            check(batch, 0)
            break
        loader.close()
    """,
    "del_iterator_then_close": """
        it = iter(loader)
        check(next(it), 0)
        check(next(it), 1)
        del it
        loader.close()
    """,
    "break_twice": """
        for _ in range(2):  # the second epoch abandons the first one's stream
            for batch in loader:
                check(batch, 0)
                break
    """,
    "with_block_break": """
        with loader:
            for batch in loader:
                check(batch, 0)
                break
    """,
}


@pytest.fixture(scope="module")
def tiny_daemon() -> Iterator[DaemonProcess]:
    """One daemon for every variant (module scope: outside the per-test leak guard)."""
    workdir = Path(tempfile.mkdtemp(prefix="bs-", dir="/tmp"))
    try:
        path = workdir / "tiny.beton"
        fields = {"label": IntField(), "pix": NDArrayField(np.dtype(np.uint8), (4, 4))}
        _TinyWriter(path, fields, page_size=4096, num_workers=1).from_indexed_dataset(_Rows())
        d = start_daemon([path], workdir)
        try:
            yield d
        finally:
            d.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_leaving_a_grpc_epoch_early_lets_the_process_exit(
    tiny_daemon: DaemonProcess, variant: str
) -> None:
    d = tiny_daemon
    script = _PRELUDE + textwrap.dedent(VARIANTS[variant]) + 'print("checked", flush=True)\n'
    try:
        done = subprocess.run(
            [sys.executable, "-c", script, d.address],
            capture_output=True,
            text=True,
            timeout=EXIT_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{variant}: the process did not exit within {EXIT_TIMEOUT_S} s: {exc.stderr}")
    assert done.returncode == 0, done.stderr
    assert "checked" in done.stdout
