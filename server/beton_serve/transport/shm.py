"""The shared-memory transport: a slot ring in one POSIX shared-memory segment (DESIGN.md §6).

Data structure: a segment ``/dev/shm/beton-<daemon pid>-<instance>-ring-<n>`` (:class:`ShmNamer`)
of ``slot_count`` slots laid
out by :func:`beton_wire.slots.slot_layout`, followed by the sample-id table: one row of
``batch_size`` little-endian uint64 per slot, written by :meth:`ShmRing.write_ids` when the slot is
published (clients on the notice channel read a batch's ids there instead of in a message),
then the release words of :mod:`beton_wire.notice` (``[starved, wait_us, one per slot]``): a
client on the notice channel releases a slot by storing its lease token there
(:meth:`ShmRing.arm`, :meth:`ShmRing.reap`). The daemon creates it with mode 0600 (``O_EXCL``, so
a name is never reused), maps it once, and hands the engine numpy views of a slot to write into;
the client maps the same segment once and wraps slot views as tensors without copying.

Ownership: the daemon (the creator) unlinks the segment in :meth:`ShmRing.close`, which the stream
calls in a ``finally``, and unmaps it there too (:func:`release_mapping`): the mapping and its
descriptor go at once, or, while a view handed to an engine worker is still alive (a cancelled
batch still being written), with that last view, by reference counting. Nothing in the daemon may
keep a batch view in a reference cycle, or the mapping would wait for the garbage collector
(issue 11: closed streams held 0.4-1.6 GiB of unlinked rings). If the daemon is killed before it
can unlink, the next daemon removes the segment (:func:`sweep_stale_segments`): it knows a dead
daemon's segments by their name's prefix, whose live marker nobody holds locked any more.
Clients never unlink.

Truncation: the segment is a file in ``/dev/shm`` that the client opens read-write, so a client
of the daemon's user can shrink it. The daemon's next write or read of a page past the new end
raised SIGBUS, which killed the daemon and every stream. The mapping is guarded
(:func:`guard_segment`, the ``.beton`` files' SIGBUS guard with writable zero pages): the access
completes into private memory, and the next publish fails that stream with ``TransportError``
(:meth:`ShmRing.publish`). Sharing arenas (``transport.arena``) are guarded alike.

Leases: each slot is FREE, FILLING (the engine writes into it) or LEASED (the client reads it).
Slot states change only under the owning stream's lock (``daemon._stream.Stream.lock``): on
the daemon's event-loop thread, or on the engine worker that publishes a finished batch (the
notice pump, ``daemon._pump``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import logging
import mmap
import os
import re
import secrets
import stat
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from beton_wire import notice
from beton_wire.slots import SlotLayout

from beton_serve.errors import TransportError
from beton_serve.transport.base import HostSlotRing, Published, TransportSetup

if TYPE_CHECKING:
    import asyncio

__all__ = [
    "SHM_DIR",
    "ShmFactory",
    "ShmNamer",
    "ShmRing",
    "create_segment",
    "guard_segment",
    "daemon_namer",
    "pid_alive",
    "release_mapping",
    "truncation_error",
    "StaleSweeper",
    "sweep_stale_segments",
]

log = logging.getLogger("beton_serve.transport.shm")

#: Where Linux exposes POSIX shared memory as files.
SHM_DIR = Path("/dev/shm")

#: A segment's name: ``beton-<pid>-<instance>-<purpose>-<n>`` (:class:`ShmNamer`); the
#: instance is absent in names of releases before it (``beton-<pid>-<purpose>-<n>``).
_NAME = re.compile(r"^beton-(\d+)-(?:([0-9a-f]{16})-)?")
#: The purpose of a daemon's live marker (:class:`ShmNamer`).
LIVE = "live"
#: What ``publish`` returns: the client reads the slot through its own mapping.
_PUBLISHED = Published()


class ShmNamer:
    """Hands out segment names ``beton-<pid>-<instance>-<purpose>-<n>``, unique within this
    daemon; ``instance`` is 16 random hex digits, drawn once per namer.

    Why random: another local user could otherwise create files under the names a daemon will
    use next (``O_EXCL`` then refuses them: every shm stream failed) or, in ``/dev/shm`` shared
    by containers, a daemon restarted as PID 1 would meet its own predecessor's names.

    Args:
        pid: the pid in the names (default: this process's).
        shm_dir: where the segments and the marker live.
        mark_live: create and hold (``flock``) the live marker ``beton-<pid>-<instance>-live``
            for as long as the namer is open: :func:`sweep_stale_segments` leaves the names of a
            held marker alone, in any PID namespace, and removes them once nobody holds it (the
            daemon exited or was killed). The daemon's namer is marked; :meth:`close` removes
            the marker.

    Raises:
        OSError: the marker cannot be created.
    """

    def __init__(
        self, pid: int | None = None, *, shm_dir: Path = SHM_DIR, mark_live: bool = False
    ) -> None:
        self.pid = os.getpid() if pid is None else pid
        self.instance = secrets.token_hex(8)
        self.prefix = f"beton-{self.pid}-{self.instance}-"
        self._counter = itertools.count()
        self._live: Path | None = None
        self._live_fd = -1
        self._lock = threading.Lock()
        if mark_live:
            self._live, self._live_fd = _make_live_marker(shm_dir, self.prefix + LIVE)

    def next(self, purpose: str) -> str:
        """A fresh name for a segment used for ``purpose`` (letters only, e.g. ``"ring"``)."""
        return f"{self.prefix}{purpose}-{next(self._counter)}"

    def close(self) -> None:
        """Remove the live marker and release its lock (idempotent). Call once the namer's
        segments are unlinked: a sweep would remove one left behind."""
        with self._lock:
            live, fd = self._live, self._live_fd
            self._live, self._live_fd = None, -1
        if live is not None:
            with contextlib.suppress(OSError):
                live.unlink()
            os.close(fd)


def daemon_namer(shm_dir: Path = SHM_DIR) -> ShmNamer:
    """The daemon's namer, marked live (:class:`ShmNamer`); unmarked, with a warning, where
    the marker cannot be made (its segments are then swept by their pid alone)."""
    try:
        return ShmNamer(shm_dir=shm_dir, mark_live=True)
    except OSError as exc:
        log.warning(
            "cannot create a live marker in %s (%s): a daemon in another PID namespace "
            "could take this daemon's segments for stale ones",
            shm_dir,
            exc,
        )
        return ShmNamer()


def _make_live_marker(shm_dir: Path, name: str) -> tuple[Path, int]:
    """Create ``shm_dir/name`` (0600) already locked: it is made under a hidden name, locked,
    then linked in place, so a sweep never sees it unlocked while its daemon lives."""
    final = shm_dir / name
    hidden = shm_dir / ("." + name)
    fd = os.open(hidden, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.link(hidden, final)
    except BaseException:
        os.close(fd)
        raise
    finally:
        with contextlib.suppress(OSError):
            hidden.unlink()
    return final, fd


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs: not gone, and not a zombie (killed, not yet reaped by its
    parent), which is dead for every purpose here."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _marker_held(path: Path) -> bool | None:
    """Whether a live marker is locked by its daemon (``None``: there is no such marker).
    A marker that cannot be opened or locked for another reason counts as held."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # releases the lock taken: the marker is removed with its group below
    return False


def sweep_stale_segments(
    shm_dir: Path = SHM_DIR, *, keep: str = "", departed: list[str] | None = None
) -> list[str]:
    """Unlink this user's segments of daemons that are gone.

    Called by the daemon at start. A name ``beton-<pid>-<instance>-...`` belongs to a daemon
    that is gone when its live marker (:class:`ShmNamer`) is held by nobody; this holds across
    PID namespaces (containers sharing ``/dev/shm``), where the pid in a name means nothing
    here. A name without a marker (an unmarked namer, or a release before markers) falls back
    to the pid: gone when no process of that pid runs here.

    Only what a daemon creates is removed: regular files (rings, arenas, markers) and sockets
    (the notice channel) that this user owns, looked at with ``lstat``. Symbolic links, other
    kinds of files, other users' files and the segments of live daemons are left alone:
    ``/dev/shm`` is shared, and anyone may create a ``beton-*`` name.

    Args:
        shm_dir: the directory to sweep.
        keep: a name prefix never removed (the calling daemon's own, :attr:`ShmNamer.prefix`).
        departed: if given, receives the prefix of each group left because its marker is
            still locked although no process of its pid runs here: a daemon killed a moment
            ago whose last threads still hold the lock while its main thread is a zombie, or
            a live daemon in another PID namespace. Worth sweeping again soon
            (:class:`StaleSweeper`).

    Returns:
        The names removed.
    """
    removed: list[str] = []
    if not shm_dir.is_dir():
        return removed
    uid = os.getuid()
    me = os.getpid()
    held: dict[str, bool | None] = {}  # a group's prefix -> _marker_held
    markers: list[Path] = []
    for entry in shm_dir.iterdir():
        name = entry.name
        if name.startswith(".") and _stale_hidden_marker(entry, uid, keep):
            if _unlink(entry):
                removed.append(name)
            continue
        m = _NAME.match(name)
        if m is None or (keep and name.startswith(keep)):
            continue
        try:
            st = entry.lstat()
        except OSError:
            continue
        if st.st_uid != uid or not (stat.S_ISREG(st.st_mode) or stat.S_ISSOCK(st.st_mode)):
            continue
        pid, prefix = int(m.group(1)), m.group(0)
        if m.group(2) is not None:
            if prefix not in held:
                held[prefix] = _marker_held(shm_dir / (prefix + LIVE))
                if held[prefix] and departed is not None and pid != me and not pid_alive(pid):
                    departed.append(prefix)
            alive = held[prefix]
            if alive is None:  # no marker: the pid decides, as for the older names
                alive = pid == me or pid_alive(pid)
        else:
            alive = pid == me or pid_alive(pid)
        if alive:
            continue
        if name == prefix + LIVE:
            markers.append(entry)  # last: a sweep running beside this one still sees the group
            continue
        if _unlink(entry):
            removed.append(name)
    removed += [e.name for e in markers if _unlink(e)]
    if removed:
        log.info("swept %d stale shared-memory segment(s): %s", len(removed), ", ".join(removed))
    return removed


#: When a daemon sweeps again, in seconds after its start, while its last sweep left a group
#: whose marker was still locked although no process of its pid ran (:class:`StaleSweeper`).
RESWEEP_DELAYS_S = (1.0, 4.0, 15.0)


class StaleSweeper:
    """A daemon's sweeps of stale segments (:func:`sweep_stale_segments`): one at its start,
    then a few more shortly after, while a sweep leaves a group that is likely a killed
    daemon's.

    Why: a daemon started right after ``kill -9`` of its predecessor can find that daemon's
    live marker still locked. The killed daemon's main thread is a zombie while its other
    threads, still exiting, hold the lock for a moment, so one sweep at start left its
    segments until the next daemon's start. Such a group is swept again at
    :data:`RESWEEP_DELAYS_S` after :meth:`start`, and no more once a sweep leaves none (a
    group held by a live daemon in another PID namespace is looked at those few times, then
    left alone, as before).

    Owner: the daemon, which calls :meth:`sweep` when it is created, :meth:`start` on its
    event loop and :meth:`close` when it stops (it cancels the sweeps still due).

    Args:
        shm_dir: the directory swept.
        delays: the seconds after :meth:`start` of each further sweep (each only while the
            previous one left a departed daemon's group).
    """

    def __init__(
        self, shm_dir: Path = SHM_DIR, delays: tuple[float, ...] = RESWEEP_DELAYS_S
    ) -> None:
        self.shm_dir = shm_dir
        self.delays = tuple(delays)
        #: A name prefix never removed (the daemon's own, set once its namer exists).
        self.keep = ""
        #: The groups the last sweep left although their pid is gone (``departed``).
        self.pending: list[str] = []
        self._handle: asyncio.TimerHandle | None = None  # the next sweep
        self._closed = False

    def sweep(self) -> list[str]:
        """Sweep now; returns the names removed. Never raises for a directory it cannot
        read: a daemon starts whatever ``/dev/shm`` holds."""
        departed: list[str] = []
        try:
            removed = sweep_stale_segments(self.shm_dir, keep=self.keep, departed=departed)
        except OSError as exc:
            log.warning("cannot sweep stale segments in %s: %s", self.shm_dir, exc)
            removed = []
        self.pending = departed
        return removed

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Schedule the further sweeps on ``loop``, if the last sweep left
        a departed daemon's group."""
        if self.pending and self.delays and not self._closed and self._handle is None:
            self._handle = loop.call_later(self.delays[0], self._again, loop, 1)

    def _again(self, loop: asyncio.AbstractEventLoop, i: int) -> None:
        self._handle = None
        if self._closed:
            return
        self.sweep()
        if self.pending and i < len(self.delays):
            wait = self.delays[i] - self.delays[i - 1]
            self._handle = loop.call_later(wait, self._again, loop, i + 1)

    def close(self) -> None:
        """Cancel the sweeps still due (idempotent)."""
        self._closed = True
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


#: A hidden live marker (``_make_live_marker``'s creation name) older than this, and locked by
#: nobody, was left by a daemon killed in the microseconds between creating and linking it.
HIDDEN_MARKER_GRACE_S = 60.0


def _stale_hidden_marker(entry: Path, uid: int, keep: str) -> bool:
    """Whether ``entry`` is a ``.beton-<pid>-<instance>-live`` creation name of this user that
    nobody holds and that is older than :data:`HIDDEN_MARKER_GRACE_S` (a daemon that is starting
    holds it, linked, within microseconds; the age keeps a sweep from racing that moment)."""
    name = entry.name[1:]
    m = _NAME.match(name)
    if m is None or m.group(2) is None or name != m.group(0) + LIVE:
        return False
    if keep and name.startswith(keep):
        return False
    try:
        st = entry.lstat()
    except OSError:
        return False
    if st.st_uid != uid or not stat.S_ISREG(st.st_mode):
        return False
    if time.time() - st.st_mtime < HIDDEN_MARKER_GRACE_S:
        return False
    return _marker_held(entry) is False


def _out_of_descriptors(exc: OSError) -> str:
    """The hint for a process out of file descriptors (``EMFILE``/``ENFILE``), else ``""``."""
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        return (
            "; the daemon is out of file descriptors (not of /dev/shm space): raise its limit "
            "(ulimit -n, LimitNOFILE=) or close streams"
        )
    return ""


def _unlink(entry: Path) -> bool:
    try:
        entry.unlink()
    except FileNotFoundError:  # another sweep got there first
        return False
    except OSError as exc:
        log.warning("could not remove stale segment %s: %s", entry.name, exc)
        return False
    return True


def create_segment(path: Path, size: int) -> mmap.mmap:
    """Create ``path`` (mode 0600, never an existing file), allocate ``size`` bytes and map it.

    Raises:
        TransportError: it cannot be created or allocated (e.g. ``/dev/shm`` is full); a file
            created before the failure is removed.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise TransportError(
            f"cannot create shared-memory segment {path}: {exc}{_out_of_descriptors(exc)}"
        ) from exc
    try:
        os.fchmod(fd, 0o600)  # the umask may have narrowed it; never widen beyond 0600
        os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size, mmap.MAP_SHARED)
    except OSError as exc:
        path.unlink(missing_ok=True)
        hint = _out_of_descriptors(exc) or "; free space in /dev/shm or lower batches_ahead"
        raise TransportError(
            f"cannot allocate {size} bytes of shared memory for {path} ({exc}){hint}"
        ) from exc
    finally:
        os.close(fd)


def guard_segment(m: mmap.mmap, base: np.ndarray) -> Any:
    """Guard a segment this process created and mapped (``base``: a view of all of it)
    against truncation by another process (module docstring); the ``Region``, or ``None``
    where no guard can be had (the mapping is then unguarded, as before)."""
    from beton_serve.format import guard_mapping

    return guard_mapping(m, int(base.ctypes.data), int(base.nbytes), writable=True)


def truncation_error(region: Any, name: str) -> TransportError | None:
    """The error of a guarded segment some page of which was read or written past its end."""
    if region is None or not region.hits():
        return None
    return TransportError(
        f"shared-memory segment {name} was truncated under the daemon (another process of its "
        "user shrank it): this stream's batches are no longer in it"
    )


def release_mapping(m: mmap.mmap | None, name: str = "") -> bool:
    """Unmap ``m`` and close its descriptor now; whether that happened.

    When numpy views of it are still alive (``BufferError``), nothing is unmapped here: the
    caller drops its own reference, and the mapping and descriptor are released with the last
    view (reference counting; a view kept in a reference cycle would delay it until the garbage
    collector runs, which is why the daemon breaks such cycles).
    """
    if m is None or m.closed:
        return True
    try:
        m.close()
    except BufferError:
        log.debug("segment %s is still viewed; it is unmapped with its last view", name)
        return False
    return True


class ShmRing(HostSlotRing):
    """A ring of batch slots in a POSIX shared-memory segment created by this process.

    Args:
        layout: the slot layout of the stream.
        slot_count: number of slots (at least 1).
        name: the segment name (from :class:`ShmNamer`).
        shm_dir: where segments live (``/dev/shm``).

    Raises:
        TransportError: the segment cannot be created (e.g. ``/dev/shm`` is full), naming it.
    """

    kind = "shm"

    def __init__(
        self, layout: SlotLayout, slot_count: int, name: str, shm_dir: Path = SHM_DIR
    ) -> None:
        if slot_count < 1:
            raise TransportError(f"a ring needs at least one slot, not {slot_count}")
        self.layout = layout
        self.slot_count = slot_count
        self.name = name
        self.path = shm_dir / name
        self.ids_offset = layout.slot_bytes * slot_count
        self.release_offset = self.ids_offset + 8 * layout.batch_size * slot_count
        self.size = self.release_offset + 8 * (notice.RELEASE_WORDS + slot_count)
        self._mmap: mmap.mmap | None = create_segment(self.path, self.size)
        self._base = np.frombuffer(self._mmap, dtype=np.uint8)
        self._region = guard_segment(self._mmap, self._base)
        self._ids = (
            self._base[self.ids_offset : self.release_offset]
            .view("<u8")
            .reshape(slot_count, layout.batch_size)
        )
        self._ctl = self._base[self.release_offset :].view("<u8")
        self._words = self._ctl[notice.RELEASE_WORDS :]
        #: The release words as a memoryview, and the armed slots' tokens: :meth:`reap` runs
        #: after every batch, and a Python scan of the few armed slots costs ~1 us where the
        #: numpy compare over every word cost 3.5 us warm and ~17 us in the daemon.
        self._word_view: memoryview | None = self._words.data
        self._armed: dict[int, int] = {}
        self._init_slots()

    # -- SlotTransport -----------------------------------------------------------------------
    def setup(self) -> TransportSetup:
        """Describe the ring for the client: segment name, slot count and sizes."""
        return TransportSetup(
            kind="shm",
            slot_count=self.slot_count,
            slot_bytes=self.layout.slot_bytes,
            segment=self.name,
            segment_bytes=self.size,
            ids_offset=self.ids_offset,
            release_offset=self.release_offset,
        )

    @property
    def notice_extras(self) -> ShmRing:
        """This ring: its id table and release words serve the notice channel."""
        return self

    def arm(self, slot: int, token: int) -> None:
        """Expect ``token`` in ``slot``'s release word: the client stores it when it is done.

        The word is cleared first (before the batch is announced, so no store of the client's
        can be lost): it may still hold the token of the slot's last lease, and a token names
        a batch of an epoch, not a lease. When the client reads an epoch again on the same
        stream (``next_epoch`` set back, ``load_state_dict`` to an epoch already read), the same
        batch can come back in the same slot with the same token, and the stale word read as a
        release: the daemon then decoded the next batch into the slot the client was about to
        read (found by ``tests/conformance/test_loader_data.py``). No store of the client's for
        the slot is pending here: the slot was released, by that store, before it was taken
        again."""
        words = self._word_view
        if words is None:
            return
        words[slot] = 0
        self._armed[slot] = int(token)

    def reap(self) -> list[int]:
        """The slots whose release word holds the armed token (disarmed; release them)."""
        words = self._word_view
        if words is None:
            return []
        armed = self._armed
        hits = [slot for slot, token in armed.items() if words[slot] == token]
        for slot in hits:
            del armed[slot]
        return hits

    def disarm(self, slot: int) -> None:
        """Stop expecting a token in ``slot``'s word (it was released another way)."""
        self._armed.pop(slot, None)

    @property
    def starved(self) -> bool:
        """Whether the daemon waits for a release to go on (clients then send ``WAKE``)."""
        return bool(self._ctl[notice.STARVED_WORD]) if len(self._ctl) else False

    @starved.setter
    def starved(self, value: bool) -> None:
        if len(self._ctl):
            self._ctl[notice.STARVED_WORD] = 1 if value else 0

    def client_wait_us(self) -> int:
        """The client's total wait for data, as it last stored it (microseconds)."""
        return int(self._ctl[notice.WAIT_WORD]) if len(self._ctl) else 0

    def write_ids(self, slot: int, ids: np.ndarray) -> None:
        """Store the sample ids of the batch in ``slot`` in the id table (before publishing it)."""
        self._ids[slot, : len(ids)] = ids

    def publish(self, slot: int, length: int) -> Published:
        """Mark a FILLING slot LEASED; the client reads it through its own mapping."""
        if (error := truncation_error(self._region, self.name)) is not None:
            raise error
        if not self._mark_leased(slot):
            raise TransportError(f"slot {slot} of {self.name} was published without being filled")
        return _PUBLISHED

    def nbytes(self) -> int:
        """Size of the segment."""
        return self.size

    def close(self) -> None:
        """Reclaim every slot, unlink the segment and unmap it (idempotent).

        The mapping and its descriptor are released now, or, while a view handed to an engine
        worker is still alive, with that last view (:func:`release_mapping`); the ring keeps no
        reference to it either way.
        """
        if self._closed:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            self._reset_slots()
            self._ids = np.empty((0, 0), "<u8")
            self._ctl = self._words = np.empty(0, "<u8")
            view, self._word_view = self._word_view, None
            if view is not None:
                view.release()
            self._armed.clear()
            m, self._mmap = self._mmap, None
            if release_mapping(m, self.name) and self._region is not None:
                self._region.close()  # else with the mapping's last view (guard's finalizer)

    def __enter__(self) -> ShmRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ShmFactory:
    """Builds :class:`ShmRing` s with names from one :class:`ShmNamer` (one per daemon)."""

    kind = "shm"

    def __init__(self, namer: ShmNamer) -> None:
        self.namer = namer

    def create(self, layout: SlotLayout, slot_count: int, *, device_index: int = -1) -> ShmRing:
        """A new ring in a fresh segment (``device_index`` is ignored)."""
        return ShmRing(layout, slot_count, self.namer.next("ring"))
