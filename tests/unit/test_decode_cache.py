"""Issue 16: the decode-group cache (``beton_serve.fields.decode_cache``) on its own.

The "decode" here is a counted function that returns an array naming its sample, so every
test checks both how often samples were decoded and that each member got the right pixels.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter, deque

import numpy as np
import pytest
from beton_serve.errors import SpecError
from beton_serve.fields.decode_cache import (
    MAX_DECODE_CACHE_BYTES,
    DecodeBinding,
    DecodeCache,
    GroupKey,
    current_member,
    decode_key,
    decode_scope,
)

KEY = GroupKey(dataset="d", field="image", order="RANDOM/1", label="x.beton")
N = 64
SIDE = 4  # images are SIDE x SIDE x 3 bytes
NBYTES = SIDE * SIDE * 3


class Decoder:
    """Counts decodes per sample; the image of sample ``s`` is filled with ``s % 251``."""

    def __init__(self, delay: float = 0.0) -> None:
        self.count: Counter[int] = Counter()
        self.delay = delay
        self.lock = threading.Lock()

    def __call__(self, sid: int):
        def decode() -> np.ndarray:
            with self.lock:
                self.count[sid] += 1
            if self.delay:
                time.sleep(self.delay)
            return np.full((SIDE, SIDE, 3), sid % 251, np.uint8)

        return decode


def join(cache: DecodeCache, key: GroupKey = KEY, n: int = N):
    """A member whose stream is running (what ``decode_scope`` marks)."""
    m = cache.join(key, n)
    m.active = True
    return m


def take(m, sid: int, epoch: int, dec: Decoder) -> None:
    img = m.get(sid, epoch, NBYTES, dec(sid))
    assert img.shape == (SIDE, SIDE, 3) and (img == sid % 251).all()
    assert not img.flags.writeable


def test_four_members_decode_each_sample_once_and_free_everything() -> None:
    cache = DecodeCache(max_bytes=1 << 20)
    members = [join(cache) for _ in range(4)]
    dec = Decoder()
    order = np.random.default_rng(0).permutation(N)
    for epoch in range(2):
        for sid in order:  # interleaved, as members in step would read
            for m in members:
                take(m, int(sid), epoch, dec)
    assert all(dec.count[s] == 2 for s in range(N))  # once per epoch
    (st,) = cache.stats()
    assert (st.members, st.delivered, st.decoded, st.hits) == (4, 4 * 2 * N, 2 * N, 3 * 2 * N)
    assert st.live == 0 and cache.nbytes == 0  # every entry freed once all four took it
    for m in members:
        m.close()
    assert cache.stats() == []


def test_concurrent_askers_wait_for_the_one_decode() -> None:
    cache = DecodeCache(max_bytes=1 << 20)
    members = [join(cache) for _ in range(4)]
    dec = Decoder(delay=0.05)
    barrier = threading.Barrier(4, timeout=10)
    errors: list[BaseException] = []

    def run(m) -> None:
        try:
            for sid in range(8):
                barrier.wait()
                take(m, sid, 0, dec)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(m,)) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors
    assert all(dec.count[s] == 1 for s in range(8))
    assert cache.stats()[0].waits > 0


def _decode_in_flight(cache: DecodeCache, m, sid: int) -> tuple[threading.Event, threading.Thread]:
    """``m`` starts decoding ``sid`` on a thread and holds it in flight until the returned event
    is set (its image is filled with ``sid``); returns once the pending entry is in the cache."""
    go = threading.Event()
    before = cache.stats()[0].live  # m's group (it has members, so it is listed)

    def slow() -> np.ndarray:
        go.wait(10)
        return np.full((SIDE, SIDE, 3), sid % 251, np.uint8)

    t = threading.Thread(target=lambda: m.get(sid, 0, NBYTES, slow))
    t.start()
    while cache.stats()[0].live <= before:
        time.sleep(0.001)
    return go, t


def test_no_wait_returns_none_while_another_member_decodes() -> None:
    cache = DecodeCache(max_bytes=1 << 20)
    a, b = join(cache), join(cache)
    go, t = _decode_in_flight(cache, a, 9)
    assert b.get(9, 0, NBYTES, Decoder()(9), wait=False) is None
    assert cache.stats()[0].delivered == 1  # nothing counted for the refused call
    go.set()
    t.join(10)
    take(b, 9, 0, Decoder())
    assert cache.stats()[0].hits == 1 and cache.nbytes == 0


def test_take_ready_takes_only_ready_entries_in_one_call_and_counts_as_get_does() -> None:
    """``take_ready`` is ``get``'s hit branch for a batch: ready entries are taken (counted, and
    freed once their last holder took them); absent and in-flight ones are left untouched."""
    cache = DecodeCache(max_bytes=1 << 20)
    a, b = join(cache), join(cache)
    dec = Decoder()
    for sid in (1, 2):
        take(a, sid, 0, dec)  # published for b
    go, t = _decode_in_flight(cache, a, 3)
    before = cache.stats()[0]
    got = b.take_ready([2, 3, 1, 4], 0)
    assert [None if g is None else int(g[0, 0, 0]) for g in got] == [2, None, 1, None]
    assert all(not g.flags.writeable for g in got if g is not None)
    st = cache.stats()[0]
    assert (st.hits, st.delivered, st.decoded) == (before.hits + 2, before.delivered + 2, 3)
    assert st.live == 1  # 1 and 2 freed (b was their last holder); 3 still in flight
    go.set()
    t.join(10)
    # what take_ready left is get's, as before: a hit on 3, b's own decode of 4
    take(b, 3, 0, dec)
    take(b, 4, 0, dec)
    assert dec.count[4] == 1 and cache.nbytes == NBYTES  # 4 is held for a, which has not read it
    st = cache.stats()[0]
    assert (st.hits, st.decoded) == (3, 4)


def test_byte_bound_holds_and_a_laggard_detaches_and_stays_correct() -> None:
    budget = 10 * NBYTES
    cache = DecodeCache(max_bytes=budget)
    fast = [join(cache) for _ in range(3)]
    slow = join(cache)
    dec = Decoder()
    for sid in range(N):  # the slow member does not read at all during the epoch
        for m in fast:
            take(m, sid, 0, dec)
        assert cache.nbytes <= budget
    assert cache.peak_bytes <= budget
    st = cache.stats()[0]
    assert st.detached == 1 and st.evicted > 0
    assert slow.detached and not any(m.detached for m in fast)
    # the laggard's pending entries were released: nothing is held for it any more
    assert cache.nbytes <= budget
    for sid in range(N):
        take(slow, sid, 0, dec)  # decodes what was evicted, alone, correctly
    # the fast ones shared each decode: one decode per sample, plus the laggard's own
    assert sum(dec.count.values()) <= N + N
    assert cache.stats()[0].live == 0 or cache.nbytes <= budget


def test_a_detached_member_that_catches_up_attaches_again() -> None:
    cache = DecodeCache(max_bytes=4 * NBYTES)
    a, b = join(cache), join(cache)
    dec = Decoder()
    for sid in range(8):  # b falls behind the 4-entry window
        take(a, sid, 0, dec)
    assert b.detached
    for sid in range(8):  # still behind a: decodes alone, publishes nothing
        take(b, sid, 0, dec)
    assert b.detached and cache.nbytes == 0
    take(b, 8, 0, dec)  # a has not read 8 yet: b caught up, attaches, and shares its decode
    assert not b.detached
    take(a, 8, 0, dec)
    assert dec.count[8] == 1 and cache.nbytes == 0


def test_a_member_joining_mid_epoch_shares_from_its_position() -> None:
    cache = DecodeCache(max_bytes=1 << 20)
    first = [join(cache) for _ in range(3)]
    dec = Decoder()
    half = N // 2
    for sid in range(half):
        for m in first:
            take(m, sid, 0, dec)
    late = join(cache)  # e.g. resumed from a checkpoint at position N // 2
    for sid in range(half, N):
        for m in [*first, late]:
            take(m, sid, 0, dec)
    assert all(dec.count[s] == 1 for s in range(N))
    assert cache.nbytes == 0
    # next epoch: the late member is a holder of the first half too
    for sid in range(N):
        for m in [*first, late]:
            take(m, sid, 1, dec)
    assert all(dec.count[s] == 2 for s in range(N)) and cache.nbytes == 0


def test_a_member_behind_by_an_epoch_never_pins_entries_of_the_others() -> None:
    cache = DecodeCache(max_bytes=1 << 20)
    a, b = join(cache), join(cache)
    dec = Decoder()
    for sid in range(N):
        take(a, sid, 0, dec)  # b is a holder of every one of these
    assert cache.stats()[0].live == N
    for sid in range(N):
        take(b, sid, 0, dec)
    assert cache.nbytes == 0 and sum(dec.count.values()) == N


def test_a_member_that_never_runs_is_held_for_nothing() -> None:
    """E.g. a stream that an identical stream produces for (issue 6), or an idle Loader."""
    cache = DecodeCache(max_bytes=1 << 20)
    a = join(cache)
    idle = cache.join(KEY, N)  # not marked active: its stream has run no batch
    dec = Decoder()
    for sid in range(N):
        take(a, sid, 0, dec)
    assert cache.nbytes == 0 and not idle.detached
    md = np.zeros(1)
    with decode_scope(DecodeBinding({int(md.__array_interface__["data"][0]): idle}), 0):
        pass
    assert idle.active  # running a batch makes it a member that entries are held for


def test_closing_a_member_frees_what_only_it_held() -> None:
    cache = DecodeCache(max_bytes=1 << 20)
    a, b = join(cache), join(cache)
    dec = Decoder()
    for sid in range(10):
        take(a, sid, 0, dec)
    assert cache.nbytes == 10 * NBYTES
    b.close()
    b.close()  # idempotent
    assert cache.nbytes == 0


def test_a_failed_decode_propagates_and_caches_nothing() -> None:
    cache = DecodeCache(max_bytes=1 << 20)
    a, b = join(cache), join(cache)

    def bad() -> np.ndarray:
        raise ValueError("corrupt")

    with pytest.raises(ValueError, match="corrupt"):
        a.get(3, 0, NBYTES, bad)
    assert cache.nbytes == 0
    with pytest.raises(ValueError, match="corrupt"):
        b.get(3, 0, NBYTES, bad)  # b decodes for itself and fails the same way


def test_a_member_waiting_on_a_decode_that_fails_wakes_and_decodes_itself() -> None:
    """The waiter's Event is made only when someone waits; a failed decode still wakes it at
    once (well before ``wait_s``), and it then decodes for itself."""
    cache = DecodeCache(max_bytes=1 << 20, wait_s=30.0)
    a, b = join(cache), join(cache)
    go = threading.Event()
    errors: list[BaseException] = []

    def bad() -> np.ndarray:
        go.wait(10)
        raise ValueError("corrupt")

    def run_a() -> None:
        try:
            a.get(4, 0, NBYTES, bad)
        except ValueError as exc:
            errors.append(exc)

    t = threading.Thread(target=run_a)
    t.start()
    while not cache.nbytes:  # a's decode is in flight
        time.sleep(0.001)
    waiter_result: list[np.ndarray] = []
    w = threading.Thread(target=lambda: waiter_result.append(b.get(4, 0, NBYTES, Decoder()(4))))
    w.start()
    while not cache.stats()[0].waits:  # b is waiting on a's entry
        time.sleep(0.001)
    start = time.monotonic()
    go.set()
    t.join(10)
    w.join(10)
    assert time.monotonic() - start < 5  # woken by the failure, not by the 30 s timeout
    assert len(errors) == 1 and len(waiter_result) == 1
    assert (waiter_result[0] == 4).all()  # b's own decode (Decoder fills with the id)
    st = cache.stats()[0]
    assert (st.hits, st.decoded, st.waits) == (0, 2, 1) and cache.nbytes == 0


def test_groups_are_separate_and_the_budget_is_shared() -> None:
    cache = DecodeCache(max_bytes=6 * NBYTES)
    other = GroupKey(dataset="d", field="image", order="RANDOM/2")
    g1 = [join(cache) for _ in range(2)]
    g2 = [join(cache, other) for _ in range(2)]
    dec = Decoder()
    for sid in range(4):
        take(g1[0], sid, 0, dec)
        take(g2[0], sid, 0, dec)
        assert cache.nbytes <= 6 * NBYTES
    assert dec.count[0] == 2  # no sharing across different orders
    assert len(cache.stats()) == 2


def test_an_image_larger_than_the_budget_is_decoded_alone() -> None:
    cache = DecodeCache(max_bytes=NBYTES - 1)
    a, b = join(cache), join(cache)
    dec = Decoder()
    take(a, 1, 0, dec)
    take(b, 1, 0, dec)
    assert dec.count[1] == 2 and cache.peak_bytes == 0


def test_budget_limits() -> None:
    with pytest.raises(SpecError, match="decode_cache_bytes"):
        DecodeCache(max_bytes=MAX_DECODE_CACHE_BYTES + 1)
    with pytest.raises(SpecError):
        DecodeCache(max_bytes=-1)
    cache = DecodeCache(max_bytes=0)  # caching off: members decode alone
    a, b = join(cache), join(cache)
    dec = Decoder()
    take(a, 0, 0, dec)
    take(b, 0, 0, dec)
    assert dec.count[0] == 2


def test_scope_is_per_thread_checked_against_the_column_and_reset() -> None:
    cache = DecodeCache()
    md = np.zeros(N, np.int64)
    other = np.zeros(N, np.int64)
    m = join(cache)
    binding = DecodeBinding({int(md.__array_interface__["data"][0]): m})
    assert current_member(md) is None
    seen: list[object] = []
    with decode_scope(binding, 5):
        assert current_member(md) == (m, 5)
        assert current_member(other) is None  # another file or field: decode alone
        t = threading.Thread(target=lambda: seen.append(current_member(md)))
        t.start()
        t.join()
    assert seen == [None]  # the scope is this thread's only
    assert current_member(md) is None
    with decode_scope(None, 0):
        assert current_member(md) is None
    binding.close()
    with decode_scope(binding, 0):
        assert current_member(md) is None  # a closed member is never used


# -- the share_decode loop of the crop decoders ----------------------------------------------
def _run(op, md, state, ids, seed_key=None) -> np.ndarray:
    from beton_serve.format import memory_read
    from beton_serve.pipeline import State

    op.accept_globals(md, memory_read)
    st, _ = op.declare_state_and_memory(
        State(jit_mode=True, device="cpu", shape=None, dtype=np.uint8)
    )
    fn = op.generate_code()
    dst = np.empty((len(ids), *st.shape), np.uint8)
    args = [np.asarray(ids, np.uint64), dst, md, state]
    if getattr(fn, "with_seed", False):
        args.append(seed_key)
    return np.array(fn(*args))


@pytest.mark.parametrize("name", ["images_raw", "images_jpg", "images_smart"])
def test_share_decode_gives_ffcv_pixels_alone_and_in_a_group(fixtures_dir, name: str) -> None:
    """A full decode + OpenCV resize is FFCV's exact output; the group changes nothing."""
    from beton_serve.fields.decoders import CenterCropRGBImageDecoder
    from beton_serve.format import BetonReader

    expected = np.load(fixtures_dir / f"{name}.expected.npz")["image"]
    with BetonReader(fixtures_dir / f"{name}.beton") as r:
        md, n = r.field_metadata("image"), r.num_samples
        alone = _run(
            CenterCropRGBImageDecoder((64, 64), 1.0, resize="cv2", share_decode=True),
            md,
            r.storage_state,
            range(n),
        )
        np.testing.assert_array_equal(alone, expected)
        cache = DecodeCache()
        members = [join(cache, n=n) for _ in range(2)]
        addr = int(md.__array_interface__["data"][0])
        for m in members:
            with decode_scope(DecodeBinding({addr: m}), 0):
                got = _run(
                    CenterCropRGBImageDecoder((64, 64), 1.0, resize="cv2", share_decode=True),
                    md,
                    r.storage_state,
                    range(n),
                )
            np.testing.assert_array_equal(got, expected)
        st = cache.stats()[0]
        jpegs = int((np.asarray(md["mode"]) == 0).sum())
        assert st.decoded == jpegs and st.hits == jpegs and cache.nbytes == 0  # raw: no decode


