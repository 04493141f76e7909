"""The ``ShuttingDown`` a draining daemon's clients get names why it drains.

Found by an audit: SIGINT (Ctrl-C) to a foreground daemon gave its clients ``ServerUnavailable:
the daemon is shutting down (SIGTERM)``: the text was fixed. Now ``beton-serve serve`` passes
the signal's name (or ``idle for N s``) to ``Daemon.drain``, and the error says it.
"""

from __future__ import annotations

import asyncio
import types
from pathlib import Path

import pytest
from beton_serve.cli import _serve
from beton_serve.errors import ShuttingDown


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cause", ["SIGINT", "SIGTERM", "idle for 300 s"])
def test_drain_names_its_cause(fixtures_dir: Path, cause: str) -> None:
    from beton_serve.daemon import Daemon

    daemon = Daemon.create(
        {"img": [str(fixtures_dir / "images_jpg.beton")]}, num_workers=1, sweep=False
    )
    try:
        asyncio.run(daemon.drain(0.1, cause=cause))
        with pytest.raises(ShuttingDown) as info:
            daemon._refuse_if_draining()
        assert str(info.value) == (f"the daemon is shutting down ({cause}); reconnect to a new one")
        asyncio.run(daemon.drain(0.1, cause="SIGTERM"))  # a second drain: the first cause stays
        assert daemon.drain_cause == cause
    finally:
        daemon.close()


def test_the_first_stop_request_is_the_cause() -> None:
    async def go() -> str:
        stop = _serve._StopRequest()
        stop.set("SIGINT")
        stop.set("SIGTERM")  # Ctrl-C, then a supervisor's SIGTERM
        await asyncio.wait_for(stop.wait(), 5)
        return stop.cause

    assert asyncio.run(go()) == "SIGINT"


@pytest.mark.timeout(30)
def test_the_idle_timeout_is_named() -> None:
    async def go() -> str:
        stop = _serve._StopRequest()
        idle_daemon = types.SimpleNamespace(streams=[])
        await asyncio.wait_for(_serve._idle_watch(idle_daemon, 0.2, stop), 10)  # type: ignore[arg-type]
        await asyncio.wait_for(stop.wait(), 5)
        return stop.cause

    assert asyncio.run(go()) == "idle for 0.2 s"


def test_a_stop_signal_during_start_up_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import signal

    monkeypatch.setattr(_serve, "_startup_signals", [signal.SIGHUP, signal.SIGINT])
    assert _serve._startup_stop_name() == "SIGINT"
    monkeypatch.setattr(_serve, "_startup_signals", [signal.SIGHUP])
    assert _serve._startup_stop_name() == ""
