# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""A stream whose batches are slow does not stall another client of the same daemon.

The engine's fair share (``engine/_pool.py``): while two streams have work, neither runs on
more than its share of the workers. Here a custom op spins for a fraction of a second per
sample; with the slow stream reading continuously, a plain client's epoch gets a worker as soon
as one of the slow stream's running tasks ends, and then keeps it. Before the share, each of
the plain client's batches queued behind the slow stream's read-ahead (47 s for 8 tiny
batches against a 1 s-per-sample op; 4 s with the share).

The check counts the slow stream's batches delivered during the plain epoch rather than timing
it: with the share, the plain epoch waits for at most the slow tasks already running; without
it, for a slow batch per plain batch or so.
"""

from __future__ import annotations

import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from beton_client import Loader
from beton_serve.fields.decoders import IntDecoder, NDArrayDecoder
from beton_serve.loader import Loader as InProcessLoader
from beton_serve.loader import OrderOption
from beton_serve.transforms import ToTensor
from helpers.daemon import daemon_factory, short_tmp  # noqa: F401
from helpers.labelled import write_labelled

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SPIN_SOURCE = textwrap.dedent(
    '''
    from beton_serve.pipeline.compiler import Compiler
    from beton_serve.pipeline.operation import Operation


    class Spin(Operation):
        """Spins ``iters`` iterations per sample, then passes the rows through."""

        def __init__(self, iters):
            super().__init__()
            self.iters = iters

        def generate_code(self):
            n = self.iters
            my_range = Compiler.get_iterator()

            def spin(x, dst):
                for i in my_range(x.shape[0]):
                    acc = 0.0
                    for k in range(n):
                        acc += (k % 7) * 1e-12
                    x[i, 1] += acc * 0.0
                return x

            return spin

        def declare_state_and_memory(self, previous_state):
            return previous_state, None
    '''
)

#: About 0.2-0.4 s per sample here: a slow batch of 4 is seconds, a plain one microseconds.
SPIN_ITERS = 2 * 10**8
BATCH = 4
N = 64


def _plain():
    return {"vec": [NDArrayDecoder(), ToTensor()], "label": [IntDecoder(), ToTensor()]}


def test_a_slow_stream_leaves_a_plain_client_a_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, daemon_factory
):
    import importlib
    import sys

    mods = tmp_path / "mods"
    mods.mkdir()
    name = f"spin_ops_{tmp_path.name.replace('-', '_')[-20:]}"
    (mods / f"{name}.py").write_text(SPIN_SOURCE)
    sys.path.insert(0, str(mods))
    try:
        spin_ops = importlib.import_module(name)
    finally:
        sys.path.remove(str(mods))
    monkeypatch.setenv("PYTHONPATH", str(mods))  # the daemon rebuilds the op (route b)
    data = write_labelled(tmp_path / "data.beton", N, 1000)
    d = daemon_factory([data])

    def slow(iters: int):
        return {
            "vec": [NDArrayDecoder(), spin_ops.Spin(iters), ToTensor()],
            "label": [IntDecoder(), ToTensor()],
        }

    kw = dict(batch_size=BATCH, order=OrderOption.RANDOM, seed=3, server=d.address, spawn=False)
    for pipelines in (slow(1), _plain()):  # compiled once, before anything is timed
        with Loader(str(data), pipelines=pipelines, **kw) as warm:
            for _ in warm:
                pass

    slow_times: list[float] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def read_slow() -> None:
        try:
            with Loader(str(data), pipelines=slow(SPIN_ITERS), **kw) as loader:
                while not stop.is_set():
                    for _ in loader:
                        slow_times.append(time.monotonic())
                        if stop.is_set():
                            break
        except BaseException as exc:  # reported by the test below
            errors.append(exc)

    reader = threading.Thread(target=read_slow, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while len(slow_times) < 2:  # the slow stream runs, its read-ahead queued
            assert time.monotonic() < deadline and not errors, errors
            time.sleep(0.01)
        with Loader(str(data), pipelines=_plain(), **kw) as plain:
            t0 = time.monotonic()
            served = [(np.asarray(v).copy(), np.asarray(y).copy()) for v, y in plain]
            t1 = time.monotonic()
    finally:
        stop.set()
        reader.join(120)
    assert not reader.is_alive()
    assert not errors, errors
    during = sum(t0 <= t <= t1 for t in slow_times)
    assert during <= 2, (
        f"the plain epoch ({t1 - t0:.2f} s) waited for {during} of the slow stream's batches"
    )
    ref_kw = {k: v for k, v in kw.items() if k not in ("server", "spawn")}
    with InProcessLoader(str(data), pipelines=_plain(), **ref_kw) as ref:
        local = [(np.asarray(v).copy(), np.asarray(y).copy()) for v, y in ref]
    assert len(served) == len(local) == N // BATCH
    for (v, y), (lv, ly) in zip(served, local, strict=True):
        assert np.array_equal(v, lv) and np.array_equal(y, ly)
        assert np.array_equal(v[:, 0], y.reshape(-1).astype(np.float32))
