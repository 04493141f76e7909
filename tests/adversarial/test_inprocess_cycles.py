"""1,000 in-process Loaders opened, iterated and closed leave no memory, fd or thread behind.

Each Loader generates its ops' closures anew. Before the compiler reused the dispatcher of an
identical function (same fingerprint: code and frozen values), every Loader kept ~100 kB of
machine code for the life of the process (Numba never frees it): +100 MB over these cycles.
Run in a fresh process so that its RSS is this Loader's alone.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from beton_serve.errors import PipelineError
from beton_serve.fields import IntField, RGBImageField
from beton_serve.fields.decoders import CenterCropRGBImageDecoder, IntDecoder
from beton_serve.loader import Loader, OrderOption
from beton_serve.writer import DatasetWriter
from helpers.bad_samples import zero_samples
from helpers.child import child_env, run_child
from helpers.cycles import assert_freed_by_refcount

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

RSS_SLACK_MB = 8.0

_SCRIPT = r"""
import gc, json, os, sys, threading
from beton_serve.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
from beton_serve.loader import Loader
from beton_serve.transforms import RandomHorizontalFlip
path, cycles = sys.argv[1], int(sys.argv[2])

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6

def one(seed):
    pipes = {"image": [RandomResizedCropRGBImageDecoder((32, 32)), RandomHorizontalFlip()],
             "label": [IntDecoder()]}
    with Loader(path, batch_size=8, num_workers=2, seed=seed, pipelines=pipes) as ld:
        for i, (img, label) in enumerate(ld):
            assert img.shape == (8, 32, 32, 3) and img.any()
            if i == 1:
                break  # abandoned mid-epoch, as often as finished

for i in range(30):  # warm-up: compiles, allocator pools, lazy imports
    one(i % 3)
gc.collect()
base_rss, base_fds = rss_mb(), len(os.listdir("/proc/self/fd"))
base_threads = threading.active_count()
for i in range(cycles):
    one(i % 3)
gc.collect()
print(json.dumps({"rss": rss_mb() - base_rss, "fds": len(os.listdir("/proc/self/fd")) - base_fds,
                  "threads": threading.active_count() - base_threads}))
"""


class _Images:
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        rng = np.random.default_rng(i)
        return rng.integers(0, 256, size=(48 + i, 64, 3), dtype=np.uint8), i


def test_thousand_inprocess_loaders_leave_nothing_behind(tmp_path: Path) -> None:
    data = tmp_path / "img.beton"
    DatasetWriter(
        str(data), {"image": RGBImageField(write_mode="jpg"), "label": IntField()}
    ).from_indexed_dataset(_Images())
    proc = run_child(_SCRIPT, str(data), "1000", env=child_env(), timeout=360)
    grown = json.loads(proc.stdout.strip().splitlines()[-1])
    assert grown["fds"] <= 0, grown
    assert grown["threads"] <= 0, grown
    assert grown["rss"] <= RSS_SLACK_MB, f"RSS grew {grown['rss']:.1f} MB over 1,000 Loaders"


_DROPPED = r"""
import gc, json, os, sys, threading, weakref
gc.disable()  # what is freed below is freed by reference counting alone
from beton_serve.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
from beton_serve.loader import Loader
from beton_serve.transforms import RandomHorizontalFlip
path = os.path.realpath(sys.argv[1])

def mapped():
    with open("/proc/self/maps") as f:
        return sum(line.rstrip().endswith(path) for line in f)

def opened():
    return sum(os.path.realpath(f"/proc/self/fd/{fd}") == path for fd in os.listdir("/proc/self/fd"))

def one(stop_at):
    pipes = {"image": [RandomResizedCropRGBImageDecoder((32, 32)), RandomHorizontalFlip()],
             "label": [IntDecoder()]}
    ld = Loader(path, batch_size=8, num_workers=2, seed=0, pipelines=pipes)
    total = 0
    for i, (img, label) in enumerate(ld):
        total += int(img.sum()) + int(label.sum())
        if i == stop_at:
            break  # the iterator is dropped mid-epoch with batches in flight
    assert total > 0
    return weakref.ref(ld)

