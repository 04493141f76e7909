"""Trusting the socket directory: the checks that the daemon and its clients both apply.

A daemon and its clients meet in a directory: the per-user ``/tmp/beton-serve-<uid>/`` or
``$XDG_RUNTIME_DIR/beton-serve/`` (:mod:`beton_wire.address`), or the directory of an explicit
``--socket`` / ``server=`` path. Whoever can write that directory can plant a socket there (the
victim's Loader would read the planter's data) or a symbolic link where a lock file is opened (the
daemon would truncate the link's target). So, on both sides:

* the directory is ``lstat``-ed, never followed: it must be a real directory, owned by the
  expected user, that neither its group nor others may write (:func:`check_private_dir`);
* files in it (``<socket>.lock``, ``<socket>.spawn.lock``, ``<socket>.log``) are opened with
  ``O_NOFOLLOW``; a missing one is created with ``O_EXCL``; what was opened must be a regular
  file of the expected user with a single link (:func:`open_private_file`);
* a client connects only to a socket that the expected user owns (:func:`check_socket`).

Each refusal raises :class:`UnsafePathError` (a ``PermissionError``) saying what is wrong; the
daemon turns it into ``ConfigError`` and the client into ``UntrustedDaemonError``, each adding
what to do. The checks run before the path is used and the directory cannot change owner
afterwards (only its owner or root could), so the time between check and use gives nothing away.
"""

from __future__ import annotations

import errno
import os
import stat

__all__ = [
    "names_file",
    "UnsafePathError",
    "check_private_dir",
    "check_socket",
    "ensure_private_dir",
    "unix_target_problem",
    "open_private_file",
    "remedy",
    "trusted_socket_present",
]

#: Mode bits that let someone other than the owner create, remove or rename entries.
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


class UnsafePathError(PermissionError):
    """A path that the rules of this module refuse.

    Attributes:
        path: the refused path.
        reason: what is wrong with it (for example "is owned by uid 1001, not 1000").
    """

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path} {reason}")
        self.path = path
        self.reason = reason


def _lstat(path: str) -> os.stat_result | None:
    """``os.lstat``; ``None`` when nothing is there.

    Raises:
        UnsafePathError: it cannot be looked at (a directory above it that this user may not
            search): the expected user's daemon would not be reachable there either.
    """
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None
    except PermissionError as exc:
        raise UnsafePathError(path, f"cannot be looked at ({exc.strerror})") from None


def check_private_dir(path: str, uid: int) -> None:
    """Refuse ``path`` unless it is a directory (not a link to one) that ``uid`` owns and that
    neither its group nor others may write.

    Raises:
        UnsafePathError: it is missing, a symbolic link, not a directory, owned by another user
            or writable by others.
    """
    st = _lstat(path)
    if st is None:
        raise UnsafePathError(path, "does not exist")
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(path, "is a symbolic link, not a directory")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(path, "is not a directory")
    if st.st_uid != uid:
        raise UnsafePathError(path, f"is owned by uid {st.st_uid}, not by uid {uid}")
    if st.st_mode & _OTHERS_WRITE:
        raise UnsafePathError(
            path, f"is writable by its group or by others (mode {stat.S_IMODE(st.st_mode):04o})"
        )


def ensure_private_dir(path: str, uid: int) -> None:
    """Create ``path`` with mode 0700 when it is missing (parents as ``os.makedirs`` does),
    then apply :func:`check_private_dir` to it, whoever created it.

    Raises:
        UnsafePathError: see :func:`check_private_dir`.
        OSError: it cannot be created (e.g. a parent is not writable).
    """
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:  # a dangling symbolic link or a file: check_private_dir says which
        pass
    check_private_dir(path, uid)


