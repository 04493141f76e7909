"""With the TurboJPEG batch kernel in the compile cache, a new process's first batch runs it.

Without it in the cache, the first batches take the per-sample ctypes loop (same pixels) while
the kernel compiles in the background, after the first batch (issue 14: a compile started
earlier would delay the first batch's own). With it cached, loading takes milliseconds, so the
first batch loads and runs it. Checked in fresh processes, by counting the ctypes decodes of a
CenterCrop batch whose crops are all downscales (the kernel does every such sample), and the
pixels are the same bytes either way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from beton_serve.fields import IntField, RGBImageField
from beton_serve.writer import DatasetWriter
from helpers.child import child_env, run_json

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

_CHILD = r"""
import hashlib, json, sys
import numpy as np
from beton_serve import _tj3
try:
    lib = _tj3.load()
except Exception as exc:
    print(json.dumps({"skip": repr(exc)})); sys.exit(0)
calls = [0]
real = _tj3.Decompressor.decode
def counting(self, *a, **k):
    calls[0] += 1
    return real(self, *a, **k)
_tj3.Decompressor.decode = counting
from beton_serve.fields.decoders import CenterCropRGBImageDecoder, IntDecoder
from beton_serve.loader import Loader
cached = _tj3.kernel_cached(lib)
dec = CenterCropRGBImageDecoder((32, 32), 0.875, jpeg_backend="tj3")
with Loader(sys.argv[1], batch_size=8, num_workers=2, seed=0,
            pipelines={"image": [dec], "label": [IntDecoder()]}) as ld:
    img, label = next(iter(ld))
    digest = hashlib.sha256(np.ascontiguousarray(img).tobytes()).hexdigest()
_tj3.batch_kernel(lib, wait=True)  # the cold run compiles (and saves) it here
print(json.dumps({"cached": cached, "ctypes_decodes": calls[0], "digest": digest}))
"""


class _Images:
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        rng = np.random.default_rng(i)
        return rng.integers(0, 256, size=(120 + i, 140, 3), dtype=np.uint8), i


def test_first_batch_runs_the_cached_kernel(tmp_path: Path) -> None:
    data = tmp_path / "img.beton"
    DatasetWriter(
        str(data), {"image": RGBImageField(write_mode="jpg"), "label": IntField()}
    ).from_indexed_dataset(_Images())
    env = child_env(BETON_SERVE_CACHE_DIR=str(tmp_path / "cc"))

    def run() -> dict[str, Any]:
        return run_json(_CHILD, str(data), env=env)  # type: ignore[no-any-return]

    cold = run()
    if "skip" in cold:
        pytest.skip(f"no TurboJPEG 3: {cold['skip']}")
    assert cold["cached"] is False
    assert cold["ctypes_decodes"] >= 8  # the first batch took the ctypes loop
    warm = run()
    assert warm["cached"] is True
    assert warm["ctypes_decodes"] == 0  # every sample in the kernel, from the first batch
    assert warm["digest"] == cold["digest"]
