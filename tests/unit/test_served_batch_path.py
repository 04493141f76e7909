"""The client's per-batch fast paths (issue 15 §3): cached slot views and the all-calls tail.

Both must change no output: the cached views of a slot alias the same bytes as freshly built
ones and are new array objects each batch; a tail of plain calls gives what the general path
gives, and an error still names the op.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from beton_client._tail import OutputTail
from beton_client._transport.shm import ShmReceiver, TensorInfo
from beton_client.errors import PipelineError, TransportError
from beton_serve.transforms import ToTensor
from beton_serve.transport import ShmFactory, ShmNamer
from beton_wire.slots import slot_layout


def _receiver():
    layout = slot_layout([("image", (4, 5, 3), "uint8"), ("label", (), "int64")], batch_size=8)
    ring = ShmFactory(ShmNamer()).create(layout, 3)
    setup = ring.setup()
    rx = ShmReceiver(
        setup.segment,
        setup.segment_bytes,
        3,
        setup.slot_bytes,
        ids_offset=setup.ids_offset,
        release_offset=setup.release_offset,
    )
    tensors = [
        TensorInfo(t.name, (8, *t.shape), t.dtype, t.offset, t.nbytes(8)) for t in layout.tensors
    ]
    return ring, rx, tensors


def test_cached_slot_views_alias_the_slot_and_are_new_objects_each_time() -> None:
    ring, rx, tensors = _receiver()
    try:
        for slot in range(3):
            img, lab = ring.host_views(slot)
            img[...] = slot + 1
            lab[...] = 10 * slot
        first = rx.slot_arrays(1, tensors)
        again = rx.slot_arrays(1, tensors)
        fresh = rx.arrays(1, tensors)
        for a, b, c in zip(first, again, fresh, strict=True):
            assert a is not b
            assert a.shape == c.shape and a.dtype == c.dtype
            assert np.array_equal(a, c) and np.shares_memory(a, c)
        # A batch written later into the slot is what the cached views show.
        ring.host_views(1)[0][...] = 77
        assert (rx.slot_arrays(1, tensors)[0] == 77).all()
        # Changing one batch's array object leaves the next batch's alone.
        first[0].shape = (8 * 4, 5, 3)
        assert rx.slot_arrays(1, tensors)[0].shape == (8, 4, 5, 3)
        # Another description (a short last batch) is built as before.
        short = [
            TensorInfo(t.name, (3, *t.shape[1:]), t.dtype, t.offset, t.nbytes * 3 // 8)
            for t in tensors
        ]
        img, lab = rx.slot_arrays(2, short)
        assert img.shape == (3, 4, 5, 3) and (img == 3).all() and (lab == 20).all()
        with pytest.raises(TransportError):
            rx.slot_arrays(5, tensors)
        rx.close()
        with pytest.raises(TransportError):  # closed: the cache is gone with the mapping
            rx.slot_arrays(0, tensors)
    finally:
        rx.close()
        ring.close()


def test_tail_of_plain_calls_equals_the_general_path_and_names_a_failing_op() -> None:
    x = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    ids = np.array([4, 9], np.uint64)
    fast = OutputTail("image", (3, 3), np.uint8, [ToTensor()], [1], batch_size=2)
    assert fast._calls is not None
    out = fast(x, ids, 0, 0)
    assert isinstance(out, torch.Tensor) and torch.equal(out, torch.from_numpy(x))
    assert OutputTail("image", (3, 3), np.uint8, [], [], batch_size=2)(x, ids, 0, 0) is x

    def boom(_x):
        raise RuntimeError("bad input")

    failing = OutputTail("image", (3, 3), np.uint8, [ToTensor(), boom], [1, None], batch_size=2)
    with pytest.raises(PipelineError, match=r"pipeline 'image', run in this process.*bad input"):
        failing(x, ids, 0, 0)
