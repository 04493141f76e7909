"""Auto-spawn: start a daemon for a file when none answers (``Loader(..., spawn=True)``).

Protocol: every process that finds no daemon at the Unix socket takes an exclusive ``flock`` on
``<socket>.spawn.lock``; the first one checks again, starts ``beton-serve FILE --socket PATH
--idle-timeout S`` in its own session (detached: it outlives the trainer, which lets the next
trainer share it), and waits until it answers; the others, once they hold the lock, find it
answering. The daemon takes its own lock on ``<socket>.lock``, so even a racing manual start
cannot make two daemons serve one address. The spawned daemon exits after ``S`` idle seconds.
Its log goes to ``<socket>.log``.

No files are left behind: the spawner unlinks ``<socket>.spawn.lock`` before it lets go of it
(a process that locked the file just unlinked sees that the path no longer names it, and locks
the current one), and a daemon that stops cleanly removes its ``<socket>.log``, its socket and
its ``.lock``. The log stays only when the daemon failed, so the user can read why (its tail is
also in the ``ServerUnavailable`` message). A spawned daemon that lost the address to a daemon
that was stopping (exit status 75, and then nothing answers) is spawned again, up to 3 times.

Trust: the socket's directory is created 0700 when missing and must be the expected user's,
writable by nobody else; an existing socket must be that user's before it is even probed; the
``.spawn.lock`` and ``.log`` files are opened without following symbolic links and created with
``O_EXCL`` (``beton_wire.private_dir``). Anything else raises ``UntrustedSocketError``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import time

import grpc
from beton_wire.address import ADDRESS_IN_USE_STATUS, DATA_ERROR_STATUS
from beton_wire.private_dir import (
    UnsafePathError,
    ensure_private_dir,
    names_file,
    open_private_file,
)

from beton_client.errors import FormatError, ServerUnavailable, UntrustedSocketError

__all__ = ["daemon_answers", "ensure_daemon"]


def daemon_answers(target: str, timeout: float = 1.0) -> bool:
    """Whether a gRPC server accepts a connection at ``target`` within ``timeout`` seconds."""
    if target.startswith("unix:"):
        path = target[len("unix://") :] if target.startswith("unix://") else target[len("unix:") :]
        if not os.path.exists(path):
            return False
    channel = grpc.insecure_channel(target)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        channel.close()


def _private_fd(path: str, flags: int, uid: int) -> int:
    """``open_private_file`` with the client's errors."""
    try:
        return open_private_file(path, flags, uid)
    except UnsafePathError as exc:
        raise UntrustedSocketError(
            f"refusing to use {path}: {exc}; remove it, or use a socket in a directory of your own"
        ) from None
    except OSError as exc:
        raise ServerUnavailable(f"cannot open {path} to start a daemon: {exc}") from None


def ensure_daemon(
    socket_path: str,
    dataset_file: str,
    *,
    idle_timeout: float,
    wait: float = 60.0,
    owner: int | None = None,
) -> None:
    """Make sure a daemon serves ``socket_path``, spawning one for ``dataset_file`` if needed.

    Args:
        socket_path: the Unix socket.
        dataset_file: what a spawned daemon serves.
        idle_timeout: seconds a spawned daemon waits without clients before it exits.
        wait: seconds to wait for a spawned daemon to answer.
        owner: the uid that must own the directory and the socket (default: this process's).

    Raises:
        UntrustedSocketError: the directory, the socket or a lock or log file is not the
            expected user's (see the module docstring).
        ServerUnavailable: the spawned daemon did not answer within ``wait`` seconds or exited
            (its log's tail is in the message).
    """
    from beton_client._security import check_unix_target

    target = "unix://" + os.path.abspath(socket_path)
    uid = os.getuid() if owner is None else owner
    directory = os.path.dirname(os.path.abspath(socket_path))
    try:
        ensure_private_dir(directory, uid)
    except UnsafePathError as exc:
        raise UntrustedSocketError(
            f"refusing to use the socket directory of {target}: {exc}. Another user may have "
            "created it to serve you their data: remove it, or use a socket in a directory of "
            "your own"
        ) from None
    except OSError as exc:
        raise ServerUnavailable(f"cannot create the socket directory {directory}: {exc}") from None
    check_unix_target(target, uid, missing_ok=True)  # the directory is ensured above
    if daemon_answers(target, 0.5):
        return
    lock_path = socket_path + ".spawn.lock"
    deadline = time.monotonic() + wait
    fd = _lock(lock_path, deadline, socket_path)
    try:
        if daemon_answers(target, 0.5):
            return
        log_path = socket_path + ".log"
        proc = _spawn(socket_path, dataset_file, idle_timeout, log_path)
        respawns = 0
        while time.monotonic() < deadline:
            if daemon_answers(target, 0.25):
                return
            if proc.poll() is not None:
                if proc.returncode == ADDRESS_IN_USE_STATUS:
                    # A daemon started by hand (or by another client) took the socket's lock
                    # first and is still starting: wait for it to answer instead.
                    if daemon_answers(target, max(0.1, min(5.0, deadline - time.monotonic()))):
                        return
                    if respawns < _MAX_RESPAWNS and not _lock_holder_alive(socket_path):
                        # That daemon was stopping (idle exit, beton-serve stop) and is gone.
                        respawns += 1
                        proc = _spawn(socket_path, dataset_file, idle_timeout, log_path)
                    continue
                why = (
                    f"the beton-serve daemon started for {dataset_file} exited with status "
                    f"{proc.returncode} (its log: {log_path}): {_tail(log_path)}"
                )
                if proc.returncode == DATA_ERROR_STATUS:  # the file: as the in-process Loader
                    raise FormatError(why, code="DATA_LOSS")
                raise ServerUnavailable(why)
            time.sleep(0.05)
        raise ServerUnavailable(
            f"the beton-serve daemon started for {dataset_file} did not answer within {wait} s "
            f"(its log: {log_path}): {_tail(log_path)}"
        )
    finally:
        if names_file(lock_path, fd):
            with contextlib.suppress(OSError):
                os.unlink(lock_path)
        os.close(fd)


