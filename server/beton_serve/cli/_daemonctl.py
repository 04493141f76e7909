"""``beton-serve status``, ``stop`` and ``reload``: the per-user daemon, found by its socket.

Which daemon: the one serving ``--socket PATH``, else ``BETON_SERVE_ADDRESS`` when it is a
``unix:`` target, else the per-user default socket (:mod:`beton_wire.address`), the order the
Loader uses. A TCP-only daemon (``--no-socket``) has no socket lock: stop it with its process
manager (systemd, Kubernetes) or SIGTERM.

How a daemon is recognised: a serving daemon holds an ``flock`` on ``<socket>.lock`` and has
written its pid there (``beton_serve.cli._serve.address_lock``). A daemon is *running* when the
pid in that file is alive and has that very file open (``/proc/<pid>/fd``): a stale file left
by a killed daemon, or a pid reused by another process, is not mistaken for one, and the check
never takes the lock itself (which would make a daemon starting at that moment fail).

``status`` then asks the daemon's Stats RPC for its uptime, workers, datasets and streams,
after the owner check of ``health`` (the socket and its directory must be this user's, or
``--socket-owner UID``'s; otherwise nothing, not even the token, is sent, and the daemon is
reported running with "stats unavailable" and the reason).

When this user cannot look (the lock file is another user's, mode 0600, or
``/proc/<pid>/fd`` of its pid is not readable), nothing is known: that is never reported as
"not running" (:class:`DaemonStateUnknown`). Only a lock file that does not exist means none.

=====  ===========================================================================
exit   ``status``
=====  ===========================================================================
0      a daemon is running (details printed; "stats unavailable" if it did not answer)
3      no daemon is running at that socket (LSB's "program is not running")
4      this user cannot tell (LSB's "status is unknown"): an ``error:`` line says why
=====  ===========================================================================

``stop`` sends SIGTERM to the lock holder (through a pidfd, so a pid reused meanwhile is never
signalled) and waits until it has exited: it drains its streams, frees its shared memory and
removes its socket, lock and spawn log. Exit 0 once it is gone, and 0 with the message "not
running" when there was none (stopping a stopped daemon succeeds, as ``systemctl stop`` does;
use ``status`` to tell the two apart). Exit 1 if it has not exited after ``--timeout`` seconds,
or when this user cannot tell whether one runs (``stop`` exits 0 only when it knows that no
daemon runs there, or it has stopped it). ``reload`` exits 1 then too (nothing sent).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from beton_serve.cli._health import add_socket_owner_argument, positive_seconds
from beton_serve.errors import ConfigError

__all__ = [
    "EXIT_NOT_RELOADED",
    "EXIT_NOT_RUNNING",
    "EXIT_RUNNING",
    "EXIT_STATUS_UNKNOWN",
    "EXIT_STOP_TIMEOUT",
    "DaemonStateUnknown",
    "daemon_pid",
    "register",
    "resolve_socket_path",
    "run_reload",
    "run_status",
    "run_stop",
]

EXIT_RUNNING = 0
EXIT_NOT_RUNNING = 3
#: ``status`` when this user cannot tell whether a daemon runs (LSB's "status is unknown").
EXIT_STATUS_UNKNOWN = 4
EXIT_STOP_TIMEOUT = 1
EXIT_NOT_RELOADED = 1


def register(subparsers: argparse._SubParsersAction) -> None:
    """Register ``status``, ``stop`` and ``reload`` on the ``beton-serve`` subcommand parser."""
    p = subparsers.add_parser(
        "status",
        help="is the per-user daemon running: pid, address, uptime, datasets, streams "
        "(exit 0 running, 3 not, 4 this user cannot tell)",
        description="Show the daemon serving the per-user socket (or --socket PATH).",
    )
    _socket_arg(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--token-file",
        default=None,
        metavar="FILE",
        help="the daemon's bearer token, for its Stats (default: $BETON_SERVE_TOKEN)",
    )
    p.add_argument(
        "--timeout", type=positive_seconds, default=3.0, help="Stats deadline in s (default 3)"
    )
    add_socket_owner_argument(p)
    p.set_defaults(func=run_status)
    q = subparsers.add_parser(
        "stop",
        help="stop the per-user daemon (SIGTERM, then wait for it to exit)",
        description="Stop the daemon serving the per-user socket (or --socket PATH) and wait "
        "until it has exited. Exit 0 when it is gone or was not running, 1 after --timeout "
        "or when this user cannot tell whether one runs (another user's daemon).",
    )
    _socket_arg(q)
    q.add_argument(
        "--timeout",
        type=positive_seconds,
        default=30.0,
        help="seconds to wait for it to exit (default 30); exit 1 after that",
    )
    q.set_defaults(func=run_stop)
    r = subparsers.add_parser(
        "reload",
        help="make the per-user daemon re-read its --config file (SIGHUP; exit 0 sent, 3 not "
        "running, 1 no --config, an invalid file, or this user cannot tell)",
        description="Send SIGHUP to the daemon serving the per-user socket (or --socket PATH): "
        "it re-reads its --config file and logs the keys it applied or refused. Exit 0 when "
        "the signal was sent, 3 when no daemon runs there, 1 (nothing sent) when the daemon "
        "runs without --config or its file does not load, or this user cannot tell whether "
        "one runs (another user's daemon).",
    )
    _socket_arg(r)
    r.set_defaults(func=run_reload)


def _socket_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--socket",
        default=None,
        metavar="PATH",
        help="the daemon's Unix socket (default: $BETON_SERVE_ADDRESS, else the per-user one)",
    )


def resolve_socket_path(explicit: str | None, environ: Mapping[str, str]) -> str:
    """``--socket``, else ``BETON_SERVE_ADDRESS`` when it is a Unix target, else the default.

    Raises:
        ConfigError: ``--socket`` was given empty.
    """
    from beton_wire.address import ENV_ADDRESS, default_socket_path, socket_path_of

    if explicit is not None:
        if not explicit.strip():
            raise ConfigError("--socket is empty: pass the daemon's socket path")
        return os.path.abspath(explicit)
    address = environ.get(ENV_ADDRESS, "")
    env_path = socket_path_of(address)
    path = os.path.abspath(env_path or default_socket_path(environ))
    if address and env_path is None:
        # status/stop/reload act on a local daemon through its socket and lock: a TCP address
        # cannot name one. Said, not silently replaced (stop could reach another daemon).
        sys.stderr.write(
            f"note: {ENV_ADDRESS}={address} is not a unix: address; using the per-user socket "
            f"{path} (pass --socket PATH to name another)\n"
        )
    return path


class DaemonStateUnknown(ConfigError):
    """This user cannot tell whether a daemon serves the socket: its lock file, or the
    ``/proc/<pid>/fd`` of the pid written there, is not readable (another user's daemon).
    ``status`` exits :data:`EXIT_STATUS_UNKNOWN`; ``stop`` and ``reload`` exit 1."""


#: A lock path that does not exist (a missing directory too): no daemon serves there.
_ABSENT = (FileNotFoundError, NotADirectoryError)


def _process_uids(pid: int) -> set[int] | None:
    """The real, effective, saved and filesystem uids of ``pid`` (``/proc/<pid>/status``,
    readable by every user), or ``None`` when they cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return {int(u) for u in line.split()[1:]}
    except (OSError, ValueError):
        return None
    return None


def _holds_open(pid: int, path: str) -> bool:
    """Whether process ``pid`` has the file at ``path`` open (same device and inode).

    Raises:
        DaemonStateUnknown: ``/proc/<pid>/fd`` is not readable by this user (the process is
            another user's) and ``pid`` may be the process that wrote the lock.
    """
    try:
        want = os.stat(path, follow_symlinks=False)
    except _ABSENT:
        return False  # removed meanwhile: its daemon has stopped
    except OSError as exc:
        raise DaemonStateUnknown(_unreadable_lock(path, exc)) from None
    fd_dir = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except (FileNotFoundError, ProcessLookupError):
        return False  # no such process
    except OSError as exc:
        uids = _process_uids(pid)
        if uids is not None and want.st_uid not in uids:
            # Another user's process cannot have written this user's lock: the daemon that
            # did is gone and its pid was reused (a stale lock, not a daemon).
            return False
        raise DaemonStateUnknown(
            f"cannot tell whether pid {pid} holds the daemon's lock {path}: {fd_dir} is not "
            f"readable ({exc.strerror}); it may be another user's daemon: run this as that "
            "user (or root)"
        ) from None
    for name in names:
        with contextlib.suppress(OSError):  # an fd closed meanwhile
            st = os.stat(os.path.join(fd_dir, name))  # follows the magic link to the file
            if (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino):
                return True
    return False


def _unreadable_lock(lock_path: str, exc: OSError) -> str:
    why = f"cannot read the daemon's lock {lock_path} ({exc.strerror or exc})"
    if isinstance(exc, PermissionError):
        return f"{why}: it may belong to another user; run this as that user (or root)"
    return f"{why}: whether a daemon serves there is unknown"


def daemon_pid(socket_path: str) -> int | None:
    """The pid of the live daemon that holds ``<socket>.lock``, or ``None`` when none does
    (module docstring).

    Raises:
        DaemonStateUnknown: this user cannot tell (the lock file, or its holder's
            ``/proc/<pid>/fd``, is not readable: another user's daemon). Never ``None`` then:
            ``stop`` would say "not running" and exit 0 while the daemon runs on.
    """
    lock_path = socket_path + ".lock"
    try:
        with open(lock_path, "rb") as f:
            text = f.read(64).decode(errors="replace").strip()
    except _ABSENT:
        return None
    except OSError as exc:
        raise DaemonStateUnknown(_unreadable_lock(lock_path, exc)) from None
    if not text.isdigit():
        return None
    pid = int(text)
    return pid if pid > 0 and _holds_open(pid, lock_path) else None


def _stats(
    target: str, token: str | None, timeout: float, socket_owner: int | None = None
) -> dict[str, Any]:
    from beton_serve.cli._stats import fetch_stats

    reply = fetch_stats(target, timeout=timeout, token=token, socket_owner=socket_owner)
    return {
        "pid": int(reply.pid),
        "uptime_s": round(float(reply.uptime_s), 3),
        "workers": int(reply.workers),
        "datasets": [d.name for d in reply.datasets],
        # name -> why, for each dataset refused until a restart (a file changed under it)
        "refused": {d.name: d.refused for d in reply.datasets if d.refused},
        "streams": len(reply.streams),
        "streams_opened": int(reply.streams_opened),
    }


def _duration(s: float) -> str:
    s = int(s)
    d, rem = divmod(s, 86400)
    h, rem = divmod(rem, 3600)
    m, sec = divmod(rem, 60)
    if d:
        return f"{d}d{h:02d}h{m:02d}m"
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s"


def run_status(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> int:
    """``beton-serve status``; returns 0 when a daemon runs, 3 when none does, 4
    (:data:`EXIT_STATUS_UNKNOWN`) when this user cannot tell (an ``error:`` line says why)."""
    from beton_wire.address import unix_target

    from beton_serve.errors import BetonError

    env = os.environ if environ is None else environ
    sock = resolve_socket_path(args.socket, env)
    target = unix_target(sock)
    try:
        pid = daemon_pid(sock)
    except DaemonStateUnknown as exc:
        if args.json:
            unknown = {"running": None, "address": target, "pid": None, "error": str(exc)}
            sys.stdout.write(json.dumps(unknown, sort_keys=True) + "\n")
        sys.stderr.write(f"error: {exc}\n")
        return EXIT_STATUS_UNKNOWN
    info: dict[str, Any] = {"running": pid is not None, "address": target, "pid": pid}
    if pid is not None:
        token = None
        if args.token_file:
            from beton_serve.transport.security import read_token_file

            token = read_token_file(args.token_file)
        else:
            token = env.get("BETON_SERVE_TOKEN") or None
        try:
            info.update(_stats(target, token, args.timeout, getattr(args, "socket_owner", None)))
            info["pid"] = pid  # the lock's (the Stats pid is the same, unless in a pid namespace)
        except BetonError as exc:
            info["stats_error"] = str(exc)
    if args.json:
        sys.stdout.write(json.dumps(info, sort_keys=True) + "\n")
    elif pid is None:
        sys.stdout.write(f"not running: no beton-serve daemon serves {target}\n")
    else:
        lines = [f"running: pid {pid}", f"  address   {target}"]
        if "stats_error" in info:
            lines.append(f"  stats unavailable: {info['stats_error']}")
        else:
            lines += [
                f"  uptime    {_duration(info['uptime_s'])}",
                f"  workers   {info['workers']}",
                f"  datasets  {', '.join(info['datasets']) or '(none)'}",
                f"  streams   {info['streams']} open, {info['streams_opened']} since start",
            ]
            lines += [
                f"  REFUSED   {name} until a restart: {why}"
                for name, why in sorted(info["refused"].items())
            ]
        sys.stdout.write("\n".join(lines) + "\n")
    return EXIT_RUNNING if pid is not None else EXIT_NOT_RUNNING


def _wait_exit(pid: int, pidfd: int | None, timeout: float) -> bool:
    """Wait until ``pid`` has exited; ``False`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    if pidfd is not None:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)  # readable once the process has exited
        return bool(poller.poll(max(0.0, timeout) * 1000))
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def run_stop(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> int:
    """``beton-serve stop``: SIGTERM the daemon holding the socket's lock and wait for its exit.

    Returns:
        0 when it has exited (or none was running), 1 when it is still running after
        ``--timeout`` seconds.

    Raises:
        ConfigError: the daemon belongs to another user (signalling it is not permitted).
        DaemonStateUnknown: this user cannot tell whether a daemon runs there (exit 1, never
            0: "not running" would leave another user's daemon running unsaid).
    """
    from beton_wire.address import unix_target

    env = os.environ if environ is None else environ
    sock = resolve_socket_path(args.socket, env)
    target = unix_target(sock)
    pid = daemon_pid(sock)
    if pid is None:
        sys.stdout.write(f"not running: no beton-serve daemon serves {target}\n")
        return 0
    pidfd = _pidfd(pid)
    try:
        if pidfd is not None and daemon_pid(sock) != pid:
            # It exited between the two looks (and the pid may be reused): nothing to stop.
            sys.stdout.write(f"not running: no beton-serve daemon serves {target}\n")
            return 0
        if not _send(pid, pidfd, signal.SIGTERM, target, "stopped"):
            sys.stdout.write(f"stopped: pid {pid} had already exited ({target})\n")
            return 0
        if not _wait_exit(pid, pidfd, args.timeout):
            sys.stderr.write(
                f"error: the daemon at {target} (pid {pid}) has not exited {args.timeout:g} s "
                f"after SIGTERM (still draining?); kill -KILL {pid} ends it at once\n"
            )
            return EXIT_STOP_TIMEOUT
    finally:
        if pidfd is not None:
            os.close(pidfd)
    sys.stdout.write(f"stopped: pid {pid} ({target})\n")
    return 0


def _pidfd(pid: int) -> int | None:
    """A pidfd for ``pid`` (signalling through it never reaches a reused pid); ``None`` where
    the kernel has none (Linux < 5.3) or the process is gone."""
    with contextlib.suppress(AttributeError, OSError):
        return os.pidfd_open(pid)
    return None


def _send(pid: int, pidfd: int | None, sig: signal.Signals, target: str, verb: str) -> bool:
    """Send ``sig`` to the daemon; ``False`` when it had already exited.

    Raises:
        ConfigError: it belongs to another user (the message says it cannot be ``verb``).
    """
    try:
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        raise ConfigError(
            f"the daemon at {target} (pid {pid}) belongs to another user; it cannot be {verb} "
            "from this account"
        ) from None
    return True


def _config_problem(pid: int) -> str | None:
    """Why SIGHUP would change nothing in daemon ``pid``: it runs without ``--config``, or its
    file does not load now (the daemon would log that and keep its config, and the command
    said "reload requested" with exit 0 either way). ``None`` when the file loads, or when the
    daemon's command line cannot be read (then the daemon's log is the only word)."""
    from beton_serve.cli.config import load_config

    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None
    words = [a.decode(errors="surrogateescape") for a in argv]
    path = None
    for i, w in enumerate(words):
        if w == "--config" and i + 1 < len(words):
            path = words[i + 1]
        elif w.startswith("--config="):
            path = w.split("=", 1)[1]
    if path is None:
        return "it runs without --config, so SIGHUP has no file to read"
    try:
        load_config(os.path.join(cwd, path))
    except ConfigError as exc:
        return f"its config file is invalid, so it keeps its current config: {exc}"
    return None


def run_reload(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> int:
    """``beton-serve reload``: SIGHUP the daemon holding the socket's lock, which re-reads its
    ``--config`` file (on a thread of its own) and logs what it applied or refused.

    Returns:
        0 when the signal was sent, 3 (:data:`EXIT_NOT_RUNNING`) when no daemon runs there, 1
        (:data:`EXIT_NOT_RELOADED`) when the daemon has no ``--config`` file or the file is
        invalid (checked here first; nothing is sent, and the daemon keeps its config).

    Raises:
        ConfigError: the daemon belongs to another user.
        DaemonStateUnknown: this user cannot tell whether a daemon runs there (nothing sent).
    """
    from beton_wire.address import unix_target

    env = os.environ if environ is None else environ
    sock = resolve_socket_path(args.socket, env)
    target = unix_target(sock)
    pid = daemon_pid(sock)
    pidfd = None if pid is None else _pidfd(pid)
    try:
        if pid is None or (pidfd is not None and daemon_pid(sock) != pid):
            sys.stderr.write(f"not running: no beton-serve daemon serves {target}\n")
            return EXIT_NOT_RUNNING
        problem = _config_problem(pid)
        if problem is not None:
            sys.stderr.write(f"not reloaded: pid {pid} ({target}): {problem}\n")
            return EXIT_NOT_RELOADED
        if not _send(pid, pidfd, signal.SIGHUP, target, "reloaded"):
            sys.stderr.write(f"not running: pid {pid} had already exited ({target})\n")
            return EXIT_NOT_RUNNING
    finally:
        if pidfd is not None:
            os.close(pidfd)
    sys.stdout.write(
        f"reload requested: pid {pid} ({target}); its log says what changed "
        "('config reloaded ...') or why not\n"
    )
    return 0
