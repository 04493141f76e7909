# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""The daemon's stream memory budget (``max_ring_bytes``): streams cannot fill /dev/shm.

Every stream holds a ring of batch slots (shared memory, or the daemon's own memory for grpc
streams). Before the budget, any client of the daemon could open streams with large batches
until ``/dev/shm`` (half the RAM) was full, for every program on the host. Now a stream that
would take the open streams' rings past the budget is refused with ``ResourceExhausted``
(``RESOURCE_EXHAUSTED``), naming what it needs and what is held, and allocates nothing; it fits
again once other streams close. Only a ring's required slots (the batch the client holds and
its ``batches_ahead``) can get a stream refused; the deeper ring small slots get is granted only
as far as the rings stay within half the budget (``test_the_optional_depth_...`` below). The
other tests ask for ``batches_ahead=15``: 16 required slots, the deep ring's size, so that every
ring is the same size under any budget.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from beton_client import Loader, OrderOption, ResourceExhausted
from beton_serve.daemon import ring_budget
from beton_serve.fields.decoders import (
    CenterCropRGBImageDecoder,
    IntDecoder,
    SimpleRGBImageDecoder,
)
from helpers.daemon import daemon_factory, short_tmp, wait_for  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

#: 16 pairs of 32x24 RGB images: a 4-image batch slot is ~37 KB, so a ring is its slots.
FILE = "image_pairs"
#: Rings of ``PINNED_AHEAD + 1`` = 16 slots, all required (the deep ring's size): see above.
PINNED_AHEAD = 15


def _loader(
    address: str, batch_size: int = 4, transport: str = "shm", ahead: int = PINNED_AHEAD
) -> Loader:
    return Loader(
        FILE,
        batch_size=batch_size,
        order=OrderOption.SEQUENTIAL,
        pipelines={"input": [SimpleRGBImageDecoder()], "target": [SimpleRGBImageDecoder()]},
        server=address,
        transport=transport,
        spawn=False,
        batches_ahead=ahead,
    )


def _batches(batches) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(np.array(x), np.array(y)) for x, y in batches]


def _same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for (x1, y1), (x2, y2) in zip(a, b, strict=True):
        assert np.array_equal(x1, x2) and np.array_equal(y1, y2)


def _ring_of_one_stream(daemon_factory, fixtures_dir: Path) -> tuple[int, list]:
    """Bytes of one stream's ring (from a daemon with the default budget), and its epoch."""
    d = daemon_factory([fixtures_dir / f"{FILE}.beton"])
    with _loader(d.address) as ld:
        it = iter(ld)
        next(it)
        ring = d.stats().shm_bytes
        it.close()
        epoch = _batches(ld)
    assert ring > 100_000 and len(epoch) == 4
    d.stop()  # the next daemon takes its socket
    return ring, epoch


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_a_stream_past_the_budget_is_refused_until_another_closes(
    daemon_factory, fixtures_dir: Path, transport: str
) -> None:
    ring, epoch = _ring_of_one_stream(daemon_factory, fixtures_dir)
    budget = ring + ring // 2  # room for one stream, not two
    d = daemon_factory([fixtures_dir / f"{FILE}.beton"], args=["--max-ring-bytes", str(budget)])
    wait_for(lambda: f"max_ring_bytes={budget}" in d.log(), 15)  # logged at start
    first = _loader(d.address, transport=transport)
    try:
        it = iter(first)
        next(it)
        rings_before = sorted(d.segments())
        with pytest.raises(ResourceExhausted) as info:
            _loader(d.address, transport=transport)
        msg = str(info.value)
        assert "this stream needs" in msg and "1 open streams hold" in msg
        assert "--max-ring-bytes" in msg and info.value.code == "RESOURCE_EXHAUSTED"
        assert info.value.server_error == "ResourceExhausted"
        assert sorted(d.segments()) == rings_before  # the refused stream allocated nothing
        st = d.stats()
        assert len(st.streams) == 1 and st.max_ring_bytes == budget
        assert 0 < st.ring_bytes <= st.shm_bytes  # what the budget counts: the batch slots
        _same(_batches(it), epoch[1:])  # the admitted stream reads on, unharmed
    finally:
        first.close()
    wait_for(lambda: not d.stats().streams, 15)
    with _loader(d.address, transport=transport) as again:  # fits now, and reads right
        _same(_batches(again), epoch)
    assert d.proc.poll() is None


def test_a_stream_larger_than_the_whole_budget_says_so(daemon_factory, fixtures_dir: Path) -> None:
    d = daemon_factory([fixtures_dir / f"{FILE}.beton"], args=["--max-ring-bytes", "65536"])
    with pytest.raises(ResourceExhausted, match="more than the daemon's whole stream memory"):
        _loader(d.address, batch_size=16)
    assert not d.stats().streams and not d.segments()


def test_the_default_budget_is_half_of_dev_shm(tmp_path: Path) -> None:
    st = os.statvfs("/dev/shm")
    assert ring_budget(0) == st.f_blocks * st.f_frsize // 2
    assert ring_budget(123) == 123
    assert ring_budget(0, str(tmp_path / "missing")) == 0  # unreadable: no bound


def _smart(address: str, batch_size: int = 4) -> Loader:
    """A stream of the 24x24 centre crops of images_smart (as test_zero_copy_sharing's)."""
    return Loader(
        "images_smart",
        batch_size=batch_size,
        order=OrderOption.RANDOM,
        seed=3,
        pipelines={"image": [CenterCropRGBImageDecoder((24, 24), 0.8)], "label": [IntDecoder()]},
        server=address,
        spawn=False,
        batches_ahead=PINNED_AHEAD,
    )


