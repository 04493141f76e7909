"""``gc_paused``: a Loader's start runs no automatic garbage collection, and leaves the collector
as it found it (issue 14: a full collection of a trainer's objects cost 40-65 ms per start)."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
from beton_client.frontend import gc_paused
from beton_serve.errors import SpecError
from beton_serve.loader import Loader
from helpers.fake_pipeline import AddIndex, AddOne, FakeReader


@pytest.fixture(autouse=True)
def _collector_on() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


def test_paused_inside_and_restored_after_even_on_error() -> None:
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ZeroDivisionError), gc_paused():
        1 / 0  # noqa: B018
    assert gc.isenabled()


def test_a_collector_the_application_turned_off_stays_off() -> None:
    gc.disable()
    with gc_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_nested_and_concurrent_blocks_keep_it_off_until_the_last_ends() -> None:
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with gc_paused():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(10)
    with gc_paused():
        with gc_paused():
            pass
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread's block is still open
    release.set()
    t.join(10)
    assert gc.isenabled()


def _collections_during(fn) -> int:
    seen = []

    def cb(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(cb)
    try:
        fn()
    finally:
        gc.callbacks.remove(cb)
    return len(seen)


class _SpyReader(FakeReader):
    """Records whether the collector was on when the Loader read its metadata, and allocates
    enough tracked objects there to trigger generation-0 collections many times over."""

    def __init__(self) -> None:
        super().__init__(n=8)
        self.collector_on: list[bool] = []

    def field_metadata(self, name):
        self.collector_on.append(gc.isenabled())
        junk = [[i] for i in range(50_000)]
        del junk
        return super().field_metadata(name)


def test_in_process_loader_start_runs_no_collection_and_restores_the_collector() -> None:
    pipes = {"image": [AddOne()], "label": [AddIndex()]}
    reader = _SpyReader()
    n = _collections_during(
        lambda: Loader(reader, batch_size=4, num_workers=1, pipelines=pipes).close()
    )
    assert reader.collector_on and not any(reader.collector_on)
    # at most the one collection of the objects the start made, once it is over (the spy's
    # allocations alone would have triggered about 70)
    assert n <= 1
    assert gc.isenabled()
    with Loader(FakeReader(n=8), batch_size=4, num_workers=1, pipelines=pipes) as ld:
        assert gc.isenabled()
        assert len(list(ld)) == 2
    # a failing construction restores it too, and an application's "off" stays off
    with pytest.raises(SpecError):
        Loader(FakeReader(n=8), batch_size=0, pipelines=pipes)
    assert gc.isenabled()
    gc.disable()
    with Loader(FakeReader(n=8), batch_size=4, num_workers=1, pipelines=pipes):
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_served_loader_import_runs_no_collection() -> None:
    """The served Loader's first use imports grpc and protobuf: with the collector paused (a fresh
    interpreter, which would otherwise collect many times during those imports)."""
    code = (
        "import gc, beton_client\n"
        "seen = []\n"
        "gc.callbacks.append(lambda phase, info: phase == 'start' and seen.append(1))\n"
        "from beton_client import Loader\n"
        "print(len(seen), gc.isenabled())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    collections, enabled = out.stdout.split()
    # at most the one collection of the imported objects once the pause is over (12 here
    # without it)
    assert int(collections) <= 1 and enabled == "True"


class _Cycle:
    """A tracked object in a reference cycle with itself."""

    def __init__(self) -> None:
        self.me = self


def test_objects_made_while_paused_go_to_the_oldest_generation_and_are_still_collected() -> None:
    """A Loader's start makes ~190,000 long-lived objects; left young, the first generation-0
    and generation-1 collections after it examined them all (100 + 140 ms in the training
    loop). They now go straight to the oldest generation, where a full collection still frees
    those that have become garbage."""
    import weakref

    freed = threading.Event()
    with gc_paused():
        keep = [[i] for i in range(20_000)]
        cyc = _Cycle()
        weakref.finalize(cyc, freed.set)
        assert gc.get_count()[0] > 10_000
    assert gc.get_count()[0] < 1000  # nothing young left to examine
    assert gc.get_freeze_count() == 0
    old = {id(o) for o in gc.get_objects(generation=2)}
    assert id(keep) in old and id(keep[-1]) in old and id(cyc) in old
    del cyc
    gc.collect(1)
    assert not freed.is_set()  # the young collections no longer look at it
    gc.collect()
    assert freed.is_set()  # the full one does


def test_objects_the_application_froze_stay_frozen() -> None:
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with gc_paused():
            made = [[i] for i in range(1000)]
        assert gc.get_freeze_count() == frozen  # not thawed
        assert id(made) not in {id(o) for o in gc.get_objects(generation=2)}
    finally:
        gc.unfreeze()