def open_private_file(path: str, flags: int, uid: int, mode: int = 0o600) -> int:
    """Open ``path`` in a checked directory without following a symbolic link.

    An existing file is opened (``O_NOFOLLOW``); a missing one is created with ``O_EXCL`` (and
    ``mode``), so the file opened is always either this user's existing file or a new one.

    Args:
        path: the file.
        flags: the access flags (``os.O_RDWR``, ``os.O_WRONLY | os.O_APPEND``, ...), without
            ``O_CREAT`` or ``O_EXCL``.
        uid: the user that must own the file.
        mode: permission bits of a new file.

    Returns:
        A blocking file descriptor (close-on-exec) that the caller closes.

    Raises:
        UnsafePathError: it is a symbolic link, not a regular file (a FIFO, a device, a
            directory), has other hard links, or belongs to another user.
        OSError: it cannot be opened or created for another reason.
    """
    base = flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # a planted FIFO must not block
    for _ in range(16):
        try:
            fd = os.open(path, base)
            break
        except FileNotFoundError:
            try:
                fd = os.open(path, base | os.O_CREAT | os.O_EXCL, mode)
                break
            except FileExistsError:
                continue  # another process created it meanwhile: open that one
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafePathError(path, "is a symbolic link") from None
            raise
    else:
        raise UnsafePathError(path, "keeps appearing and disappearing")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(path, "is not a regular file")
        if st.st_uid != uid:
            raise UnsafePathError(path, f"is owned by uid {st.st_uid}, not by uid {uid}")
        if st.st_nlink != 1:
            raise UnsafePathError(path, f"has {st.st_nlink} hard links")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_socket(path: str, uid: int) -> bool:
    """Whether a socket that ``uid`` owns is at ``path`` (``False``: nothing is there).

    Raises:
        UnsafePathError: something else is there: a symbolic link, another kind of file, or a
            socket of another user.
    """
    st = _lstat(path)
    if st is None:
        return False
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(path, "is a symbolic link, not the daemon's socket")
    if not stat.S_ISSOCK(st.st_mode):
        raise UnsafePathError(path, "is not a socket")
    if st.st_uid != uid:
        raise UnsafePathError(path, f"is a socket owned by uid {st.st_uid}, not by uid {uid}")
    return True


def unix_target_problem(path: str, uid: int) -> str | None:
    """Why a client must not connect to the socket at ``path`` expecting a daemon of ``uid``
    (its directory or the socket is not ``uid``'s, or others may write the directory), or
    ``None``. A missing directory or socket is no problem: no daemon answers there."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        if os.path.lexists(directory):
            check_private_dir(directory, uid)
            check_socket(path, uid)
    except UnsafePathError as exc:
        return str(exc)
    return None


def trusted_socket_present(path: str, uid: int) -> bool:
    """Whether a socket of ``uid`` is at ``path``, in a directory that only ``uid`` may write:
    the only state in which a client may connect, since nobody else can put a socket there
    afterwards. ``False`` when the directory or the socket is missing: connecting later (a
    retry, gRPC's ``wait_for_ready``) would go to whatever appears there, perhaps a directory
    and a socket another user made meanwhile, so look again instead.

    Raises:
        UnsafePathError: the directory or the socket is there but not trusted
            (:func:`check_private_dir`, :func:`check_socket`).
    """
    directory = os.path.dirname(os.path.abspath(path))
    if _lstat(directory) is None:
        return False
    check_private_dir(directory, uid)  # first: once it passes, nobody else can plant the socket
    return check_socket(path, uid)


def names_file(path: str, fd: int) -> bool:
    """Whether ``path`` (not followed if a link) is the file open as ``fd``: a lock or log file
    is removed on a clean stop only while it is still the one this process opened."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def remedy(exc: UnsafePathError, uid: int) -> str:
    """What the user whose uid is ``uid`` can do about the path ``exc`` refused, in one
    sentence (the caller adds its own alternative, such as another socket path): "remove it"
    is no advice for a shared directory like ``/tmp``, nor for a directory of another user,
    which only that user or root may remove from a sticky ``/tmp``."""
    try:
        st = os.lstat(exc.path)
    except OSError:
        return "Only its owner or root can change that"
    if (
        stat.S_ISDIR(st.st_mode)
        and (st.st_mode & stat.S_ISVTX or st.st_uid == 0)
        and st.st_uid != uid
    ):
        return (
            f"{exc.path} is a shared directory (mode {stat.S_IMODE(st.st_mode):04o}); the "
            "socket's directory must be one of your own (mode 0700)"
        )
    if st.st_uid != uid:
        return (
            f"Another user may have created it to intercept this daemon or its clients; only "
            f"uid {st.st_uid} or root can remove it"
        )
    return "Another user may have put it there: remove it"
