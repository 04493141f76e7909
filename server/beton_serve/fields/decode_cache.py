"""Decode groups: one bounded cache of decoded images shared by streams whose pipelines differ.

The jobs of a sweep read the same dataset in the same order (same order, seed, indices and
distributed split) but run different pipelines: other output sizes, other crops, other flips.
Their first op decodes the same JPEG of each sample. A crop decoder built with
``share_decode=True`` gets that decode from here instead of doing it itself (issue 16).

Data structure. A :class:`DecodeCache` holds *groups*, one per :class:`GroupKey` (dataset
identity, field, order key: everything that makes two streams visit the same samples in the same
sequence; batch sizes may differ). Each stream joins its group as a :class:`Member`. The cache
keeps one table of *entries*, ``(group, sample id) -> decoded image``, in LRU order, under
one byte budget shared by every group:

- ``Member.get(sid, epoch, nbytes, decode)``: a ready entry is a *hit*; an entry another member
  is decoding right now is waited for (bounded by ``wait_s``: then the member decodes itself);
  otherwise this member decodes it (``decode()``) and, if any other attached member still has to
  take ``sid`` in ``epoch``, publishes it as an entry whose *holders* are those members.
- Each member records, per sample, the latest epoch in which it took it (``int32`` per sample
  of the file). A member whose stream has not run a batch yet is held for nothing. So a member that joined mid-epoch, or is one epoch behind, is a holder exactly of
  the entries it has yet to read; one that has passed a sample never holds it up.
- An entry is freed as soon as its holders have all taken it, or have left the group.
- **Bound.** Entries (ready ones and those being decoded) never take more than ``max_bytes``:
  publishing evicts ready entries, least recently used first. A pixel array is never larger
  than the image (``H * W * 3`` bytes); an image larger than the budget is never cached.
- **Laggards.** An evicted entry that still had holders in its epoch means those members fell
  more than the window behind: they are *detached*. (A holder already in a later epoch only
  skipped the sample: with other batch sizes, ``drop_last`` drops other tails.) They leave the holders of every entry (freeing the ones
  only they held), are not made holders of new entries, and decode what they miss themselves,
  so a slow job never pins memory and never slows the others. A detached member that asks for a
  sample some attached member has not taken yet in that epoch has caught up: it attaches again
  (and its decodes are shared from then on).

Determinism. An entry is the group's decode of the sample's JPEG: the full image, or (for
``GroupKey.decode`` ``"min_side=S"``) the image at a DCT scale chosen from its size alone. Either
is a pure function of the sample's bytes and the key; a member that decodes alone makes the very
same array. So the
pixels a member reads never depend on who else is in its group, whether an entry was evicted or
which member decoded it, and the cache never changes which samples a batch holds (orders are
the streams' own): resumption stays exactly-once.

Threads. Everything is thread-safe (one lock per cache, never held while decoding). ``get`` is
called from the engine's worker threads; :meth:`DecodeCache.join` and :meth:`Member.close` from
whoever owns the stream (``beton_serve.engine._decode_groups``). The pixel arrays handed out are
read-only and stay valid as long as the caller holds them, even once evicted.

Scope. The decoder finds its member through :func:`current_member`, which the stream's
:class:`~beton_serve.engine.BatchSource` sets around each unit of work with :func:`decode_scope`
(a thread-local, reset in ``finally``). The binding is checked against the metadata column the
decoder was called with, so a decoder of another file or field never reads this group.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from beton_serve.errors import SpecError

__all__ = [
    "DEFAULT_DECODE_CACHE_BYTES",
    "MAX_DECODE_CACHE_BYTES",
    "DecodeBinding",
    "DecodeCache",
    "DecodeGroupStats",
    "GroupKey",
    "Member",
    "current_member",
    "decode_key",
    "decode_scope",
    "default_decode_cache",
    "set_default_decode_cache",
]

log = logging.getLogger(__name__)

#: Default byte budget of a cache: 1 GiB, about 1 700 ImageNet images (~600 KB decoded),
#: i.e. several batches of lead between the fastest and the slowest member of a 4-job sweep.
DEFAULT_DECODE_CACHE_BYTES = 1 << 30
#: The largest budget accepted: 64 GiB.
MAX_DECODE_CACHE_BYTES = 64 << 30
#: Default seconds a member waits for another member's decode of the same sample.
DEFAULT_WAIT_S = 30.0


def decode_key(min_side: int) -> str:
    """``GroupKey.decode`` of the decoders with ``share_min_side=min_side``: ``"full"`` for 0."""
    return "full" if min_side <= 0 else f"min_side={int(min_side)}"


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupKey:
    """What makes streams share decodes: the same file(s), field and sample sequence.

    Attributes:
        dataset: the dataset's identity (file identities, or the daemon's ``Dataset.key``).
        field: the field the decoder reads.
        order: canonical text of the order parameters (order, seed, indices digest, distributed
            rank and world size; the batch size only where the order depends on it).
        decode: how the shared decode is made: ``"full"`` (the whole image at full size) or
            ``"min_side=S"`` (a DCT scale picked from the image's size: the decoders'
            ``share_min_side``); streams that decode otherwise never share.
        label: a name for stats and logs (the file's name); not part of the key.
    """

    dataset: str
    field: str
    order: str
    decode: str = "full"
    label: str = dataclasses.field(default="", compare=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeGroupStats:
    """Counters of one decode group (a snapshot).

    Attributes:
        dataset, field, order, decode, label: the group's key and its label.
        members: members now (attached or detached).
        detached: members now detached.
        delivered: samples handed to members (one per ``get``).
        decoded: JPEG decodes run for the group's members (shared or private).
        hits: samples read from an entry another member decoded.
        waits: hits that waited for another member's decode in flight.
        evicted: entries evicted by the byte bound before every holder took them.
        live: entries now cached (ready or being decoded).
        bytes: their bytes.
    """

    dataset: str
    field: str
    order: str
    decode: str
    label: str
    members: int
    detached: int
    delivered: int
    decoded: int
    hits: int
    waits: int
    evicted: int
    live: int
    bytes: int


class _Entry:
    __slots__ = ("epoch", "event", "holders", "img", "nbytes", "ok", "sid")

    def __init__(self, sid: int, epoch: int, nbytes: int, holders: set[Member]) -> None:
        self.sid = sid
        self.epoch = epoch
        self.nbytes = nbytes
        self.holders = holders
        self.img: NDArray[np.uint8] | None = None
        #: The decode succeeded (``img`` is set); set under the cache's lock. A failed decode
        #: is dropped from its group in the same locked section, so an entry a member finds in
        #: ``entries`` is either ready (``ok``) or still being decoded.
        self.ok = False
        #: Made (under the lock) by the first member that must wait for the decode, set by the
        #: decoding member once it succeeded or failed: few entries are ever waited for, and an
        #: Event per entry cost more than the rest of a cache hit.
        self.event: threading.Event | None = None


class _Group:
    def __init__(self, key: GroupKey) -> None:
        self.key = key
        self.members: set[Member] = set()
        self.entries: dict[int, _Entry] = {}
        self.delivered = 0
        self.decoded = 0
        self.hits = 0
        self.waits = 0
        self.evicted = 0


class Member:
    """One stream's place in a decode group. Made by :meth:`DecodeCache.join`; :meth:`close` it.

    ``get`` is called from worker threads, ``close`` from the stream's owner.
    """

    def __init__(self, cache: DecodeCache, group: _Group, num_samples: int) -> None:
        self._cache = cache
        self._group = group
        #: Latest epoch in which this member took each sample (-1: never).
        self._last = np.full(max(int(num_samples), 0), -1, dtype=np.int32)
        self.detached = False
        self.closed = False
        #: The latest epoch this member has read from.
        self.epoch = -1
        #: Set when its stream first submits or runs a batch (``DecodeBinding.activate``,
        #: :func:`decode_scope`) or reads (``get``).
        self.active = False

    @property
    def key(self) -> GroupKey:
        return self._group.key

    def get(
        self,
        sid: int,
        epoch: int,
        nbytes: int,
        decode: Callable[[], NDArray[np.uint8]],
        *,
        wait: bool = True,
    ) -> NDArray[np.uint8] | None:
        """The group's decode of sample ``sid``, which this member reads in ``epoch``.

        Args:
            sid: the sample id (``0 <= sid < num_samples``).
            epoch: the epoch of the batch being run (entries are held for the members that have
                not yet taken ``sid`` in this epoch).
            nbytes: the decoded size, ``h * w * 3`` (reserved while decoding).
            decode: makes a new ``(h, w, 3)`` uint8 array, the group's decode of the image
                (``GroupKey.decode``); called without any
                lock, on this thread; what it raises propagates (nothing is cached then).
            wait: ``False`` returns ``None`` at once, changing nothing, when another member is
                decoding ``sid`` right now (so the caller can do other samples first).

        Returns:
            A read-only ``(h, w, 3)`` uint8 array, shared with the other members (or ``None``,
            see ``wait``).
        """
        cache = self._cache
        g = self._group
        ev: threading.Event | None = None
        with cache._lock:
            if cache._later:
                cache._drain()
            e = g.entries.get(sid)
            if not wait and e is not None and not e.ok:
                return None
            self._note(g, sid, epoch)
            if e is None:
                g.decoded += 1
                # None: nobody else needs it, or it cannot fit: decode alone
                e = mine = cache._publish(self, g, sid, epoch, nbytes)
            elif e.ok and e.img is not None:  # the common case: another member's decode
                g.hits += 1
                cache._taken(self, g, e)
                return e.img
            else:
                mine = None
                g.waits += 1
                if e.event is None:
                    e.event = threading.Event()
                ev = e.event
        if e is None:
            return _readonly(decode())
        if mine is not None:
            return cache._fill(g, mine, decode)
        assert ev is not None
        ev.wait(cache.wait_s)
        with cache._lock:
            if e.ok and e.img is not None:
                g.hits += 1
                cache._taken(self, g, e)
                img: NDArray[np.uint8] | None = e.img
            else:  # its decode failed or is too slow: decode for ourselves
                g.decoded += 1
                img = None
        return img if img is not None else _readonly(decode())

    def take_ready(self, sids: list[int], epoch: int) -> list[NDArray[np.uint8] | None]:
        """The entries of ``sids`` that are ready now, taken under one lock round trip.

        For each sample whose entry another member has already decoded, this does exactly what
        :meth:`get` does for that hit (and in ``sids``' order); every other sample (no entry,
        or one being decoded) is left as it was, ``None`` in the result, for :meth:`get`. A
        batch of a group of four members is mostly hits: one call per batch instead of one
        lock and one Python call per sample, whose GIL hand-offs cost the shared path a tenth
        of its cores (issue 16).

        Args:
            sids: sample ids, in the order the batch takes them.
            epoch: as for :meth:`get`.

        Returns:
            One read-only array or ``None`` per sample of ``sids``.
        """
        cache = self._cache
        g = self._group
        out: list[NDArray[np.uint8] | None] = [None] * len(sids)
        with cache._lock:
            if cache._later:
                cache._drain()
            entries = g.entries
            for i, sid in enumerate(sids):
                e = entries.get(sid)
                if e is None or not e.ok or e.img is None:
                    continue
                self._note(g, sid, epoch)
                g.hits += 1
                cache._taken(self, g, e)
                out[i] = e.img
        return out

    def _note(self, g: _Group, sid: int, epoch: int) -> None:
        """Record that this member takes ``sid`` in ``epoch`` (the cache's lock held)."""
        g.delivered += 1
        if epoch > self.epoch:
            self.epoch = epoch
        self.active = True
        last = self._last
        if 0 <= sid < last.shape[0] and last[sid] < epoch:
            last[sid] = epoch
        if self.detached and self._cache._caught_up(self, g, sid, epoch):
            self.detached = False

    def close(self) -> None:
        """Leave the group (frees the entries only this member held). Idempotent."""
        self._cache._leave(self)


class DecodeCache:
    """The table of decode groups and their entries (see the module docstring).

    Args:
        max_bytes: the byte budget of every group's entries together; at most
            :data:`MAX_DECODE_CACHE_BYTES`; 0 disables caching (members decode alone).
        wait_s: how long a member waits for another member's decode of the same sample.

    Raises:
        SpecError: ``max_bytes`` out of range, or ``wait_s`` negative.
    """

    def __init__(
        self, *, max_bytes: int = DEFAULT_DECODE_CACHE_BYTES, wait_s: float = DEFAULT_WAIT_S
    ) -> None:
        if not 0 <= int(max_bytes) <= MAX_DECODE_CACHE_BYTES:
            raise SpecError(
                f"decode_cache_bytes must be in [0, {MAX_DECODE_CACHE_BYTES}] "
                f"({MAX_DECODE_CACHE_BYTES >> 30} GiB), got {max_bytes}"
            )
        if wait_s < 0:
            raise SpecError(f"decode cache wait must be >= 0 s, got {wait_s}")
        self.max_bytes = int(max_bytes)
        self.wait_s = float(wait_s)
        self._lock = threading.Lock()
        self._groups: dict[GroupKey, _Group] = {}
        #: Ready entries, least recently used first, keyed by (group, sample id): the group
        #: object hashes by identity in C, where a GroupKey (a dataclass) hashed in Python on
        #: every hit.
        self._lru: OrderedDict[tuple[_Group, int], _Entry] = OrderedDict()
        self._bytes = 0
        self.peak_bytes = 0
        #: Members whose stream was garbage-collected, to leave at the next public operation
        #: (``get``, ``join``, ``nbytes``, ``stats``, a member's ``close``):
        #: their finalizer may run on any thread at any allocation, also inside a section that
        #: holds ``_lock`` (which is not reentrant), so it must not take it (see
        #: :meth:`leave_later`).
        self._later: deque[Member] = deque()

    def leave_later(self, m: Member) -> None:
        """Make ``m`` leave its group now if the cache's lock is free, else at the cache's next
        operation. Never waits for the lock: safe from a garbage-collection finalizer, wherever
        it interrupts a thread (also one inside a locked section of this cache)."""
        self._later.append(m)
        if self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def _drain(self) -> None:
        """Leave the queued members (``_lock`` held)."""
        while self._later:
            self._leave_locked(self._later.popleft())

    def join(self, key: GroupKey, num_samples: int) -> Member:
        """A new member of ``key``'s group (created if needed), attached, for a file of
        ``num_samples`` samples."""
        with self._lock:
            if self._later:
                self._drain()
            g = self._groups.get(key)
            if g is None:
                g = self._groups[key] = _Group(key)
            m = Member(self, g, num_samples)
            g.members.add(m)
            return m

    @property
    def nbytes(self) -> int:
        """Bytes of every entry now (ready or being decoded)."""
        with self._lock:
            if self._later:
                self._drain()
            return self._bytes

    def stats(self) -> list[DecodeGroupStats]:
        """A snapshot of every group with at least one member."""
        with self._lock:
            if self._later:
                self._drain()
            return [
                DecodeGroupStats(
                    dataset=g.key.dataset,
                    field=g.key.field,
                    order=g.key.order,
                    decode=g.key.decode,
                    label=g.key.label,
                    members=len(g.members),
                    detached=sum(1 for m in g.members if m.detached),
                    delivered=g.delivered,
                    decoded=g.decoded,
                    hits=g.hits,
                    waits=g.waits,
                    evicted=g.evicted,
                    live=len(g.entries),
                    bytes=sum(e.nbytes for e in g.entries.values()),
                )
                for g in self._groups.values()
                if g.members
            ]

    # -- internals (called with self._lock held unless said otherwise) -------------------
    def _publish(self, m: Member, g: _Group, sid: int, epoch: int, nbytes: int) -> _Entry | None:
        """A pending entry for ``sid`` that ``m`` will fill, or ``None``: nobody else needs it
        (or it cannot fit), so ``m`` decodes it privately."""
        if m.detached or nbytes > self.max_bytes or nbytes <= 0:
            return None
        holders = {x for x in g.members if x is not m and _behind(x, sid, epoch)}
        if not holders:
            return None
        self._evict(self.max_bytes - nbytes)
        if self._bytes + nbytes > self.max_bytes:
            return None  # what is left is being decoded right now
        e = _Entry(sid, epoch, nbytes, holders)
        g.entries[sid] = e
        self._bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self._bytes)
        return e

    def _fill(self, g: _Group, e: _Entry, decode: Callable[[], NDArray[np.uint8]]) -> Any:
        """Run ``decode`` (no lock) for the pending entry ``e`` and publish or drop it."""
        try:
            img = _readonly(decode())
        except BaseException:
            with self._lock:
                self._drop(g, e)
                ev = e.event
            if ev is not None:
                ev.set()  # waiters decode for themselves (and raise the same error)
            raise
        with self._lock:
            e.img, e.ok = img, True
            if g.entries.get(e.sid) is e:
                if e.holders:
                    self._lru[(g, e.sid)] = e
                else:  # every holder left while it was decoded
                    self._drop(g, e)
            ev = e.event
        if ev is not None:
            ev.set()
        return img

    @staticmethod
    def _caught_up(m: Member, g: _Group, sid: int, epoch: int) -> bool:
        """Whether an attached member other than ``m`` has yet to take ``sid`` in ``epoch``."""
        return any(x is not m and _behind(x, sid, epoch) for x in g.members)

    def _taken(self, m: Member, g: _Group, e: _Entry) -> None:
        e.holders.discard(m)
        if g.entries.get(e.sid) is not e:
            return
        if not e.holders and e.ok:
            self._drop(g, e)
        elif e.ok:
            self._lru.move_to_end((g, e.sid))

    def _drop(self, g: _Group, e: _Entry) -> None:
        if g.entries.get(e.sid) is e:
            del g.entries[e.sid]
            self._bytes -= e.nbytes
        self._lru.pop((g, e.sid), None)
        if not g.members and not g.entries and self._groups.get(g.key) is g:
            del self._groups[g.key]

    def _evict(self, room: int) -> None:
        """Evict ready entries, least recently used first, until ``self._bytes <= room``."""
        while self._bytes > room and self._lru:
            (g, sid), e = self._lru.popitem(last=False)
            if g.entries.get(sid) is e:
                del g.entries[sid]
                self._bytes -= e.nbytes
            if e.holders:
                g.evicted += 1
                for x in list(e.holders):
                    # A holder already reading a later epoch skipped this sample (a dropped
                    # partial batch of its own batch size): not a laggard.
                    if x.epoch <= e.epoch:
                        self._detach(x, g)

    def _detach(self, m: Member, g: _Group) -> None:
        if m.detached:
            return
        m.detached = True
        log.info("decode group %s/%s: a member fell behind the window; detached", *_names(g))
        self._forget(m, g)

    def _forget(self, m: Member, g: _Group) -> None:
        """Remove ``m`` from the holders of every entry of ``g`` (freeing those left empty)."""
        for e in list(g.entries.values()):
            if m in e.holders:
                e.holders.discard(m)
                if not e.holders and e.ok:
                    self._drop(g, e)

    def _leave(self, m: Member) -> None:
        with self._lock:
            self._drain()
            self._leave_locked(m)

    def _leave_locked(self, m: Member) -> None:
        if m.closed:
            return
        m.closed = True
        g = m._group
        g.members.discard(m)
        self._forget(m, g)
        if not g.members and not g.entries:
            self._groups.pop(g.key, None)


def _behind(x: Member, sid: int, epoch: int) -> bool:
    """Whether ``x`` is an attached, reading member that has yet to take ``sid`` in ``epoch``.

    A member that has not started running batches (a stream that another identical stream
    produces for, a Loader never iterated) is held for nothing: it may never ask.
    """
    if x.detached or not x.active:
        return False
    return not (0 <= sid < x._last.shape[0] and x._last[sid] >= epoch)


def _names(g: _Group) -> tuple[str, str]:
    return g.key.label or g.key.dataset[:12], g.key.field


def _readonly(img: NDArray[np.uint8]) -> NDArray[np.uint8]:
    img.flags.writeable = False
    return img


# -- the process default and the per-thread scope --------------------------------------
_default_lock = threading.Lock()
_default: list[DecodeCache] = []


def default_decode_cache() -> DecodeCache:
    """The process's cache (created on first use with :data:`DEFAULT_DECODE_CACHE_BYTES`).

    Streams that bring no cache of their own join this one, so that every stream of a process,
    the daemon's or an in-process sweep's, can find its group.
    """
    with _default_lock:
        if not _default:
            _default.append(DecodeCache())
        return _default[0]


def set_default_decode_cache(cache: DecodeCache) -> None:
    """Make ``cache`` the process's cache for streams built from now on (the daemon calls this
    once at start with its ``decode_cache_bytes``; streams already built keep theirs)."""
    with _default_lock:
        _default[:] = [cache]


class DecodeBinding:
    """One stream's members, by the address of the metadata column each decoder reads and the
    way it decodes (``GroupKey.decode``).

    Built by the stream's owner (``beton_serve.engine._decode_groups``); entered on a worker
    with :func:`decode_scope` around each unit of work.

    Args:
        members: ``{(address, decode): member}``; a bare ``address`` key stands for
            ``(address, "full")``.
    """

    def __init__(self, members: Mapping[int | tuple[int, str], Member]) -> None:
        self.members: dict[tuple[int, str], Member] = {
            (k if isinstance(k, tuple) else (int(k), "full")): m for k, m in members.items()
        }

    def member_for(self, metadata: np.ndarray, decode: str = "full") -> Member | None:
        """The member for a decoder called with ``metadata`` that decodes as ``decode``
        (``None``: decode alone)."""
        return self.members.get((int(metadata.__array_interface__["data"][0]), decode))

    def activate(self) -> None:
        """Mark every member as running batches (from now on, entries are held for them)."""
        for m in self.members.values():
            m.active = True

    def close(self) -> None:
        """Leave every group. Idempotent."""
        for m in self.members.values():
            m.close()

    def close_later(self) -> None:
        """Leave every group at each cache's next operation: the finalizer of a stream's
        source, which the garbage collector may run inside a locked section of the cache."""
        for m in self.members.values():
            m._cache.leave_later(m)


_scope = threading.local()


@contextmanager
def decode_scope(binding: DecodeBinding | None, epoch: int) -> Iterator[None]:
    """Make ``binding`` (for a batch of ``epoch``) the current one on this thread."""
    if binding is None:
        yield
        return
    binding.activate()
    prev = getattr(_scope, "value", None)
    _scope.value = (binding, int(epoch))
    try:
        yield
    finally:
        _scope.value = prev


def current_member(metadata: np.ndarray, decode: str = "full") -> tuple[Member, int] | None:
    """``(member, epoch)`` for a decoder called with ``metadata`` on this thread that decodes as
    ``decode`` (``GroupKey.decode``), or ``None``."""
    value = getattr(_scope, "value", None)
    if value is None:
        return None
    binding, epoch = value
    m = binding.member_for(metadata, decode)
    return None if m is None or m.closed else (m, epoch)
