"""How many slots a stream's ring gets (``beton_serve.daemon._streams.ring_size``)."""

from __future__ import annotations

import pytest
from beton_serve.daemon._streams import MAX_RING_SLOTS, SMALL_RING_BYTES, ring_size

MIB = 1 << 20


@pytest.mark.parametrize("ahead", [1, 3, 8])
def test_large_slots_get_the_held_batch_and_batches_ahead(ahead: int) -> None:
    assert ring_size(ahead, 38 * MIB) == ahead + 1
    assert ring_size(ahead, 38 * MIB, room=0) == ahead + 1
    assert ring_size(ahead, 38 * MIB, room=10**12) == ahead + 1  # room is no reason to grow


def test_small_slots_get_a_deeper_ring_up_to_its_bounds() -> None:
    assert ring_size(3, 3 * MIB // 2) == min(MAX_RING_SLOTS, SMALL_RING_BYTES // (3 * MIB // 2))
    assert ring_size(3, 1000) == MAX_RING_SLOTS
    assert ring_size(20, 1000) == 21  # never fewer than required


def test_the_extra_depth_takes_only_whole_slots_of_the_room_given() -> None:
    slot = 100_000
    assert ring_size(3, slot, room=None) == MAX_RING_SLOTS
    assert ring_size(3, slot, room=0) == 4
    assert ring_size(3, slot, room=-5 * slot) == 4  # no room: the required slots still
    assert ring_size(3, slot, room=slot - 1) == 4
    assert ring_size(3, slot, room=2 * slot + 7) == 6
    assert ring_size(3, slot, room=100 * slot) == MAX_RING_SLOTS
