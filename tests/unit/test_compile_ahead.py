"""With a cold compile cache, the ops after a crop decoder compile while its kernels do
(``Plan._compile_ahead`` on ``_prewarm.ahead``; issue 14 §2): each ``compile_ahead`` op is called
once on a private one-sample batch of zeros, with the argument types :meth:`Plan.run` gives it,
so the first batch finds its machine code ready instead of compiling it after the decoder."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from beton_serve import _prewarm
from beton_serve.fields import FloatField, IntField, RGBImageField
from beton_serve.fields.decoders import (
    FloatDecoder,
    IntDecoder,
    RandomResizedCropRGBImageDecoder,
    SimpleRGBImageDecoder,
)
from beton_serve.format import BetonReader
from beton_serve.pipeline import Operation, State, compile_pipelines, compiler
from beton_serve.pipeline import _plan as plan_module
from beton_serve.transforms import (
    Cutout,
    NormalizeImage,
    RandomBrightness,
    RandomHorizontalFlip,
    RandomTranslate,
    ToTensor,
)
from beton_serve.transforms._util import mark
from beton_serve.writer import DatasetWriter

pytestmark = pytest.mark.timeout(300)

N, H, W = 9, 6, 5


class _Rows:
    def __init__(self) -> None:
        rng = np.random.default_rng(3)
        self.images = rng.integers(0, 256, (N, H, W, 3), dtype=np.uint8)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[np.ndarray, int, float]:
        return self.images[i], i * 7, i / 4


@pytest.fixture(scope="module")
def raw_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ahead") / "raw.beton"
    DatasetWriter(
        str(path),
        {"image": RGBImageField(write_mode="raw"), "label": IntField(), "w": FloatField()},
    ).from_indexed_dataset(_Rows())
    return path


@pytest.fixture
def fresh_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """New dispatchers (no overloads yet) over an empty cache, and decoders that do not fuse
    the flip (so that the flip runs as its own op, in place over the decoder's buffer)."""
    monkeypatch.setenv("BETON_SERVE_CACHE_DIR", str(tmp_path / "cc"))
    monkeypatch.setenv(plan_module.FUSE_MIRROR_ENV, "0")
    compiler._forget_compiled()
    yield
    compiler._forget_compiled()


def _dispatchers(fn: Callable[..., Any]) -> list[Any]:
    """The Numba dispatchers behind an op's function: itself, or those a Python wrapper (the
    flip) closes over."""
    if hasattr(fn, "overloads"):
        return [fn]
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True))
    out = []
    for cell in cells.values():
        v = cell.cell_contents
        if hasattr(v, "overloads"):
            out.append(v)
        elif callable(v) and getattr(v, "__closure__", None):  # mirror_mask -> mask_fn
            out.extend(_dispatchers(v))
    return out


def _steps_by_op(plan: Any) -> dict[str, Callable[..., Any]]:
    return {type(step[0].op).__name__: step[2] for step in plan._steps}


def _run(plan: Any, ids: list[int], epoch: int = 1) -> list[np.ndarray]:
    ws = plan.acquire_workspace()
    try:
        res = plan.run(ws, np.asarray(ids, np.uint64), plan.seed_keys(5, epoch))
        return [np.array(r, copy=True) for r in res]
    finally:
        plan.release_workspace(ws)


