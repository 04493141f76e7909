"""The shm slot ring: layout, leases, permissions, unlink and the stale-segment sweep."""

from __future__ import annotations

import asyncio
import fcntl
import os
import re
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from beton_serve.errors import TransportError
from beton_serve.transport import ShmFactory, ShmNamer, ShmRing, sweep_stale_segments
from beton_serve.transport.shm import StaleSweeper
from beton_wire.slots import ALIGN, slot_layout
from helpers.shm_markers import MarkerHolder, dead_pid

SHM = Path("/dev/shm")


def _layout():
    return slot_layout([("image", (4, 5, 3), "uint8"), ("label", (), "int64")], batch_size=8)


def test_layout_is_aligned_and_deterministic() -> None:
    lay = _layout()
    assert lay == _layout()
    img, lab = lay.tensors
    assert img.offset == 0 and img.sample_bytes == 60
    assert lab.offset % ALIGN == 0 and lab.offset >= 60 * 8
    assert lay.slot_bytes % ALIGN == 0 and lay.slot_bytes >= lab.offset + 8 * 8
    with pytest.raises(ValueError, match="wire cannot carry"):
        slot_layout([("x", (1,), "datetime64")], 2)
    with pytest.raises(ValueError, match="batch_size"):
        slot_layout([("x", (1,), "uint8")], 0)


def test_ring_leases_and_views_share_memory() -> None:
    namer = ShmNamer()
    ring = ShmFactory(namer).create(_layout(), 3)
    try:
        path = SHM / ring.name
        assert re.fullmatch(rf"beton-{os.getpid()}-[0-9a-f]{{16}}-ring-0", ring.name)
        assert ring.name.startswith(namer.prefix)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        slots = [ring.acquire() for _ in range(3)]
        assert slots == [0, 1, 2] and ring.acquire() is None
        img, lab = ring.host_views(1)
        assert img.shape == (8, 4, 5, 3) and lab.shape == (8,) and lab.dtype == np.int64
        img[:] = 7
        lab[:] = np.arange(8)
        # a second, independent mapping (what the client does) sees the bytes
        with open(path, "rb") as f:
            f.seek(ring.layout.slot_offset(1) + ring.layout.tensors[1].offset)
            assert np.array_equal(np.frombuffer(f.read(64), np.int64), np.arange(8))
        assert ring.release(1) is False  # FILLING, not yet leased
        ring.publish(1, 8)
        assert ring.leased() == 3
        assert ring.release(1) is True and ring.release(1) is False
        ring.abandon(0)
        assert ring.leased() == 1
        assert ring.acquire() == 0
        with pytest.raises(TransportError, match="without being filled"):
            ring.publish(1, 8)
    finally:
        ring.close()
    assert not (SHM / ring.name).exists()
    ring.close()  # idempotent
    assert ring.acquire() is None


def test_ring_refuses_an_existing_name() -> None:
    ring = ShmRing(_layout(), 1, "beton-0-test-dup")
    try:
        with pytest.raises(TransportError, match="cannot create"):
            ShmRing(_layout(), 1, "beton-0-test-dup")
    finally:
        ring.close()


