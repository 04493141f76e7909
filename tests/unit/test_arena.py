"""``transport.arena.ShmArena``: group buffers in shared memory, unlinked only once every buffer
is back (or at once on ``force_close``)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest
from beton_serve.errors import TransportError
from beton_serve.transport.arena import ShmArena
from beton_serve.transport.shm import ShmNamer
from beton_wire.slots import slot_layout

SHM = Path("/dev/shm")


def _arena(count: int = 2) -> ShmArena:
    layout = slot_layout([("image", (4, 4, 3), "uint8"), ("label", (), "int64")], batch_size=4)
    return ShmArena(layout, count, ShmNamer().next("share"))


def test_buffers_are_views_of_one_private_segment() -> None:
    arena = _arena()
    try:
        assert stat.S_IMODE(os.stat(arena.path).st_mode) == 0o600
        i, views = arena.take()  # type: ignore[misc]
        views[1][:] = np.arange(4)
        raw = np.frombuffer(arena.path.read_bytes(), np.uint8)
        lab = arena.layout.tensors[1]
        off = arena.offset(i) + lab.offset
        assert raw[off : off + 32].view(np.int64).tolist() == [0, 1, 2, 3]
        j, _ = arena.take()  # type: ignore[misc]
        assert {i, j} == {0, 1} and arena.take() is None and arena.in_use() == 2
        arena.give(i)
        arena.give(i)  # twice: ignored
        assert arena.in_use() == 1
    finally:
        arena.force_close()
    assert arena.unlinked and not arena.path.exists()


def test_close_waits_for_every_buffer_to_come_back() -> None:
    arena = _arena()
    a, _ = arena.take()  # type: ignore[misc]
    b, _ = arena.take()  # type: ignore[misc]
    arena.close()  # its stream ended; other streams' clients still read a and b
    assert arena.path.exists() and arena.take() is None
    arena.give(a)
    assert arena.path.exists()
    arena.give(b)
    assert arena.unlinked and not arena.path.exists()
    arena.give(a)  # late: harmless
    arena.close()


def test_an_idle_arena_unlinks_on_close_and_a_bad_count_is_refused() -> None:
    arena = _arena()
    arena.close()
    assert not arena.path.exists()
    with pytest.raises(TransportError, match="at least one buffer"):
        _arena(0)