def test_the_ops_compile_on_zeros_for_the_types_a_batch_gives_them(
    raw_file: Path, fresh_compiler: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    queued: list[Callable[[], None]] = []
    monkeypatch.setattr(_prewarm, "ahead", lambda fn: queued.append(fn) or True)
    reader = BetonReader(str(raw_file))
    pipes = {
        "image": [
            SimpleRGBImageDecoder(),
            RandomHorizontalFlip(),
            Cutout(2, (1, 2, 3)),
            RandomTranslate(1),
            RandomBrightness(0.3, p=1.0),
            NormalizeImage(np.array([120.0, 110, 100]), np.array([50.0, 60, 70]), np.float32),
        ],
        "label": [IntDecoder()],
        "w": [FloatDecoder()],
    }
    plan = compile_pipelines(reader, pipes, batch_size=4)
    assert len(queued) == 1  # the plan asked to compile ahead, once
    fns = _steps_by_op(plan)
    ahead = [
        "RandomHorizontalFlip",
        "Cutout",
        "RandomTranslate",
        "RandomBrightness",
        "NormalizeImage",
        "IntDecoder",
        "FloatDecoder",
    ]
    disps = {name: _dispatchers(fns[name]) for name in ahead}
    assert all(disps.values()), disps
    assert all(not d.overloads for ds in disps.values() for d in ds)  # nothing compiled yet
    # (module-level kernels of the raw decoder may be compiled by other tests already)
    raw = {id(d): list(d.signatures) for d in _dispatchers(fns["SimpleRGBImageDecoder"])}

    queued[0]()  # what the prewarm thread runs

    for name, ds in disps.items():  # (the flip has kernels for other layouts, unused here)
        assert any(d.overloads for d in ds), name
    # the decoder that reads pixels is never called
    assert {id(d): list(d.signatures) for d in _dispatchers(fns["SimpleRGBImageDecoder"])} == raw
    before = {id(d): list(d.signatures) for ds in disps.values() for d in ds}
    ids = [3, 0, 8, 5]
    got = _run(plan, ids)
    # the batch ran on the specialisations compiled on zeros: none was added
    for name, ds in disps.items():
        for d in ds:
            assert list(d.signatures) == before[id(d)], (name, d.py_func.__qualname__)
    # and the batch is what a plan that never compiled ahead gives
    compiler._forget_compiled()
    monkeypatch.setattr(_prewarm, "ahead", lambda fn: False)
    other = compile_pipelines(BetonReader(str(raw_file)), pipes, batch_size=4)
    want = _run(other, ids)
    assert len(got) == len(want) == 3
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(got[1][:, 0], np.asarray(ids) * 7)
    np.testing.assert_array_equal(got[2][:, 0], np.asarray(ids) / 4)


def test_the_zeros_are_private_and_a_crop_decoder_is_not_called(
    raw_file: Path, fresh_compiler: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    queued: list[Callable[[], None]] = []
    monkeypatch.setattr(_prewarm, "ahead", lambda fn: queued.append(fn) or True)
    path = tmp_path / "jpg.beton"

    class _Jpegs(_Rows):
        def __getitem__(self, i: int) -> tuple[np.ndarray, int]:  # type: ignore[override]
            return np.ascontiguousarray(np.resize(self.images[i], (40, 48, 3))), i

    DatasetWriter(
        str(path), {"image": RGBImageField(write_mode="jpg"), "label": IntField()}
    ).from_indexed_dataset(_Jpegs())
    dec = RandomResizedCropRGBImageDecoder((16, 16))
    plan = compile_pipelines(
        BetonReader(str(path)),
        {"image": [dec, RandomHorizontalFlip()], "label": [IntDecoder()]},
        batch_size=3,
    )
    calls: list[Any] = []
    orig = plan._fns[0]
    plan._fns[0] = lambda *a: calls.append(a) or orig(*a)
    plan._steps = plan._build_steps()
    ws = plan.acquire_workspace()
    try:
        bufs = {pos: ws.buffer(pos) for pos in list(ws._queries)}
        for b in bufs.values():
            if b is not None:
                b[...] = 77
        queued[0]()
        for pos, b in bufs.items():
            if b is not None:
                assert (b == 77).all(), pos  # no workspace buffer was written
    finally:
        plan.release_workspace(ws)
    assert calls == []  # the crop decoder reads pixels: never called on zeros
    flip = _dispatchers(_steps_by_op(plan)["RandomHorizontalFlip"])
    assert any(d.overloads for d in flip)


class _UserOp(Operation):
    """A user's op (not ``compile_ahead``): it must never be called on zeros."""

    calls: list[int] = []

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, None]:
        return previous_state, None

    def generate_code(self) -> Callable[..., Any]:
        calls = self.calls

        def op(images, dst):
            calls.append(len(images))
            return images

        return mark(op, python=True)


class _MyFlip(RandomHorizontalFlip):
    """A user's variant with its own code: not vouched for by the built-in's trait."""

    def generate_code(self) -> Callable[..., Any]:
        return super().generate_code()


def test_only_built_in_ops_that_allow_it_are_called(
    raw_file: Path, fresh_compiler: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert RandomHorizontalFlip.compile_ahead and IntDecoder.compile_ahead
    assert not _MyFlip.compile_ahead and not _UserOp.compile_ahead
    assert not SimpleRGBImageDecoder.compile_ahead and not ToTensor.compile_ahead
    queued: list[Callable[[], None]] = []
    monkeypatch.setattr(_prewarm, "ahead", lambda fn: queued.append(fn) or True)
    reader = BetonReader(str(raw_file))
    _UserOp.calls.clear()
    plan = compile_pipelines(
        reader,
        {"image": [SimpleRGBImageDecoder(), _UserOp(), _MyFlip()], "label": None, "w": None},
        batch_size=4,
    )
    assert queued == []  # nothing in it may be compiled ahead: not even asked
    plan2 = compile_pipelines(
        reader,
        {
            "image": [SimpleRGBImageDecoder(), _UserOp(), RandomHorizontalFlip()],
            "label": None,
            "w": None,
        },
        batch_size=4,
    )
    assert len(queued) == 1
    queued[0]()
    assert _UserOp.calls == []  # the user's op was skipped; the flip after it ran on zeros
    assert any(d.overloads for d in _dispatchers(_steps_by_op(plan2)["RandomHorizontalFlip"]))
    del plan


def test_a_field_without_samples_calls_no_decoder(
    raw_file: Path, fresh_compiler: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    queued: list[Callable[[], None]] = []
    monkeypatch.setattr(_prewarm, "ahead", lambda fn: queued.append(fn) or True)
    plan = compile_pipelines(
        BetonReader(str(raw_file)),
        {"label": [IntDecoder()], "image": None, "w": None},
        batch_size=4,
    )
    # a decoder reads sample 0's metadata on zeros: with none there, it is not called
    plan._steps = [(*st[:4], st[4][:0], *st[5:]) for st in plan._steps]
    queued[0]()
    assert not any(d.overloads for d in _dispatchers(_steps_by_op(plan)["IntDecoder"]))


# -- _prewarm.ahead -----------------------------------------------------------------------------
@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    monkeypatch.setenv("BETON_SERVE_CACHE_DIR", str(tmp_path / "cc"))
    monkeypatch.setenv("BETON_SERVE_PREWARM", "1")  # the suite's conftest turns it off
    _prewarm._reset_for_tests()
    yield
    _prewarm._reset_for_tests()
    monkeypatch.setattr(_prewarm, "_local_open", False)


def test_ahead_runs_nothing_when_no_compile_is_under_way(
    fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[int] = []
    assert _prewarm.ahead(lambda: ran.append(1)) is False
    monkeypatch.setattr(_prewarm, "_local_open", True)
    monkeypatch.setenv("BETON_SERVE_PREWARM", "0")
    assert _prewarm.ahead(lambda: ran.append(2)) is False
    assert ran == [] and _prewarm._queued == []


def test_ahead_queues_behind_the_local_compile_which_drains_it(
    fresh: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_prewarm, "_local_open", True)
    ran: list[str] = []

    def boom() -> None:
        raise RuntimeError("no")

    assert _prewarm.ahead(lambda: ran.append(threading.current_thread().name))
    assert _prewarm.ahead(boom)
    assert _prewarm.ahead(lambda: ran.append("after"))
    assert ran == []  # queued, not run by the caller
    with caplog.at_level("DEBUG", logger="beton_serve.prewarm"):
        t = threading.Thread(target=_prewarm._compile_local, args=([],), name="beton-prewarm")
        t.start()
        t.join(30)
    assert ran == ["beton-prewarm", "after"]  # in order; a failure does not stop the rest
    assert "compiling ahead failed" in caplog.text and "no" in caplog.text
    assert _prewarm._local_open is False and _prewarm._queued == []
    assert _prewarm.ahead(lambda: ran.append("late")) is False  # the thread is done


def test_ahead_runs_on_its_own_thread_while_only_the_helper_compiles(
    fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    ev = threading.Event()
    monkeypatch.setitem(_prewarm._pending, "resize", ev)
    done = threading.Event()
    names: list[str] = []

    def work() -> None:
        names.append(threading.current_thread().name)
        done.set()

    assert _prewarm.ahead(work)
    assert done.wait(30)
    assert names == ["beton-prewarm"]
    assert _prewarm.join(30)
    ev.set()
    assert _prewarm.ahead(work) is False  # the helper is done: nothing under way
