# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""The notice pump's depth (``beton_serve.daemon._pump.pump_depth``): a served shm stream keeps
at most ``workers + DEPTH_SLACK`` batches submitted and unpublished, so a client that keeps up
cycles through a few slots of its ring (hot in the CPU's caches) instead of all of them.

This test reads which slot each batch came in, over three epochs (the look-ahead into the next
epoch included), with the depth as the daemon sets it and with ``BETON_SERVE_PUMP_DEPTH=0`` (the
old rule: every free slot), and checks both against the in-process Loader bit for bit. The rule
itself is pinned in ``tests/unit/test_pump_depth.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from beton_client import Loader, OrderOption, _stream
from beton_serve.daemon import _pump
from beton_serve.loader import Loader as InProcessLoader
from helpers.daemon import daemon_factory, short_tmp  # noqa: F401
from helpers.served_epochs import assert_same_epochs, read_epochs, rrc_pipelines

pytestmark = pytest.mark.timeout(120)


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
    kw: dict[str, Any] = dict(batch_size=4, order=OrderOption.RANDOM, seed=11, drop_last=False)
    with InProcessLoader(str(beton), pipelines=rrc_pipelines(320), num_workers=1, **kw) as ref:
        want = read_epochs(ref, 3)
    d = daemon_factory([beton], args=["--workers", "1"])
    with Loader("images_jpg", pipelines=rrc_pipelines(320), server=d.address, **kw) as ld:
        got = read_epochs(ld, 3)
        feed: Any = ld._feed
        assert feed is not None and feed.notice is not None  # served over shm + notices
        ring = feed.shm.slot_count
    assert len(got) == len(want) == len(slots) == 3 * 16
    assert_same_epochs(got, want)
    assert ring >= 12, f"a ring of {ring} slots cannot tell the two rules apart"
    used = set(slots)
    high = sum(slot >= ring // 2 for slot in slots)  # batches that came in the upper half
    if env == "0":  # every free slot is filled at the start, and the slots then cycle
        assert used == set(range(ring))
        assert high >= len(slots) // 3, f"{high} of {len(slots)} batches in slots >= {ring // 2}"
    else:
        # depth 3 (one worker) unpublished and the one the client holds: slots 0-3. A client
        # that the machine's load holds back for a while has more published (a test run beside
        # other work reached slot 9), and the slots go back down once it catches up.
        assert high <= len(slots) // 4, f"{high} of {len(slots)} batches in slots >= {ring // 2}"
        assert min(slots) == 0 and used != set(range(ring))
