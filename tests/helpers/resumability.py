"""One resumability checker for every Loader configuration (torchdata's ``run_test_save_load_state``).

``run_test_save_load_state(make_loader, stop_after=k, epochs=2)``:

1. an uninterrupted Loader gives the reference batches of ``epochs`` epochs;
2. a second Loader yields ``k`` batches of epoch 0, saves ``state_dict()``, abandons its iterator;
3. a *fresh* Loader loads that state and must yield exactly the rest of epoch 0, then the
   following epochs, equal to the reference bit for bit;
4. the interrupted Loader itself, given its own state back, must do the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def _snap(batch: tuple[Any, ...]) -> list[np.ndarray]:
    out = []
    for x in batch:
        if hasattr(x, "detach"):
            x = x.detach().cpu().numpy()
        out.append(np.array(x, copy=True))
    return out


def _epoch(it: Any) -> list[list[np.ndarray]]:
    return [_snap(b) for b in it]


def _assert_same(got: list[list[np.ndarray]], want: list[list[np.ndarray]], what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} batches, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        for j, (a, b) in enumerate(zip(g, w, strict=True)):
            assert a.dtype == b.dtype and a.shape == b.shape, (
                f"{what}: batch {i} output {j} differs in type"
            )
            np.testing.assert_array_equal(a, b, err_msg=f"{what}: batch {i} output {j}")


def run_test_save_load_state(
    make_loader: Callable[[], Any], *, stop_after: int, epochs: int = 2
) -> None:
    """Check that ``state_dict``/``load_state_dict`` resume mid-epoch exactly (see module docstring)."""
    ref_loader = make_loader()
    try:
        reference = [_epoch(iter(ref_loader)) for _ in range(epochs)]
    finally:
        ref_loader.close()
    assert len(reference[0]) > stop_after, "stop_after must be inside the first epoch"

    first = make_loader()
    try:
        it = iter(first)
        head = [_snap(next(it)) for _ in range(stop_after)]
        _assert_same(head, reference[0][:stop_after], "before the interruption")
        it.close()  # abandoned mid-epoch: the state still says what was yielded
        del it
        state = first.state_dict()
        assert state["epoch"] == 0 and state["batch"] == stop_after

        resumed = make_loader()
        try:
            resumed.load_state_dict(state)
            got = [_epoch(iter(resumed)) for _ in range(epochs)]
        finally:
            resumed.close()
        _assert_same(got[0], reference[0][stop_after:], "fresh loader, rest of epoch 0")
        for e in range(1, epochs):
            _assert_same(got[e], reference[e], f"fresh loader, epoch {e}")

        first.load_state_dict(state)
        again = _epoch(iter(first))
        _assert_same(again, reference[0][stop_after:], "same loader, rest of epoch 0")
    finally:
        first.close()
