"""A process that leaves an in-process Loader mid-epoch exits cleanly.

A trainer that breaks out of its loop and returns (no ``close``, no ``with``) leaves batches in
flight on the engine's daemon worker threads. The interpreter's exit finalizers
(``weakref.finalize``) then freed TurboJPEG handles and unmapped the file while those workers
still decoded into them: the process died with SIGSEGV or ``free(): invalid pointer`` at exit,
in 8 runs of 8 before the engine was closed at exit ahead of the finalizers. Each run here is a
fresh process; all must exit 0 with nothing on stderr about memory.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from beton_serve.fields import IntField, RGBImageField
from beton_serve.writer import DatasetWriter
from helpers.child import child_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

_SCRIPT = r"""
import sys
from beton_serve.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
from beton_serve.loader import Loader, OrderOption
from beton_serve.transforms import RandomHorizontalFlip
dec = RandomResizedCropRGBImageDecoder((160, 160), jpeg_backend=sys.argv[2])
ld = Loader(sys.argv[1], batch_size=64, num_workers=2, order=OrderOption.RANDOM, seed=0,
            batches_ahead=4, pipelines={"image": [dec, RandomHorizontalFlip()],
                                        "label": [IntDecoder()]})
it = iter(ld)  # a module global: alive until the interpreter's exit
img, label = next(it)
assert img.shape == (64, 160, 160, 3)
print("first batch", flush=True)
# returns with the epoch's next batches still decoding on the workers
"""


class _Images:
    def __len__(self) -> int:
        return 400

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        rng = np.random.default_rng(i)
        return rng.integers(0, 256, size=(360 + i % 50, 480, 3), dtype=np.uint8), i


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("exit") / "img.beton"
    DatasetWriter(
        str(path), {"image": RGBImageField(write_mode="jpg"), "label": IntField()}
    ).from_indexed_dataset(_Images())
    return path


def _backends() -> list[str]:
    from beton_serve import _tj3

    try:
        _tj3.load()
    except Exception:
        return ["simplejpeg"]
    return ["tj3", "simplejpeg"]


@pytest.mark.parametrize("backend", _backends())
def test_exit_with_batches_in_flight_is_clean(data: Path, backend: str) -> None:
    env = child_env()
    for run in range(4):
        proc = subprocess.run(
            [sys.executable, "-X", "faulthandler", "-c", _SCRIPT, str(data), backend],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, f"run {run}: rc {proc.returncode}\n{proc.stderr[-3000:]}"
        assert "first batch" in proc.stdout
        assert "Fatal Python error" not in proc.stderr and "free()" not in proc.stderr