def test_a_sharing_groups_arena_counts_against_the_budget(daemon_factory, fixtures_dir) -> None:
    """Two identical shm streams share decoding through an arena of ``slots + 2`` slots; once
    made it counts, so a third stream that fits beside two rings no longer fits beside them and
    the arena."""
    files = [fixtures_dir / "images_smart.beton"]
    d0 = daemon_factory(files)
    with _smart(d0.address) as ld:
        it = iter(ld)
        next(it)
        ring = d0.stats().ring_bytes  # one stream's slots: what the budget counts
        it.close()
    d0.stop()
    budget = 3 * ring + ring // 2  # three rings fit; two rings, an arena and a ring do not
    d = daemon_factory(files, args=["--max-ring-bytes", str(budget), "--share-retain", "16"])
    a, b = _smart(d.address), _smart(d.address)  # both open before either reads: a group
    try:
        ia, ib = iter(a), iter(b)
        for _ in range(3):
            got_a, got_b = next(ia), next(ib)
            assert all(np.array_equal(x, y) for x, y in zip(got_a, got_b, strict=True))
        wait_for(lambda: any("-share-" in s for s in d.segments()), 15)  # the group's arena
        held = d.stats().ring_bytes
        assert held > 2 * ring + ring // 2  # the arena counts
        with pytest.raises(ResourceExhausted, match="2 open streams hold"):
            _smart(d.address, batch_size=2)
    finally:
        a.close()
        b.close()


def test_an_arena_that_would_overshoot_the_budget_is_not_made_and_the_group_copies(
    daemon_factory, fixtures_dir
) -> None:
    """A group makes its arena after its streams were admitted. When the arena does not fit
    beside their rings it is not made: the group shares by copying into each member's ring, the
    budget holds at every step, and both streams get the same batches as a lone stream."""
    files = [fixtures_dir / "images_smart.beton"]
    d0 = daemon_factory(files)
    solo, ring = [], 0
    with _smart(d0.address) as ld:
        for x, y in ld:  # the first epoch, copied as it comes (slots are reused)
            solo.append((np.array(x), np.array(y)))
            ring = ring or d0.stats().ring_bytes
    d0.stop()
    budget = 2 * ring + ring // 2  # two rings fit; two rings and an arena (> a ring) do not
    d = daemon_factory(files, args=["--max-ring-bytes", str(budget), "--share-retain", "16"])
    a, b = _smart(d.address), _smart(d.address)  # both open before either reads: a group
    try:
        ia, ib = iter(a), iter(b)
        got_a, got_b = [], []
        for _ in range(len(solo)):
            got_a.append(tuple(np.array(t) for t in next(ia)))
            got_b.append(tuple(np.array(t) for t in next(ib)))
            assert d.stats().ring_bytes <= budget
        _same(got_a, solo)
        _same(got_b, solo)
        assert not any("-share-" in s for s in d.segments())  # no arena
        wait_for(lambda: "this group shares by copying" in d.log(), 10)
        (ds,) = d.stats().datasets
        assert ds.batches_decoded < 2 * len(solo)  # still shared: decoded once, not per stream
    finally:
        a.close()
        b.close()


def test_the_optional_depth_of_small_rings_never_gets_a_stream_refused(
    daemon_factory, fixtures_dir: Path
) -> None:
    """Small slots get a deeper ring than ``batches_ahead + 1`` (16 slots here), but only from
    the first half of the budget: on a budget that holds three streams' required 4 slots, the
    first stream gets 4 + 2, the second its 4, and only a third is refused, naming the 4 slots
    it needs. Every admitted stream reads exact batches, whatever its depth. (Before, each ring
    counted its 16 slots as required: the second stream was refused though its 4 fitted.)"""
    files = [fixtures_dir / f"{FILE}.beton"]
    d0 = daemon_factory(files)
    with _loader(d0.address, ahead=3) as ld:  # the default batches_ahead
        it = iter(ld)
        next(it)
        (st,) = d0.stats().streams
        slot_bytes = d0.stats().ring_bytes // st.slot_count
        it.close()
        epoch = _batches(ld)
    assert st.slot_count == 16  # the deep ring, with no budget to fit in
    d0.stop()
    base = 4 * slot_bytes  # the batch held and 3 ahead
    budget = 3 * base
    d = daemon_factory(files, args=["--max-ring-bytes", str(budget)])
    first = _loader(d.address, ahead=3)
    second = None
    try:
        it1 = iter(first)
        got1 = [next(it1)]
        second = _loader(d.address, ahead=3)
        slots = {s.stream_id: s.slot_count for s in d.stats().streams}
        assert sorted(slots.values()) == [4, 6]  # 4 + 2 within half the budget; then 4
        with pytest.raises(ResourceExhausted, match=r"needs .* \(4 slots of") as info:
            _loader(d.address, ahead=3)
        assert "2 open streams hold" in str(info.value)
        assert d.stats().ring_bytes <= budget
        got1 = [tuple(np.array(t) for t in got1[0]), *_batches(it1)]
        _same(got1, epoch)
        _same(_batches(second), epoch)
        _same(_batches(first), epoch)  # a second epoch on the deeper ring
    finally:
        first.close()
        if second is not None:
            second.close()
    assert d.proc.poll() is None
