# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""The notice pump's depth (``beton_serve.daemon._pump.pump_depth``): a served shm stream keeps
at most ``workers + DEPTH_SLACK`` batches submitted and unpublished, so a client that keeps up
cycles through a few slots of its ring (hot in the CPU's caches) instead of all of them.

The served test reads which slot each batch came in, over three epochs (the look-ahead into the
next epoch included), with the depth as the daemon sets it and with ``BETON_SERVE_PUMP_DEPTH=0``
(the old rule: every free slot), and checks both against the in-process Loader bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from beton_client import Loader, OrderOption, _stream
from beton_serve.daemon import _pump
from beton_serve.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
from beton_serve.loader import Loader as InProcessLoader
from beton_serve.transforms import RandomHorizontalFlip, ToTensor
from helpers.daemon import daemon_factory, short_tmp  # noqa: F401

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    ("env", "workers", "want"),
    [(None, 2, 4), (None, 1, 3), (None, 16, 18), (None, None, 0), ("7", 2, 7), ("0", 2, 0)],
)
def test_depth_is_the_workers_plus_slack_or_the_variable(
    monkeypatch: pytest.MonkeyPatch, env: str | None, workers: int | None, want: int
) -> None:
    if env is None:
        monkeypatch.delenv(_pump.DEPTH_ENV, raising=False)
    else:
        monkeypatch.setenv(_pump.DEPTH_ENV, env)
    assert _pump.pump_depth(workers) == want


@pytest.mark.parametrize("raw", ["four", "-1", "1.5"])
def test_a_bad_depth_variable_is_ignored_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, raw: str
) -> None:
    monkeypatch.setenv(_pump.DEPTH_ENV, raw)
    with caplog.at_level("WARNING", logger="beton_serve.daemon"):
        assert _pump.pump_depth(2) == 2 + _pump.DEPTH_SLACK
    assert _pump.DEPTH_ENV in caplog.text


def _pipelines() -> dict:
    # 224 px out of small JPEGs: each batch costs the daemon's single worker far more than the
    # client takes to read it, so the client keeps up and holds at most a batch or two.
    return {
        "image": [RandomResizedCropRGBImageDecoder((224, 224)), RandomHorizontalFlip(), ToTensor()],
        "label": [IntDecoder(), ToTensor()],
        "weight": None,
    }


def _epochs(ld: Any, n: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    out = []
    for _ in range(n):
        for image, label in ld:
            out.append((image.numpy().copy(), label.numpy().copy(), ld.last_sample_ids.copy()))
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("env", [None, "0"])
def test_a_client_that_keeps_up_cycles_through_few_slots(
    daemon_factory, fixtures_dir: Path, monkeypatch: pytest.MonkeyPatch, env: str | None
) -> None:
    if env is None:  # the daemon inherits the environment
        monkeypatch.delenv(_pump.DEPTH_ENV, raising=False)
    else:
        monkeypatch.setenv(_pump.DEPTH_ENV, env)
    # No naps: a napping client leaves batches published for a while, which is not the point.
    monkeypatch.setenv(_stream.ENV_COALESCE, "0")
    slots: list[int] = []
    real_next_ready = _stream._Stream.next_ready

    def next_ready(self: Any, *args: Any, **kw: Any) -> Any:
        b = real_next_ready(self, *args, **kw)
        if isinstance(b, _stream.Ready):
            slots.append(b.slot)
        return b

    monkeypatch.setattr(_stream._Stream, "next_ready", next_ready)
    beton = fixtures_dir / "images_jpg.beton"
    kw: dict[str, Any] = dict(batch_size=2, order=OrderOption.RANDOM, seed=11, drop_last=False)
    with InProcessLoader(str(beton), pipelines=_pipelines(), num_workers=1, **kw) as ref:
        want = _epochs(ref, 3)
    d = daemon_factory([beton], args=["--workers", "1"])
    with Loader("images_jpg", pipelines=_pipelines(), server=d.address, **kw) as ld:
        got = _epochs(ld, 3)
        feed: Any = ld._feed
        assert feed is not None and feed.notice is not None  # served over shm + notices
        ring = feed.shm.slot_count
    assert len(got) == len(want) == len(slots) == 3 * 32
    for (gi, gl, gs), (wi, wl, ws) in zip(got, want, strict=True):
        np.testing.assert_array_equal(gs, ws)
        np.testing.assert_array_equal(gl, wl)
        np.testing.assert_array_equal(gi, wi)
    assert ring >= 12, f"a ring of {ring} slots cannot tell the two rules apart"
    used = set(slots)
    if env == "0":  # every free slot is filled at the start: all of them are used
        assert used == set(range(ring))
    else:
        depth = 1 + _pump.DEPTH_SLACK  # one worker
        # depth unpublished, the one the client holds, and a margin for a client that the
        # machine's load held back for a few batches
        assert len(used) <= depth + 5, f"slots used: {sorted(used)} of {ring}"
        assert used <= set(range(depth + 5))  # lowest index first: the same few slots