_MAX_RESPAWNS = 3


def _lock_holder_alive(socket_path: str) -> bool:
    """Whether the pid written in ``<socket>.lock`` (the daemon holding the address) is alive."""
    try:
        with open(socket_path + ".lock", "rb") as f:
            text = f.read(32).strip()
        pid = int(text)
    except (OSError, ValueError):
        return False
    if pid <= 0:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) holds no lock
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[:1] != [b"Z"]
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _lock(path: str, deadline: float, socket_path: str) -> int:
    """An exclusive ``flock`` on ``path``, polled until ``deadline``; returns its descriptor.

    Raises:
        ServerUnavailable: another process held it past the deadline.
    """
    fd = _private_fd(path, os.O_RDWR, os.getuid())
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise ServerUnavailable(
                    f"timed out waiting for another process to start a daemon at {socket_path}"
                ) from None
            time.sleep(0.05)
            continue
        if names_file(path, fd):
            return fd
        # Its holder unlinked it on the way out: lock the file that is there now.
        os.close(fd)
        fd = _private_fd(path, os.O_RDWR, os.getuid())


def _spawn(
    socket_path: str, dataset_file: str, idle_timeout: float, log_path: str
) -> subprocess.Popen[bytes]:
    """Start a detached daemon for ``dataset_file`` on ``socket_path``, logging to ``log_path``."""
    with os.fdopen(_private_fd(log_path, os.O_WRONLY | os.O_APPEND, os.getuid()), "ab") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-P",  # not the trainer's working directory on sys.path: nobody plants modules
                "-c",
                "import sys; from beton_serve.cli import main; sys.exit(main())",
                "serve",
                os.path.abspath(dataset_file),
                "--socket",
                os.path.abspath(socket_path),
                "--idle-timeout",
                str(idle_timeout),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            # Not the trainer's directory: the daemon outlives the job, and held it (an unmount
            # failed with EBUSY, a deleted job directory stayed its cwd). Every path is absolute.
            cwd="/",
        )
        _unpin(proc)
        return proc


def _unpin(proc: subprocess.Popen[bytes]) -> None:
    """Let the spawned daemon run on every CPU the machine (its cpuset) allows, not only the
    trainer's: a rank pinned by ``taskset``, torchrun or numactl spawned a daemon pinned to that
    rank's cores, and every later trainer shared that one small pool (the daemon sizes its
    workers from its affinity). Set from here, not in the child before ``exec`` (``preexec_fn``
    is unsafe in a process with threads, as a trainer is); the daemon reads its affinity once it
    has started Python, long after this. The kernel keeps the mask within the cpuset."""
    try:
        os.sched_setaffinity(proc.pid, range(os.cpu_count() or 1))
    except (AttributeError, OSError):  # not Linux, or the daemon exited already
        pass


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace").strip()
    except OSError:
        return "(no log)"
