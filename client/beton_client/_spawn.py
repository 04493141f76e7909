"""Auto-spawn: start a daemon for a file when none answers (``Loader(..., spawn=True)``).

Protocol: every process that finds no daemon at the Unix socket takes an exclusive ``flock`` on
``<socket>.spawn.lock``; the first one checks again, starts ``beton-serve FILE --socket PATH
--idle-timeout S`` in its own session (detached: it outlives the trainer, which lets the next
trainer share it), and waits until it answers; the others, once they hold the lock, find it
answering. The daemon takes its own lock on ``<socket>.lock``, so even a racing manual start
cannot make two daemons serve one address. The spawned daemon exits after ``S`` idle seconds.
Its log goes to ``<socket>.log``.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time

import grpc

from beton_client.errors import ServerUnavailable

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


def ensure_daemon(
    socket_path: str, dataset_file: str, *, idle_timeout: float, wait: float = 60.0
) -> None:
    """Make sure a daemon serves ``socket_path``, spawning one for ``dataset_file`` if needed.

    Raises:
        ServerUnavailable: the spawned daemon did not answer within ``wait`` seconds or exited
            (its log's tail is in the message).
    """
    target = "unix://" + os.path.abspath(socket_path)
    if daemon_answers(target, 0.5):
        return
    directory = os.path.dirname(os.path.abspath(socket_path))
    os.makedirs(directory, mode=0o700, exist_ok=True)
    fd = os.open(socket_path + ".spawn.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ServerUnavailable(
                        f"timed out waiting for another process to start a daemon at {socket_path}"
                    ) from None
                time.sleep(0.05)
        if daemon_answers(target, 0.5):
            return
        log_path = socket_path + ".log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [
                    sys.executable,
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
            )
        while time.monotonic() < deadline:
            if daemon_answers(target, 0.25):
                return
            if proc.poll() is not None:
                raise ServerUnavailable(
                    f"the beton-serve daemon started for {dataset_file} exited with status "
                    f"{proc.returncode}: {_tail(log_path)}"
                )
            time.sleep(0.05)
        raise ServerUnavailable(
            f"the beton-serve daemon started for {dataset_file} did not answer within {wait} s: "
            f"{_tail(log_path)}"
        )
    finally:
        os.close(fd)


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace").strip()
    except OSError:
        return "(no log)"
