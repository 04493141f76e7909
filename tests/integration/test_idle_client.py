# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""A client that builds its Loader and iterates much later: its stream waits for it; a client
that dies before iterating frees its stream at once.

The daemon reclaims a stream that no serving call took up within its ``unattached_timeout`` (30
s by default) while no client holds its notice channel: a client that died right after
``OpenStream``. It also reclaimed the stream of a live shm
client that simply had not iterated yet (a training script builds its Loader, then its model;
a ``torch.compile`` takes minutes), and that client's first ``next()`` then waited on its
notice channel for ever: the daemon had dropped the stream without closing the connection.
Here the daemon runs with ``--unattached-timeout 1``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conformance._backends import assert_same_batches, epoch, epochs, make_loader
from conformance.test_interrupted import BATCH, pipes
from helpers.daemon import DaemonProcess, short_tmp, start_daemon  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

TIMEOUT_S = 1.0


@pytest.fixture
def daemon(short_tmp: Path, fixtures_dir: Path) -> Iterator[DaemonProcess]:
    d = start_daemon(
        [fixtures_dir / "images_jpg.beton"],
        short_tmp,
        args=["--unattached-timeout", str(TIMEOUT_S)],
    )
    try:
        yield d
    finally:
        d.stop()


def _within(seconds: float, fn: Any) -> Any:
    """``fn()`` on a thread, or a failure (not a hung test) when it takes longer."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(("ok", fn()))
        except BaseException as exc:
            out.append(("error", exc))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert out, f"no result within {seconds} s (the client waits on its stream)"
    kind, value = out[0]
    if kind == "error":
        raise value
    return value


@pytest.mark.parametrize("backend", ["shm", "grpc"])
def test_a_loader_iterated_long_after_it_was_built_gets_its_batches(
    daemon: DaemonProcess, fixtures_dir: Path, backend: str
) -> None:
    beton = fixtures_dir / "images_jpg.beton"
    reference = epochs(
        make_loader("inproc", beton, pipes(), order="RANDOM", seed=7, batch_size=BATCH), 2
    )
    with make_loader(
        backend, beton, pipes(), address=daemon.address, order="RANDOM", seed=7, batch_size=BATCH
    ) as ld:
        time.sleep(4 * TIMEOUT_S)  # building the model
        got = _within(30, lambda: [epoch(ld), epoch(ld)])
    assert_same_batches(got[0] + got[1], reference[0] + reference[1], backend)
    assert "never started" not in daemon.log()


_CLIENT = """
import sys, time
sys.path[:0] = sys.argv[3:]
from conformance._backends import make_loader
from conformance.test_interrupted import BATCH, pipes
ld = make_loader("shm", sys.argv[1], pipes(), address=sys.argv[2], batch_size=BATCH)
print("built", flush=True)
time.sleep(600)
"""


def test_a_client_killed_before_it_iterates_frees_its_stream_at_once(
    daemon: DaemonProcess, fixtures_dir: Path
) -> None:
    """The stream outlives the daemon's unattached timeout while its client lives (it holds
    the notice channel), and goes within moments once the client dies (the kernel closes the
    channel with the process, and its pid is gone)."""
    tests = str(Path(__file__).resolve().parents[1])
    client = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _CLIENT,
            str(fixtures_dir / "images_jpg.beton"),
            daemon.address,
            tests,
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert client.stdout is not None
        assert client.stdout.readline().strip() == b"built"
        time.sleep(3 * TIMEOUT_S)  # past the daemon's unattached timeout: still there
        assert len(daemon.stats().streams) == 1
        client.send_signal(signal.SIGKILL)
        client.wait(10)
        deadline = time.monotonic() + 10
        while len(daemon.stats().streams) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(daemon.stats().streams) == 0
        assert daemon.segments() == []
    finally:
        client.kill()
        client.wait(10)


def test_a_stream_nobody_took_up_ends_after_the_configured_timeout(
    daemon: DaemonProcess, fixtures_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream whose client never connected its notice channel and never started (what a
    client killed right after ``OpenStream`` leaves) ends after ``--unattached-timeout``, not
    the default 30 s: its ring is freed and the daemon says why."""
    monkeypatch.setattr("beton_client._stream._connect_notices", lambda *a: None)
    beton = fixtures_dir / "images_jpg.beton"
    ld = make_loader("shm", beton, pipes(), address=daemon.address, batch_size=BATCH)
    try:
        assert len(daemon.stats().streams) == 1
        opened = time.monotonic()
        deadline = opened + 10 * TIMEOUT_S
        while daemon.stats().streams and time.monotonic() < deadline:
            time.sleep(0.05)
        took = time.monotonic() - opened
        assert not daemon.stats().streams, "the unattached stream was not ended"
        assert took < 5 * TIMEOUT_S  # the configured 1 s (and the 0.25 s tick), not 30 s
        assert "never started; closing it" in daemon.log()
        assert not [s for s in daemon.segments() if "-ring-" in s]
    finally:
        _within(15, ld.close)  # closing a Loader whose stream the daemon ended does not hang


def test_the_old_environment_variable_is_named_in_a_warning(
    short_tmp: Path, fixtures_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``BETON_SERVE_UNATTACHED_TIMEOUT_S`` set the timeout before the config key; a daemon
    started with it says that it is ignored and which value holds."""
    monkeypatch.setenv("BETON_SERVE_UNATTACHED_TIMEOUT_S", "5")
    d = start_daemon(
        [fixtures_dir / "images_jpg.beton"], short_tmp, args=["--unattached-timeout", "2"]
    )
    try:
        assert "BETON_SERVE_UNATTACHED_TIMEOUT_S is no longer read" in d.log()
        assert "--unattached-timeout (now 2 s)" in d.log()
    finally:
        d.stop()