@pytest.mark.parametrize("min_side", [0, 4])  # full-size and 1/4-scale shared decodes
def test_a_corrupt_jpeg_names_its_sample_alone_and_in_a_group(min_side: int) -> None:
    import simplejpeg
    from beton_serve.fields.decoders import RandomResizedCropRGBImageDecoder
    from beton_serve.jpeg import CorruptJPEGError

    good = simplejpeg.encode_jpeg(np.full((16, 16, 3), 100, np.uint8), quality=90)
    bad = good[: len(good) // 2]
    data = np.frombuffer(good + bad, np.uint8)
    ptrs = np.array([0, len(good)], np.uint64)
    sizes = np.array([len(good), len(bad)], np.uint64)
    md = np.zeros(
        2,
        dtype=np.dtype([("mode", "u1"), ("width", "<u2"), ("height", "<u2"), ("data_ptr", "<u8")]),
    )
    md["width"], md["height"], md["data_ptr"] = 16, 16, ptrs
    state = (data, ptrs, sizes)
    cache = DecodeCache()
    key = dataclasses.replace(KEY, decode=decode_key(min_side))
    a, b = join(cache, key, n=2), join(cache, key, n=2)
    addr = (int(md.__array_interface__["data"][0]), decode_key(min_side))
    for binding in (None, DecodeBinding({addr: a}), DecodeBinding({addr: b})):
        op = RandomResizedCropRGBImageDecoder((8, 8), share_decode=True, share_min_side=min_side)
        with decode_scope(binding, 0), pytest.raises(CorruptJPEGError) as info:
            _run(op, md, state, [0, 1], seed_key=np.uint64(7))
        assert info.value.sample_index == 1 and info.value.op == type(op).__name__
    assert cache.nbytes == 0  # sample 0 was freed by b, sample 1 never cached
    assert cache.stats()[0].hits == 1  # b took a's decode of sample 0: the group was used


def test_stats_travel_on_the_stats_rpc() -> None:
    from beton_serve.daemon._messages import DaemonStats, DecodeGroupRow
    from beton_serve.rpc._convert import stats_message

    row = DecodeGroupRow(
        dataset="x.beton",
        field="image",
        order="abc",
        decode="min_side=160",
        members=4,
        detached=1,
        delivered=400,
        decoded=110,
        hits=290,
        evicted=3,
        live_bytes=1234,
        waits=5,
    )
    msg = stats_message(
        DaemonStats(
            pid=1,
            uptime_s=1.0,
            workers=2,
            streams=(),
            datasets=(),
            shm_bytes=0,
            compiled_plans=0,
            streams_opened=0,
            decode_groups=(row,),
        )
    )
    (g,) = msg.decode_groups
    got = (g.dataset, g.decode, g.members, g.detached, g.delivered, g.decoded, g.live_bytes)
    assert got == ("x.beton", "min_side=160", 4, 1, 400, 110, 1234)
    assert (g.hits, g.evicted, g.waits) == (290, 3, 5)


@pytest.mark.timeout(30)
def test_a_collected_streams_members_leave_without_taking_the_lock() -> None:
    """The source's finalizer (``DecodeBinding.close_later``) may run, under the garbage
    collector, inside a section of this very thread that holds the cache's lock (it is not
    reentrant). It only queues the members; the next operation of the cache makes them leave.
    Before, it left at once and the daemon deadlocked (a 1,000-stream attack found it)."""
    cache = DecodeCache(max_bytes=1 << 20)
    a, b = join(cache), join(cache)
    b.active = True
    take(a, 1, 0, Decoder())  # an entry held for b
    assert cache.nbytes == NBYTES
    binding = DecodeBinding({0: b})
    with cache._lock:  # as if the collector ran the finalizer inside a locked section
        done = threading.Event()
        t = threading.Thread(target=lambda: (binding.close_later(), done.set()))
        t.start()
        assert done.wait(5), "close_later blocked on the cache's lock"
        binding.close_later()  # and on this thread too, holding the lock: returns at once
        t.join(5)
    assert not b.closed  # not yet: queued
    (st,) = cache.stats()  # the next operation: b leaves, and the entry held for it goes
    assert st.members == 1 and b.closed and cache.nbytes == 0
    c = join(cache)
    DecodeBinding({0: c}).close_later()  # the lock is free: it leaves at once
    assert c.closed and cache._later == deque() and cache.stats()[0].members == 1
    a.close()
    assert cache.stats() == []