one(None)  # warm-up: compiles, lazy imports
gc.collect()
threads = threading.active_count()
gc.set_debug(gc.DEBUG_SAVEALL)
out = []
for stop_at in (None, 1):
    ref = one(stop_at)
    state = {"alive": ref() is not None, "mapped": mapped(), "opened": opened(),
             "threads": threading.active_count() - threads}
    gc.collect()
    state["cyclic"] = sorted({f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage
                              if type(o).__module__.startswith(("beton_serve", "beton_client"))})
    gc.garbage.clear()
    out.append(state)
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_a_dropped_loader_is_freed_without_the_garbage_collector(tmp_path: Path) -> None:
    """Dropping a Loader (finished or abandoned mid-epoch) frees its file and workers at once.

    Its pipeline graph used to be a reference cycle (each node held its children, each child
    its parent), and the decoders hold the file's mapped metadata: every dropped Loader kept
    its mapping and descriptor until a cyclic collection (23 files open at once over 500
    dropped CIFAR Loaders, +360 MB of RSS). Training scripts that build a validation Loader per
    epoch drop one each time.
    """
    data = tmp_path / "img.beton"
    DatasetWriter(
        str(data), {"image": RGBImageField(write_mode="jpg"), "label": IntField()}
    ).from_indexed_dataset(_Images())
    proc = run_child(_DROPPED, str(data), env=child_env(), timeout=100)
    for state in json.loads(proc.stdout.strip().splitlines()[-1]):
        assert state == {"alive": False, "mapped": 0, "opened": 0, "threads": 0, "cyclic": []}


def _epoch_rows(loader: Any) -> dict[int, tuple[np.ndarray, int]]:
    """Every row of one epoch, by the sample id the Loader says it holds."""
    rows: dict[int, tuple[np.ndarray, int]] = {}
    for images, labels in loader:
        for sid, image, label in zip(loader.last_sample_ids, images, labels, strict=True):
            rows[int(sid)] = (np.array(image), int(label[0]))
    return rows


@pytest.mark.timeout(120)
@pytest.mark.parametrize("budget", [0, 1])
def test_a_bad_sample_leaves_no_cycle_in_process(
    tmp_path: Path, fixtures_dir: Path, budget: int
) -> None:
    """An in-process epoch with a corrupt JPEG, failed (no budget) or with the sample skipped
    (a budget of 1), and its closed Loader are freed by reference counting.

    Three cycles used to hold them until a collection: the worker's frame held the failed
    task, whose future held the error, whose traceback held that frame; the consumer's frame
    held the future it re-raised the error of; and each sample's failure, kept in the skip's
    verdict table, held the frame of the closure that kept the table (skipped batches too).
    """
    bad = tmp_path / "badjpg.beton"
    shutil.copy(fixtures_dir / "images_jpg.beton", bad)
    zero_samples(bad, [5])
    pipes = {
        "image": [CenterCropRGBImageDecoder((8, 8), 1.0)],
        "label": [IntDecoder()],
        "weight": None,
    }
    with Loader(str(fixtures_dir / "images_jpg.beton"), batch_size=8, num_workers=2,
                order=OrderOption.SEQUENTIAL, pipelines=pipes) as clean:  # fmt: skip
        want = _epoch_rows(clean)

    def epoch() -> Loader:
        loader = Loader(str(bad), batch_size=8, num_workers=2, order=OrderOption.SEQUENTIAL,
                        pipelines=pipes, bad_sample_budget=budget)  # fmt: skip
        if budget == 0:
            with pytest.raises(PipelineError, match=r"sample 5\b"):
                _epoch_rows(loader)
            return loader
        got = _epoch_rows(loader)
        assert 5 not in got and set(got) == set(want) - {5}
        for sid, (image, label) in got.items():  # the replacement's pixels and label
            assert label == want[sid][1] and np.array_equal(image, want[sid][0]), sid
        return loader

    epoch().close()  # warm-up: compiles and lazy imports (see test_stream_leaks)
    assert_freed_by_refcount(epoch, "the Loader")
