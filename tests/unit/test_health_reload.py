"""``daemon._health.FileWatch`` (files shrinking under the mmap) and ``cli._reload`` (SIGHUP)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from beton_serve.cli._reload import ConfigReloader
from beton_serve.cli.config import given_flags, load_config, merge_flags
from beton_serve.daemon._health import FileWatch
from beton_serve.errors import ConfigError, FormatError
from beton_serve.pipeline import set_idle_workspace_limit, workspace_memory


def test_file_watch_detects_shrinking_and_sticks(tmp_path: Path) -> None:
    f = tmp_path / "a.beton"
    f.write_bytes(b"x" * 4096)
    w = FileWatch([str(f), str(tmp_path / "missing")], min_interval=0)
    try:
        w.check("a")
        w.check("a")
        os.truncate(f, 100)
        with pytest.raises(FormatError, match="shrank from 4096 to 100") as info:
            w.check("a")
        assert info.value.path == str(f)
        f.write_bytes(b"x" * 8192)  # restored: still refused until a restart
        with pytest.raises(FormatError, match="restart the daemon"):
            w.check("a")
    finally:
        w.close()
        w.close()


@pytest.mark.parametrize("how", ["same_size_rewrite", "append"])
def test_file_watch_detects_any_write_and_sticks(tmp_path: Path, how: str) -> None:
    """A same-size rewrite keeps every mapped page valid, but the header and allocation table
    read at open no longer describe the bytes: another dataset copied over a served file in
    place was served as the old one's samples, with no error."""
    f = tmp_path / "a.beton"
    f.write_bytes(b"x" * 4096)
    os.utime(f, ns=(1_000_000_000, 1_000_000_000))  # an old file: any write changes its mtime
    w = FileWatch([str(f)], min_interval=0)
    try:
        w.check("a")
        with open(f, "r+b" if how == "same_size_rewrite" else "ab") as fh:
            fh.write(b"y" * 4096)
        assert f.stat().st_size == (4096 if how == "same_size_rewrite" else 8192)
        with pytest.raises(FormatError, match="it was written to") as info:
            w.check("a")
        assert info.value.path == str(f)
        with pytest.raises(FormatError, match="restart the daemon"):  # it sticks
            w.check("a")
    finally:
        w.close()


def test_a_config_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "c.toml"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config(fifo)
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path)  # a directory
    big = tmp_path / "big.toml"
    big.write_text("# " + "x" * (1 << 20) + "\n")
    with pytest.raises(ConfigError, match="larger than"):
        load_config(big)


def _fake_daemon() -> SimpleNamespace:
    return SimpleNamespace(
        bad_sample_budget=0,
        max_ring_bytes=1 << 30,
        sharing=SimpleNamespace(max_lag=8, retain=4),
        streams=SimpleNamespace(unattached_timeout_s=30.0),
    )


def test_sighup_reads_the_file_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A read that blocks (a hung mount) holds the reload's thread, not the event loop; a
    second SIGHUP meanwhile is ignored; the read's result is applied on the loop."""
    from beton_serve.cli import _reload

    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text("bad_sample_budget = 1\n")
    daemon = _fake_daemon()
    r = ConfigReloader(daemon, load_config(cfg_file), str(cfg_file))
    cfg_file.write_text("bad_sample_budget = 6\n")
    release = threading.Event()
    real = _reload.load_config

    def slow(path: str | None) -> Any:
        assert release.wait(10)
        return real(path)

    monkeypatch.setattr(_reload, "load_config", slow)

    async def main() -> None:
        r.on_signal()
        for _ in range(20):  # the loop runs while the read waits
            await asyncio.sleep(0.01)
        assert daemon.bad_sample_budget == 0
        r.on_signal()  # still reading: ignored
        release.set()
        for _ in range(500):
            if daemon.bad_sample_budget == 6:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the reload was never applied")

    with caplog.at_level(logging.INFO, logger="beton_serve.serve"):
        asyncio.run(main())
    assert "still reading" in caplog.text


