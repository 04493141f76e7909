"""``status``, ``stop`` and ``reload`` run by a user who cannot look at the daemon.

Found by an audit run as ordinary users: another user's daemon (its ``<socket>.lock`` is mode
0600) was reported "not running" (``status`` and ``reload`` exit 3), and ``stop`` said the same
and exited 0 while that daemon kept running, because ``daemon_pid`` took any ``OSError`` for
"no lock file" and ``_holds_open`` any unreadable ``/proc/<pid>/fd`` for "not that process".
Now a lock that cannot be read, or a pid whose descriptors cannot be, is an ``error:`` line:
``status`` exits 4 (LSB's "status is unknown"), ``stop`` and ``reload`` exit 1.

CI runs as root, for whom mode 0600 and ``/proc`` hide nothing: the permission errors are
raised by monkeypatching the calls that meet them (``open`` of the lock, ``os.listdir`` of
``/proc/<pid>/fd``).
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from beton_serve import cli
from beton_serve.cli import _daemonctl


@pytest.fixture
def sock(tmp_path: Path) -> str:
    return str(tmp_path / "beton.sock")


@pytest.fixture
def held_lock(sock: str) -> Iterator[str]:
    """A lock written and held open by this process, as a serving daemon's is."""
    lock = sock + ".lock"
    with open(lock, "w") as f:
        f.write(f"{os.getpid()}\n")
        f.flush()
        yield lock


def _deny_open(monkeypatch: pytest.MonkeyPatch, path: str, err: int = errno.EACCES) -> None:
    """Make ``_daemonctl``'s ``open`` of ``path`` fail with ``err`` (as for another user)."""
    real_open = open

    def fake_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        if os.fspath(file) == path:
            raise OSError(err, os.strerror(err), path)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(_daemonctl, "open", fake_open, raising=False)


def _deny_proc_fd(monkeypatch: pytest.MonkeyPatch, pid: int) -> None:
    real_listdir = os.listdir
    fd_dir = f"/proc/{pid}/fd"

    def fake_listdir(path: Any = ".") -> list[str]:
        if os.fspath(path) == fd_dir:
            raise PermissionError(errno.EACCES, "Permission denied", fd_dir)
        return real_listdir(path)

    monkeypatch.setattr(os, "listdir", fake_listdir)


def _never_signal(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object) -> bool:
        raise AssertionError("a signal was sent to a daemon that could not be looked at")

    monkeypatch.setattr(_daemonctl, "_send", fail)


def test_status_of_an_unreadable_lock_is_unknown_not_not_running(
    sock: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    lock = sock + ".lock"
    Path(lock).write_text("4242\n")
    _deny_open(monkeypatch, lock)
    assert cli.main(["status", "--socket", sock]) == _daemonctl.EXIT_STATUS_UNKNOWN == 4
    out, err = capsys.readouterr()
    assert "not running" not in out + err
    assert (
        f"error: cannot read the daemon's lock {lock} (Permission denied): it may belong to "
        "another user; run this as that user (or root)"
    ) in err


def test_status_json_of_an_unreadable_lock(
    sock: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    lock = sock + ".lock"
    _deny_open(monkeypatch, lock)
    assert cli.main(["status", "--socket", sock, "--json"]) == 4
    info = json.loads(capsys.readouterr().out)
    assert info["running"] is None and info["pid"] is None
    assert "Permission denied" in info["error"]


@pytest.mark.parametrize("command", ["stop", "reload"])
def test_stop_and_reload_of_an_unreadable_lock_fail_and_send_nothing(
    command: str,
    sock: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    lock = sock + ".lock"
    _deny_open(monkeypatch, lock)
    _never_signal(monkeypatch)
    assert cli.main([command, "--socket", sock]) == 1  # stop exited 0: "not running"
    out, err = capsys.readouterr()
    assert "not running" not in out + err
    assert f"error: cannot read the daemon's lock {lock} (Permission denied): it may belong" in err


def test_any_other_read_error_is_unknown_too(
    sock: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    lock = sock + ".lock"
    _deny_open(monkeypatch, lock, errno.EIO)
    assert cli.main(["status", "--socket", sock]) == 4
    assert "whether a daemon serves there is unknown" in capsys.readouterr().err
    with pytest.raises(_daemonctl.DaemonStateUnknown):
        _daemonctl.daemon_pid(sock)


@pytest.mark.parametrize("command", ["status", "stop", "reload"])
def test_an_unreadable_proc_fd_is_unknown(
    command: str,
    sock: str,
    held_lock: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    pid = os.getpid()
    _deny_proc_fd(monkeypatch, pid)
    _never_signal(monkeypatch)
    assert cli.main([command, "--socket", sock]) == (4 if command == "status" else 1)
    out, err = capsys.readouterr()
    assert "not running" not in out + err
    assert (
        f"cannot tell whether pid {pid} holds the daemon's lock {held_lock}: /proc/{pid}/fd is "
        "not readable (Permission denied)"
    ) in err


def test_an_unreadable_proc_fd_of_another_users_pid_is_a_stale_lock(
    sock: str, held_lock: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """This user's lock, whose pid now runs as another user: the daemon that wrote it is gone
    and its pid was reused, so "not running" is known (exit 3; ``stop`` exits 0)."""
    _deny_proc_fd(monkeypatch, os.getpid())
    owner = os.stat(held_lock).st_uid
    monkeypatch.setattr(_daemonctl, "_process_uids", lambda pid: {owner + 1})
    assert cli.main(["status", "--socket", sock]) == _daemonctl.EXIT_NOT_RUNNING
    assert cli.main(["stop", "--socket", sock]) == 0
    assert "not running: no beton-serve daemon serves" in capsys.readouterr().out


def test_no_lock_file_is_still_not_running(sock: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", "--socket", sock]) == 3
    assert cli.main(["stop", "--socket", sock]) == 0
    assert cli.main(["reload", "--socket", sock]) == 3
    missing_dir = os.path.join(sock, "nested", "beton.sock")  # a file as a directory: ENOTDIR
    Path(sock).touch()
    assert _daemonctl.daemon_pid(missing_dir) is None
    assert "not running" in capsys.readouterr().out


def test_a_lock_held_by_a_readable_process_is_running(sock: str, held_lock: str) -> None:
    assert _daemonctl.daemon_pid(sock) == os.getpid()