def test_sweep_removes_only_dead_pids(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead_pid = int(dead.stdout)
    stale = tmp_path / f"beton-{dead_pid}-ring-0"
    live = tmp_path / f"beton-{os.getpid()}-ring-0"
    other = tmp_path / "not-beton"
    for p in (stale, live, other):
        p.write_bytes(b"x")
    removed = sweep_stale_segments(tmp_path)
    assert removed == [stale.name]
    assert not stale.exists() and live.exists() and other.exists()


def test_names_are_unpredictable_so_no_one_can_take_them_first(tmp_path: Path) -> None:
    """Another user could create the names a daemon uses next; the daemon's O_EXCL would then
    refuse every ring (and the notice socket). Each namer draws a random instance."""
    a, b = ShmNamer(), ShmNamer()
    assert a.next("ring") != b.next("ring")  # same pid, same purpose, same counter
    assert a.prefix != b.prefix and len({ShmNamer().instance for _ in range(100)}) == 100


def test_a_live_marker_is_held_and_removed_on_close(tmp_path: Path) -> None:
    namer = ShmNamer(shm_dir=tmp_path, mark_live=True)
    live = tmp_path / (namer.prefix + "live")
    assert stat.S_IMODE(live.lstat().st_mode) == 0o600
    assert os.listdir(tmp_path) == [live.name]  # no hidden creation name left behind
    ring_file = tmp_path / namer.next("ring")
    ring_file.write_bytes(b"x")
    assert sweep_stale_segments(tmp_path) == []  # held by this process: left alone
    namer.close()
    namer.close()
    assert not live.exists() and ring_file.exists()


def test_sweep_goes_by_the_marker_not_the_pid(tmp_path: Path) -> None:
    """A daemon in another PID namespace (a container sharing /dev/shm) names its segments
    with a pid that may be dead here, or this very process's: its held marker keeps them.
    Once nobody holds a marker (its daemon was killed), its group goes, whatever the pid,
    this process's own too (a daemon restarted as PID 1 in a container meets its
    predecessor's names)."""
    for pid in (dead_pid(), os.getpid()):
        holder = MarkerHolder(tmp_path, pid)
        prefix, ring = holder.prefix, holder.ring
        try:
            sock = tmp_path / f"{prefix}notice-1"
            s = socket.socket(socket.AF_UNIX)
            s.bind(str(sock))
            s.close()
            assert sweep_stale_segments(tmp_path) == []  # its daemon lives
            assert ring.exists() and sock.exists()
        finally:
            holder.release()
        removed = sweep_stale_segments(tmp_path)
        assert sorted(removed) == sorted([ring.name, sock.name, f"{prefix}live"])
        assert removed[-1] == f"{prefix}live"  # the marker last
        assert os.listdir(tmp_path) == []


def test_sweep_of_unmarked_names_goes_by_the_pid(tmp_path: Path) -> None:
    """Names without a marker (an unmarked namer, a release before markers) are stale when
    no process of their pid runs here."""
    dead, me = dead_pid(), os.getpid()
    files = {
        "dead_new": tmp_path / f"beton-{dead}-{'a' * 16}-ring-0",
        "dead_old": tmp_path / f"beton-{dead}-ring-0",
        "mine_new": tmp_path / f"beton-{me}-{'b' * 16}-ring-0",
        "mine_old": tmp_path / f"beton-{me}-ring-0",
    }
    for f in files.values():
        f.write_bytes(b"x")
    assert sorted(sweep_stale_segments(tmp_path)) == sorted(
        [files["dead_new"].name, files["dead_old"].name]
    )
    assert files["mine_new"].exists() and files["mine_old"].exists()


def _receiver_of(ring: ShmRing) -> Any:
    """The client's mapping of ``ring`` (id table and release words included)."""
    from beton_client._transport.shm import ShmReceiver

    setup = ring.setup()
    return ShmReceiver(
        setup.segment,
        setup.segment_bytes,
        ring.slot_count,
        setup.slot_bytes,
        ids_offset=setup.ids_offset,
        release_offset=setup.release_offset,
    )


def test_id_table_and_release_words_are_seen_by_the_client() -> None:
    from beton_wire import notice

    ring = ShmFactory(ShmNamer()).create(_layout(), 3)
    rx = None
    try:
        setup = ring.setup()
        assert setup.ids_offset == 3 * ring.layout.slot_bytes
        assert setup.release_offset == setup.ids_offset + 8 * 8 * 3
        rx = _receiver_of(ring)
        assert rx.has_release_words
        slots = [ring.acquire(), ring.acquire()]
        for s in slots:
            ring.write_ids(s, np.arange(5, dtype=np.uint64) + 100 * s)
            ring.publish(s, 5)
            ring.arm(s, notice.lease_token(2, s, 10))
        assert rx.ids(slots[1], 5).tolist() == [100, 101, 102, 103, 104]
        assert ring.reap() == []  # nothing released yet
        assert ring.leased() == 2
        # A stale token (another lease of the slot) releases nothing.
        assert not rx.release_word(slots[0], notice.lease_token(1, 0, 10), 7)
        assert ring.reap() == []
        ring.starved = True
        assert rx.release_word(slots[0], notice.lease_token(2, 0, 10), 9)  # sees "starved"
        assert ring.reap() == [slots[0]] and ring.client_wait_us() == 9
        assert ring.reap() == []  # disarmed: reaped once
        ring.starved = False
        assert not rx.release_word(slots[1], notice.lease_token(2, 1, 10), 12)
        assert ring.reap() == [slots[1]]
    finally:
        if rx is not None:
            rx.close()
        ring.close()


def test_a_word_left_from_the_slots_last_lease_is_not_a_release_of_the_same_batch_again() -> None:
    """A token names a batch of an epoch, not a lease: when the client reads the same epoch
    again, batch 1 may come back in the slot it had last time, with the same token. Arming
    clears the word, so the store left from last time is not taken for a release (it was:
    the daemon then decoded the next batch into the slot the client was about to read)."""
    from beton_wire import notice

    ring = ShmFactory(ShmNamer()).create(_layout(), 2)
    rx = _receiver_of(ring)
    try:
        token = notice.lease_token(3, 1, 10)
        for _pass in range(2):  # epoch 3's batch 1 in the same slot, twice
            slot = ring.acquire()
            assert slot == 0
            ring.publish(slot, 5)
            ring.arm(slot, token)
            assert ring.reap() == []  # not released yet, whatever the word held before
            rx.release_word(slot, token, 0)
            assert ring.reap() == [slot]
            assert ring.release(slot)
    finally:
        rx.close()
        ring.close()


def test_a_vanished_shared_batch_segment_is_segment_gone_and_ends_the_stream() -> None:
    """A SIGTERM drain frees a stream's segments while a notice for a batch in a sharing arena may
    still be unread. The client must report the stream's end (the Batches call's status, e.g.
    ShuttingDown), not a TransportError, so that a Loader allowed to reconnect resumes at that
    batch (tests/integration/test_resume.py covers it end to end)."""
    from types import SimpleNamespace

    from beton_client._stream import _Stream
    from beton_client._transport.shm import SegmentGone, ShmReceiver
    from beton_client.errors import ServerUnavailable
    from beton_client.errors import TransportError as ClientTransportError

    ring = ShmFactory(ShmNamer()).create(_layout(), 2)
    rx = None
    try:
        setup = ring.setup()
        rx = ShmReceiver(setup.segment, setup.segment_bytes, 2, setup.slot_bytes)
        owner = "-".join(setup.segment.split("-", 2)[:2])
        with pytest.raises(SegmentGone, match="is gone"):
            rx.arrays_at(f"{owner}-share-999", 0, [])
        with pytest.raises(ClientTransportError, match="not a segment of this daemon"):
            rx.arrays_at("beton-1-share-0" if owner != "beton-1" else "beton-2-share-0", 0, [])
    finally:
        if rx is not None:
            rx.close()
        ring.close()

    # The stream's error is the call's final status when it comes ...
    drained = ServerUnavailable("shutting down", server_error="ShuttingDown")

    def recv() -> None:
        raise drained

    done = SimpleNamespace(_call=SimpleNamespace(done=lambda: True), recv=recv, target="t")
    assert _Stream.lost(done, SegmentGone("gone"), wait_s=0.01) is drained  # type: ignore[arg-type]
    # ... else a plain ServerUnavailable (retriable), after the bounded wait.
    alive = SimpleNamespace(_call=SimpleNamespace(done=lambda: False), recv=recv, target="t")
    err = _Stream.lost(alive, SegmentGone("gone"), wait_s=0.05)  # type: ignore[arg-type]
    assert type(err) is ServerUnavailable and err.server_error == "" and "gone" in str(err)


def test_sweep_removes_an_old_unheld_hidden_marker(tmp_path: Path) -> None:
    """A daemon killed between creating its hidden marker and linking it into place left a
    0-byte ``.beton-...-live`` that no sweep removed. One older than the grace time, held by
    nobody, goes; a fresh one (a daemon starting now), a held one and other hidden names stay."""
    from beton_serve.transport.shm import HIDDEN_MARKER_GRACE_S

    old = time.time() - HIDDEN_MARKER_GRACE_S - 5
    stale = tmp_path / f".beton-{os.getpid()}-{'c' * 16}-live"
    fresh = tmp_path / f".beton-{os.getpid()}-{'d' * 16}-live"
    held = tmp_path / f".beton-{os.getpid()}-{'e' * 16}-live"
    other = tmp_path / f".beton-{os.getpid()}-{'f' * 16}-ring-0"
    for f in (stale, fresh, held, other):
        f.write_bytes(b"")
    for f in (stale, held, other):
        os.utime(f, (old, old))
    fd = os.open(held, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert sweep_stale_segments(tmp_path) == [stale.name]
    finally:
        os.close(fd)
    assert sorted(os.listdir(tmp_path)) == sorted([fresh.name, held.name, other.name])


def test_a_dtype_this_client_does_not_know_is_a_clear_transport_error() -> None:
    """A daemon of a newer release may send a wire dtype this client does not know: it raised
    a bare ``IndexError`` while the stream opened."""
    from beton_client._tail import OutputInfo
    from beton_client.errors import TransportError
    from beton_wire.slots import DTYPE_NAMES, dtype_name
    from beton_wire.v1 import beton_pb2 as pb

    assert [dtype_name(i) for i in range(1, len(DTYPE_NAMES))] == list(DTYPE_NAMES[1:])
    assert OutputInfo.from_wire(pb.OutputSpec(name="x", dtype=13)).dtype == "complex64"
    for code in (0, len(DTYPE_NAMES), 99):
        with pytest.raises(TransportError, match=f"wire dtype {code}, which this client"):
            OutputInfo.from_wire(pb.OutputSpec(name="x", dtype=code))


@pytest.mark.parametrize("code", [0, 15, 99])
def test_a_batch_message_with_an_unknown_dtype_is_a_transport_error(code: int) -> None:
    """The check of the open reply's dtypes was not made on each batch message's own (the
    Batches call without a notice channel): ``IndexError``, or dtype ``''`` for 0."""
    from beton_client._stream import _Stream
    from beton_client.errors import TransportError
    from beton_wire.v1 import beton_pb2 as pb

    def message(dtype: int) -> pb.ServerMessage:
        tensor = pb.TensorDesc(name="x", shape=[1], dtype=dtype, offset=0, nbytes=8)
        return pb.ServerMessage(batch=pb.BatchReady(epoch=0, batch_index=0, tensors=[tensor]))

    assert _Stream._from_message(message(13)).tensors[0].dtype == "complex64"
    with pytest.raises(TransportError, match=f"wire dtype {code}, which this client"):
        _Stream._from_message(message(code))


def test_sweep_names_a_held_group_whose_pid_is_gone(tmp_path: Path) -> None:
    """A group whose marker is locked while no process of its pid runs (a daemon killed a
    moment ago, its last threads still exiting) is left, and named in ``departed``; a held
    group of a live pid (this process's, or pid 1) is left and not named."""
    holders = [MarkerHolder(tmp_path, pid) for pid in (dead_pid(), os.getpid(), 1)]
    try:
        departed: list[str] = []
        assert sweep_stale_segments(tmp_path, departed=departed) == []
        assert departed == [holders[0].prefix]
        assert all(h.ring.exists() for h in holders)
    finally:
        for h in holders:
            h.release()
    departed = []
    assert len(sweep_stale_segments(tmp_path, departed=departed)) == 6
    assert departed == [] and os.listdir(tmp_path) == []


def _run_loop_until(loop: Any, done: Any, timeout: float) -> None:
    async def wait() -> None:
        deadline = loop.time() + timeout
        while not done() and loop.time() < deadline:
            await asyncio.sleep(0.02)

    loop.run_until_complete(wait())


def test_the_sweeper_sweeps_a_killed_daemons_group_once_its_lock_is_free(tmp_path: Path) -> None:
    """A daemon started right after ``kill -9`` of its predecessor found that daemon's marker
    still locked and left its segments until the next start. The sweeper sweeps again after
    its start, and stops once a sweep leaves no such group."""
    holder = MarkerHolder(tmp_path, dead_pid())
    loop = asyncio.new_event_loop()
    sweeper = StaleSweeper(tmp_path, delays=(0.2, 0.4, 0.6))
    sweeps = []
    real = sweeper.sweep
    sweeper.sweep = lambda: sweeps.append(loop.time()) or real()  # type: ignore[method-assign]
    try:
        assert sweeper.sweep() == [] and sweeper.pending == [holder.prefix]
        sweeper.start(loop)
        _run_loop_until(loop, lambda: len(sweeps) >= 2, 5.0)
        assert len(sweeps) == 2 and holder.ring.exists()  # still held at the first re-sweep
        holder.release()
        _run_loop_until(loop, lambda: not holder.ring.exists(), 5.0)
        assert os.listdir(tmp_path) == [] and sweeper.pending == []
        _run_loop_until(loop, lambda: False, 0.8)  # nothing left to sweep for: no more sweeps
        assert len(sweeps) == 3
    finally:
        sweeper.close()
        holder.release()
        loop.close()


def test_the_sweeper_gives_up_after_its_delays_and_close_cancels(tmp_path: Path) -> None:
    """A group held for good (a live daemon in another PID namespace) is looked at once per
    delay, then left; ``close`` cancels a sweep still due."""
    holder = MarkerHolder(tmp_path, dead_pid())
    loop = asyncio.new_event_loop()
    try:
        sweeper = StaleSweeper(tmp_path, delays=(0.05, 0.1))
        count = [0]
        real = sweeper.sweep
        sweeper.sweep = lambda: count.__setitem__(0, count[0] + 1) or real()  # type: ignore[method-assign]
        sweeper.sweep()
        sweeper.start(loop)
        _run_loop_until(loop, lambda: False, 0.6)
        assert count[0] == 3 and holder.ring.exists()  # the start's sweep and one per delay
        closed = StaleSweeper(tmp_path, delays=(0.05,))
        closed.sweep()
        closed.start(loop)
        closed.close()
        closed.close()
        closed.start(loop)  # a closed sweeper schedules nothing
        before = os.listdir(tmp_path)
        holder.release()
        _run_loop_until(loop, lambda: False, 0.3)
        assert sorted(os.listdir(tmp_path)) == sorted(before)  # no sweep ran after close
    finally:
        holder.release()
        loop.close()
