"""The daemon's handling of SIGTERM/SIGINT once it is already stopping (cli/_serve.py).

The end-to-end check (repeated SIGTERMs, exit 0, nothing left behind) is
tests/integration/test_daemon_faults.py::test_sigterm_repeated_while_stopping_still_exits_0_and_frees_everything;
the window this handler covers is too short there to count on a signal landing in it.
"""

from __future__ import annotations

import logging
import signal

import pytest
from beton_serve.cli import _serve


def test_a_signal_while_stopping_is_logged_once_and_not_fatal(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_serve, "_late_signals", 0)
    with caplog.at_level(logging.WARNING, logger=_serve.log.name):
        for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGINT):
            _serve._signal_while_stopping(sig, None)  # returns: the cleanup goes on
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert warnings[0].startswith("SIGTERM while stopping") and "kill -KILL" in warnings[0]
    assert _serve._late_signals == 3
