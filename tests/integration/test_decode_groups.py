# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""Issue 16 end to end: streams whose pipelines differ share decodes (decode groups).

Four pipelines, RandomResizedCrop to 160/176/192/224 with a flip, same dataset, seed and order,
``share_decode=True``. Each job's batches must equal its solo run bit for bit, in process and
served, while the group decodes each sample about once per epoch.
"""

from __future__ import annotations

import functools
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from beton_serve.engine import Engine, OrderOption
from beton_serve.fields import decode_cache as dc
from beton_serve.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
from beton_serve.loader import Loader
from beton_serve.pipeline.registry import op_from_spec
from beton_serve.transforms import RandomHorizontalFlip
from conformance._backends import (
    Step,
    assert_same_schedules,
    run_interleaved,
    run_schedule,
    shared_schedules,
)
from helpers.daemon import daemon_factory, short_tmp  # noqa: F401
from helpers.sweep_images import write_sweep_file

N = 48
BATCH = 8
SEED = 5
SIZES = (160, 176, 192, 224)


@pytest.fixture(scope="module")
def jpeg_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_sweep_file(tmp_path_factory.mktemp("dg") / "sweep.beton", N)


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch) -> Iterator[dc.DecodeCache]:
    """A fresh process cache for the test (streams join ``default_decode_cache()``)."""
    fresh = dc.DecodeCache()
    monkeypatch.setattr(dc, "_default", [fresh])
    yield fresh


def _pipelines(size: int, share: bool = True, tensors: bool = False, min_side: int = 0) -> dict:
    from beton_serve.transforms import ToTensor

    def tail() -> list:
        return [ToTensor()] if tensors else []

    return {
        "image": [
            RandomResizedCropRGBImageDecoder(
                (size, size), share_decode=share, share_min_side=min_side
            ),
            RandomHorizontalFlip(),
            *tail(),
        ],
        "label": [IntDecoder(), *tail()],
    }


def _loader(path: Path, size: int, engine: Engine | None = None, **kw) -> Loader:
    return Loader(
        str(path),
        batch_size=kw.pop("batch_size", BATCH),
        order=OrderOption.RANDOM,
        seed=SEED,
        engine=engine,
        num_workers=2,
        pipelines=kw.pop("pipelines", None) or _pipelines(size),
        **kw,
    )


def _read(loader, epochs: int, out: list, start_epoch: int = 0, pause=None) -> None:
    for e in range(start_epoch, epochs):
        for i, (x, y) in enumerate(loader):
            out.append((e, _np(x), _np(y)))
            if pause is not None:
                pause(e, i)


def _np(x) -> np.ndarray:
    """A copy of a batch output (numpy array or CPU tensor) as numpy."""
    return x.numpy().copy() if hasattr(x, "numpy") else np.array(x)


def _solo(path: Path, size: int, epochs: int = 2) -> list:
    out: list = []
    engine = Engine(num_workers=2)
    try:
        _read(_loader(path, size, engine), epochs, out)
    finally:
        engine.close()
    return out


def _same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for (e1, x1, y1), (e2, x2, y2) in zip(a, b, strict=True):
        assert e1 == e2 and np.array_equal(y1, y2) and np.array_equal(x1, x2)


def _together(loaders: list, epochs: int, pause=None) -> list[list]:
    outs: list[list] = [[] for _ in loaders]
    errors: list[BaseException] = []

    start = threading.Barrier(len(loaders), timeout=30)

    def run(i: int) -> None:
        try:
            start.wait()
            _read(loaders[i], epochs, outs[i], pause=pause and (lambda e, b: pause(i, e, b)))
        except BaseException as exc:  # pragma: no cover - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(loaders))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return outs


def test_share_decode_is_a_wire_parameter_and_decodes_in_full(jpeg_file: Path, cache) -> None:
    op = RandomResizedCropRGBImageDecoder((32, 32), share_decode=True)
    params = op.spec_params()
    assert params["share_decode"] is True
    assert "share_decode" not in RandomResizedCropRGBImageDecoder((32, 32)).spec_params()
    assert op_from_spec("RandomResizedCropRGBImageDecoder", params).share_decode is True
    # A full decode then the resize kernel: FFCV's pixels, as with dct_scale=False.
    full = _pipelines(32)
    full["image"][0] = RandomResizedCropRGBImageDecoder(
        (32, 32), dct_scale=False, jpeg_backend="simplejpeg"
    )
    a: list = []
    b: list = []
    _read(_loader(jpeg_file, 32), 1, a)
    _read(_loader(jpeg_file, 32, pipelines=full), 1, b)
    _same(a, b)


#: ``share_min_side`` that splits the 40..90 px test images between 1/2 scale and full size.
MIN_SIDE = 30


@pytest.mark.parametrize("min_side", [0, MIN_SIDE])
def test_four_pipelines_share_decodes_and_equal_their_solo_runs(
    jpeg_file: Path, cache, min_side: int
) -> None:
    refs = {s: _solo_with_batch(jpeg_file, s, BATCH + i, min_side) for i, s in enumerate(SIZES)}
    before = sum(g.decoded for g in cache.stats())
    engine = Engine(num_workers=2)
    try:
        loaders = [
            _loader(
                jpeg_file,
                s,
                engine,
                batch_size=BATCH + i,
                pipelines=_pipelines(s, min_side=min_side),
            )
            for i, s in enumerate(SIZES)
        ]
        outs = _together(loaders, 2)
        (st,) = cache.stats()
    finally:
        engine.close()
    assert st.decode == ("full" if min_side == 0 else f"min_side={min_side}")
    # batch sizes differ (8..11): compare sample streams, not batches
    for s, out in zip(SIZES, outs, strict=True):
        got = np.concatenate([x for _, x, _ in out])
        assert np.array_equal(got, refs[s])
    decoded = st.decoded - before
    delivered_per_member = sum(len(x) for _, x, _ in outs[0])
    assert decoded / delivered_per_member <= 1.3, st


def _solo_with_batch(path: Path, size: int, batch: int, min_side: int = 0) -> np.ndarray:
    out: list = []
    engine = Engine(num_workers=2)
    try:
        pipes = _pipelines(size, min_side=min_side)
        _read(_loader(path, size, engine, batch_size=batch, pipelines=pipes), 2, out)
    finally:
        engine.close()
    return np.concatenate([x for _, x, _ in out])


def test_streams_that_share_decodes_differently_form_separate_groups(
    jpeg_file: Path, cache
) -> None:
    """``share_min_side`` 0 and 30 decode the same JPEGs differently: two groups, each exact."""
    scaled = _pipelines(160, min_side=MIN_SIDE)
    refs = [_solo(jpeg_file, 160), []]
    _read(_loader(jpeg_file, 160, pipelines=scaled), 2, refs[1])
    # the scaled decode is used: some images come out otherwise than from full-size decodes
    assert any(not np.array_equal(a[1], b[1]) for a, b in zip(*refs, strict=True))
    engine = Engine(num_workers=2)
    try:
        loaders = [
            _loader(jpeg_file, 160, engine),
            _loader(jpeg_file, 160, engine, pipelines=_pipelines(160, min_side=MIN_SIDE)),
        ]
        outs = _together(loaders, 2)
        groups = sorted(cache.stats(), key=lambda g: g.decode)
    finally:
        engine.close()
    _same(outs[0], refs[0])
    _same(outs[1], refs[1])
    assert [(g.decode, g.members, g.hits) for g in groups] == [
        ("full", 1, 0),
        (f"min_side={MIN_SIDE}", 1, 0),
    ]


def test_a_laggard_detaches_and_stays_exact(jpeg_file: Path, monkeypatch) -> None:
    budget = 8 * 90 * 90 * 3  # a handful of images: the slow job cannot stay in the window
    small = dc.DecodeCache(max_bytes=budget)
    monkeypatch.setattr(dc, "_default", [small])
    refs = {s: _solo(jpeg_file, s) for s in SIZES}
    engine = Engine(num_workers=2)
    gate = threading.Event()
    try:
        loaders = [_loader(jpeg_file, s, engine) for s in SIZES]
        outs: list[list] = [[] for _ in SIZES]
        threads = [threading.Thread(target=_read, args=(loaders[i], 2, outs[i])) for i in range(3)]
        slow_started = threading.Event()

        def first_then_wait() -> None:  # the 224 job stalls after one batch until the end
            it = iter(loaders[3])
            x, y = next(it)
            outs[3].append((0, np.array(x), np.array(y)))
            slow_started.set()
            gate.wait(20)
            for x, y in it:
                outs[3].append((0, np.array(x), np.array(y)))
            _read(loaders[3], 2, outs[3], start_epoch=1)

        slow = threading.Thread(target=first_then_wait)
        slow.start()
        assert slow_started.wait(20)
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        st = small.stats()[0]
        gate.set()
        slow.join(60)
    finally:
        gate.set()
        engine.close()
    assert small.peak_bytes <= budget
    assert st.evicted > 0 and st.detached >= 1  # the stalled job was detached
    for s, out in zip(SIZES, outs, strict=True):
        _same(out, refs[s])


def _jobs_and_schedules(r: random.Random) -> tuple[list[int], list[list[Step]]]:
    """3 or 4 of :data:`SIZES`, each with its own epoch schedule (:func:`shared_schedules`)."""
    sizes = r.sample(SIZES, r.choice([3, 4]))
    return sizes, shared_schedules(r, len(sizes))


def test_a_job_resumed_mid_epoch_joins_and_reads_exactly_once(jpeg_file: Path, cache) -> None:
    ref = _solo(jpeg_file, 192)
    k = 3
    first = _loader(jpeg_file, 192)
    it = iter(first)
    for _ in range(k):
        next(it)
    state = first.state_dict()
    it.close()
    others = {s: _solo(jpeg_file, s) for s in (160, 176, 224)}
    engine = Engine(num_workers=2)
    try:
        loaders = [_loader(jpeg_file, s, engine) for s in (160, 176, 224)]
        late = _loader(jpeg_file, 192, engine)
        late.load_state_dict(state)
        outs = _together([*loaders, late], 2)
    finally:
        engine.close()
    for s, out in zip((160, 176, 224), outs, strict=False):
        _same(out, others[s])
    _same(outs[3], ref[k:])  # the rest of epoch 0, then epoch 1: nothing twice, nothing lost
    ids = np.concatenate([y.reshape(-1) for e, _, y in outs[3] if e == 0])
    before = np.concatenate([y.reshape(-1) for e, _, y in ref[:k]])
    assert sorted([*ids.tolist(), *before.tolist()]) == list(range(N))


def _served_refs(path: Path, min_side: int) -> dict[int, list]:
    """Each size's solo in-process run of two epochs, with the served pipelines' tensor tail."""
    refs = {}
    for s in SIZES:
        out: list = []
        _read(_loader(path, s, pipelines=_pipelines(s, tensors=True, min_side=min_side)), 2, out)
        refs[s] = out
    return refs


def _clients(address: str, min_side: int, **kw) -> list:
    """One served Loader per size, ``share_decode=True``, on the daemon at ``address``."""
    return [_client(address, s, min_side, **kw) for s in SIZES]


def _client(address: str, size: int, min_side: int = 0, **kw) -> Any:
    """The served Loader of the ``size`` job (``share_decode=True``)."""
    from beton_client import Loader as Client
    from beton_client import OrderOption as ClientOrder

    return Client(
        "sweep",
        batch_size=BATCH,
        order=ClientOrder.RANDOM,
        seed=SEED,
        pipelines=_pipelines(size, tensors=True, min_side=min_side),
        server=address,
        spawn=False,
        **kw,
    )


@pytest.mark.slow
@pytest.mark.parametrize("min_side", [0, MIN_SIDE])
def test_served_jobs_share_decodes_and_equal_in_process(
    jpeg_file: Path, daemon_factory, min_side: int
) -> None:
    refs = _served_refs(jpeg_file, min_side)
    d = daemon_factory([jpeg_file])
    clients = _clients(d.address, min_side)
    try:
        outs = _together(clients, 2)
        stats = d.stats()
    finally:
        for c in clients:
            c.close()
    for s, out in zip(SIZES, outs, strict=True):
        _same(out, refs[s])
    (g,) = [g for g in stats.decode_groups if g.field == "image"]
    assert g.decode == ("full" if min_side == 0 else f"min_side={min_side}")
    # delivered counts the daemon's look-ahead into epoch 2 as well
    assert g.members == 4 and g.delivered >= 4 * 2 * N
    # Decode epochs per epoch (4.0 unshared). The four streams open one after the other, so the
    # first batches of a 6-batch epoch are decoded more than once: the benchmark's longer epochs
    # hold the target of 1.3.
    assert g.decoded * g.members / g.delivered <= 1.5, g


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_served_members_resume_exactly_across_a_sigterm_restart(
    jpeg_file: Path, daemon_factory
) -> None:
    """An operator restarts the daemon (SIGTERM, then a new one on the same socket) while four
    group members are mid-epoch. Each client (``RetryPolicy(after_shutdown=True)``) resumes at the
    batch it had reached; every job's two epochs equal its solo in-process run bit for bit, and
    the four form a group again on the new daemon."""
    import signal

    from beton_client import RetryPolicy

    refs = _served_refs(jpeg_file, MIN_SIDE)
    d1 = daemon_factory([jpeg_file])
    policy = RetryPolicy(budget_s=60.0, initial_s=0.05, max_s=0.5, after_shutdown=True)
    clients = _clients(d1.address, MIN_SIDE, reconnect=policy)
    outs: list[list] = [[] for _ in SIZES]
    d2 = None
    try:
        for e in range(2):
            its = [iter(c) for c in clients]
            for b in range(-(-N // BATCH)):
                if e == 0 and b == 3:
                    d1.proc.send_signal(signal.SIGTERM)
                    assert d1.proc.wait(30) == 0
                    d2 = daemon_factory([jpeg_file], socket=d1.socket, wait=False)
                for i, it in enumerate(its):
                    x, y = next(it)
                    outs[i].append((e, _np(x), _np(y)))
            assert all(next(it, None) is None for it in its)
        assert d2 is not None
        groups = [g for g in d2.stats().decode_groups if g.field == "image"]
    finally:
        for c in clients:
            c.close()
    for s, out in zip(SIZES, outs, strict=True):
        _same(out, refs[s])
    assert [g.members for g in groups] == [4]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_served_members_on_their_own_schedules_equal_in_process(
    jpeg_file: Path, daemon_factory, seed: int
) -> None:
    """Three or four jobs of one decode group (different crop sizes), each on its own random
    epoch schedule (epochs read again, out of order, left early), read in a random
    interleaving: each reads what its in-process Loader reads on the same schedule, bit for
    bit, and a batch one job holds does not change while the others read on."""
    sizes, schedules = _jobs_and_schedules(random.Random(f"decode group schedules {seed}"))
    d = daemon_factory([jpeg_file])
    makes = [functools.partial(_client, d.address, size) for size in sizes]
    groups: list = []

    def look() -> None:  # the group lives while its members are open
        groups.extend(g for g in d.stats().decode_groups if g.field == "image")

    got = run_interleaved(makes, schedules, random.Random(f"decode group order {seed}"), look)
    assert not isinstance(got, BaseException), got
    what = f"seed {seed}: sizes {sizes}, schedules {schedules}"
    for m, (size, steps) in enumerate(zip(sizes, schedules, strict=True)):
        want = run_schedule(
            lambda size=size: _loader(jpeg_file, size, pipelines=_pipelines(size, tensors=True)),
            steps,
        )
        assert assert_same_schedules(got[m], want, f"{what}, job {m} ({size} px)")
    (g,) = groups
    assert g.members == len(sizes) and g.delivered > g.decoded, g  # the jobs shared decodes


@pytest.mark.parametrize("seed", [0, 1])
def test_in_process_members_on_their_own_schedules_equal_their_solo_runs(
    jpeg_file: Path, cache, seed: int
) -> None:
    """The in-process twin of the test above: the jobs share one Engine and the process's decode
    cache (issue 16 in process); each equals its solo Loader on the same schedule."""
    sizes, schedules = _jobs_and_schedules(
        random.Random(f"in-process decode group schedules {seed}")
    )
    engine = Engine(num_workers=2)
    try:
        makes = [functools.partial(_loader, jpeg_file, size, engine) for size in sizes]
        hits: list[int] = []
        got = run_interleaved(
            makes,
            schedules,
            random.Random(f"in-process order {seed}"),
            lambda: hits.extend(g.hits for g in cache.stats()),
        )
    finally:
        engine.close()
    assert not isinstance(got, BaseException), got
    what = f"seed {seed}: sizes {sizes}, schedules {schedules}"
    for m, (size, steps) in enumerate(zip(sizes, schedules, strict=True)):
        solo = Engine(num_workers=2)
        try:
            want = run_schedule(functools.partial(_loader, jpeg_file, size, solo), steps)
        finally:
            solo.close()
        assert assert_same_schedules(got[m], want, f"{what}, job {m} ({size} px)")
    assert sum(hits) > 0  # the jobs did share decodes