def test_sighup_keeps_every_flag_and_refuses_a_change_until_it_is_undone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A flag given with the file's own value still wins later (it lost to the file before);
    a refused change is refused at every SIGHUP, and putting the file back is no change (it
    used to be forgotten, then the restored value was called a change)."""
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text("share_max_lag = 8\nworkers = 2\n")
    flags = {"share_max_lag": 8}  # the same value as the file's
    start = merge_flags(load_config(cfg_file), flags)
    daemon = _fake_daemon()
    r = ConfigReloader(daemon, start, str(cfg_file), given_flags(flags))
    cfg_file.write_text("share_max_lag = 3\nworkers = 7\n")
    with caplog.at_level(logging.INFO, logger="beton_serve.serve"):
        assert r() == {}
        assert daemon.sharing.max_lag == 8  # the flag wins
        assert caplog.text.count("not reloaded") == 1 and "workers" in caplog.text
        caplog.clear()
        assert r() == {}
        assert "not reloaded" in caplog.text and "workers" in caplog.text  # again
        caplog.clear()
        cfg_file.write_text("share_max_lag = 3\nworkers = 2\n")  # put back
        assert r() == {}
        assert "not reloaded" not in caplog.text


def test_file_watch_skips_checks_closer_than_its_interval(tmp_path: Path) -> None:
    f = tmp_path / "a.beton"
    f.write_bytes(b"x" * 4096)
    w = FileWatch([str(f)], min_interval=0.2)
    try:
        w.check("a")
        os.truncate(f, 100)
        w.check("a")  # within 0.2 s of the last check: skipped
        time.sleep(0.25)
        with pytest.raises(FormatError, match="shrank from 4096 to 100"):
            w.check("a")
    finally:
        w.close()


def test_sighup_applies_safe_keys_keeps_flags_and_refuses_the_rest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text('files = ["a.beton"]\nshare_max_lag = 8\nshare_retain = 4\n')
    start = merge_flags(load_config(cfg_file), {"share_retain": 1})  # a flag set share_retain
    daemon = SimpleNamespace(
        bad_sample_budget=0,
        max_ring_bytes=1 << 30,
        sharing=SimpleNamespace(max_lag=8, retain=1),
        streams=SimpleNamespace(unattached_timeout_s=30.0),
    )
    r = ConfigReloader(daemon, start, str(cfg_file))
    cfg_file.write_text(
        'files = ["b.beton"]\nshare_max_lag = 3\nshare_retain = 9\nbad_sample_budget = 5\n'
        "workers = 7\nmax_ring_bytes = 123456\nunattached_timeout = 4.5\n"
        "max_idle_buffer_bytes = 7654321\n"
    )
    with caplog.at_level(logging.INFO, logger="beton_serve.serve"):
        try:
            applied = r()
            assert workspace_memory().limit_bytes == 7654321  # the process-wide bound
        finally:
            set_idle_workspace_limit(None)
    assert applied == {
        "bad_sample_budget": 5,
        "share_max_lag": 3,
        "max_ring_bytes": 123456,
        "max_idle_buffer_bytes": 7654321,
        "unattached_timeout": 4.5,
    }
    assert daemon.streams.unattached_timeout_s == 4.5  # the liveness monitor's next tick
    assert daemon.bad_sample_budget == 5 and daemon.sharing.max_lag == 3
    assert daemon.max_ring_bytes == 123456  # new streams are held to it
    assert daemon.sharing.retain == 1  # the flag wins, and the log says so (it did not)
    assert "kept (set by a command-line flag, which overrides the file) keys=share_retain" in (
        caplog.text
    )
    assert "not reloaded" in caplog.text and "files" in caplog.text and "workers" in caplog.text
    assert r.cfg.files == ("a.beton",)  # datasets never change live
    cfg_file.write_text("not = valid = toml")
    assert r() == {}
    assert "config not reloaded" in caplog.text
    assert ConfigReloader(daemon, start, None)() == {}
