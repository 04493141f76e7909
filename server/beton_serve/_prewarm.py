"""A cold compile cache compiles the crop kernels on two cores, not one (issue 14 §2).

Numba compiles under one process-wide lock, so a process compiles its kernels one after the
other, whatever its thread count. With an empty compile cache, a RandomResizedCrop pipeline's
first batch waited for the area resize (``area_resize``, about 3.2 s here), the crop sampler
(``rrc_batch``, about 1.5 s), the area upscale (``upscale_into``, about 1.4 s) and the ops after
the decoder, on one core of two.

When a crop decoder builds its batch loop, :func:`start` looks the module-level kernels up in the
compile cache (their keys, for the argument types the decoders pass), by name (:data:`GROUPS`).
What is missing is split between two lanes:

* a helper process (``python -m beton_serve._prewarm rng resize tj3``) compiles the counter
  RNG's draws (which the sampler and the flip here then load) and the largest kernel,
  ``area_resize``; then, at a lower priority (:func:`_background`), for a TurboJPEG decoder the
  batch kernel (``_tj3.batch_kernel``) once the kernels it calls are in the cache (waiting for
  this process's ``upscale_into`` entry saves compiling it twice). The in-process Loader
  starts this helper as soon as it sees a crop decoder in its pipelines (:func:`spawn_early`),
  before it opens the file, so that the helper's own start (~0.9 s here) overlaps the Loader's;
* a thread of this process (``beton-prewarm``) compiles ``upscale_into`` and the pipeline's own
  sampler, then what :func:`ahead` queued: the plan's ``compile_ahead`` ops, called on zeros
  (``Plan._compile_ahead``), which would otherwise compile after the decoder, on the first
  batch's path. (The split is measured: the two lanes end within about 0.5 s of each other;
  RESULTS "Session 54".)
* the decoders' ``_crops`` calls :func:`wait` for the helper's ``resize`` before the batch, so
  that the kernel is loaded from the cache rather than compiled here a second time; the batch
  kernel's background build waits for ``tj3`` too. So the cache holds the batch kernel even
  when this process exits right after its first batch, and the next process runs it from its
  first batch.

With a warm cache (or ``BETON_SERVE_PREWARM=0``) nothing starts: the look-up is a few ``stat``
calls. The helper cannot change any pixel: it compiles the same functions for the same
signatures, and an entry is used only when its key (code, signature, build) matches. Any failure
(no interpreter, the helper crashing or exceeding :data:`WAIT_TIMEOUT_S`, an entry the cache
rejects) only means that the kernel is compiled here, as without this module. Concurrent helpers
(the ranks of a DDP job starting together) take a lock file in the cache directory: one
compiles, the others wait for it and then load its entries.

The helper is this process's child, reaped by a watcher thread; it ends by itself once its
kernels are compiled. When this process is gone (an exit, a crash, SIGKILL), a helper that is
waiting exits at once, and one that is compiling a group finishes that group into the cache and
then exits, never starting another: a process that exits right after its first batch (a short
script, a benchmark) would otherwise leave the cache without the TurboJPEG batch kernel, which
the helper compiles last, and every later start would run its first batch without it and
compile it again. At exit this process joins its own compile thread (never the helper: a Loader
that fails to open its file exits at once).
"""

from __future__ import annotations

import atexit
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["WAIT_TIMEOUT_S", "ahead", "join", "main", "spawn_early", "start", "wait"]

log = logging.getLogger("beton_serve.prewarm")

#: ``BETON_SERVE_PREWARM=0`` turns the parallel cold compile off.
ENV = "BETON_SERVE_PREWARM"
#: How long a decoder waits for the helper before compiling the kernels itself.
WAIT_TIMEOUT_S = 60.0
_LOCK_NAME = "prewarm.lock"

Calls = list[tuple[Any, tuple[Any, ...]]]


# -- what is compiled: the decoders' argument types (one source for the look-up and the helper)
_IDX = (np.zeros(1, np.uint64), np.full(1, 8, np.int64))  # batch indices; image heights/widths


def _rng_calls() -> Calls:
    """The counter RNG's draws, as the crop sampler and the flip call them (their compiled
    callers load them from the cache when the helper got there first)."""
    from beton_serve.pipeline import rng

    key = np.uint64(0)
    return [(rng.uniform_range, (key, key, np.int64(0), 0.0, 1.0))]


def _rrc_calls() -> Calls:
    from beton_serve._kernels import crop

    idx, hw = _IDX
    scale, ratio = np.array([0.08, 1.0]), np.array([3.0 / 4.0, 4.0 / 3.0])
    return [(crop.rrc_batch, (np.uint64(0), idx, hw, hw, scale, ratio))]


def _center_calls() -> Calls:
    from beton_serve._kernels import crop

    idx, hw = _IDX
    return [(crop.center_crop_batch, (idx, hw, hw, 0.875))]


def _upscale_calls() -> Calls:
    """The area upscale, as ``resize_crop`` calls it (the first batch's upscales need it)."""
    from beton_serve._kernels.upscale import rows_size, upscale_into

    flat = np.zeros(4 * 4 * 3, np.uint8)
    out = np.zeros(6 * 6 * 3, np.uint8)
    rows = np.zeros(rows_size(6) + 2, np.float32).view(np.int16)  # a float32 scratch, as int16
    return [(upscale_into, (flat, 4, 0, 0, 4, 4, out, 6, 6, rows))]


def _resize_calls() -> Calls:
    from beton_serve._kernels.resize import area_resize, scratch_size

    src = np.zeros((4, 4, 3), np.uint8)
    dst = np.zeros((3, 3, 3), np.uint8)
    scratch = np.zeros(scratch_size(4, 3), np.float32)
    return [(area_resize, (src, src.reshape(-1), 0, 0, 4, 4, dst, dst.reshape(-1), scratch))]


def _tj3_calls() -> Calls:
    from beton_serve import _tj3

    return [_tj3._kernel_and_args(_tj3.load()), *_tj3._after_kernel_calls()]


#: What may be compiled ahead, by name: a helper process's groups (its command line, compiled in
#: the order given) and this process's ``beton-prewarm`` thread take them from here.
GROUPS: dict[str, Callable[[], Calls]] = {
    "rng": _rng_calls,
    "resize": _resize_calls,
    "rrc": _rrc_calls,
    "center": _center_calls,
    "upscale": _upscale_calls,
    "tj3": _tj3_calls,
}
#: What the ``tj3`` group's kernels call, compiled by another group (maybe in the other
#: process): the helper waits up to :data:`AFTER_LOCAL_S` for their entries before ``tj3``.
TJ3_CALLEES = ("resize", "upscale")
#: Seconds the helper waits for the :data:`TJ3_CALLEES` entries before the ``tj3`` group (then
#: it compiles them too).
AFTER_LOCAL_S = 30.0


def lanes(sampler: str, tj3: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(helper groups, local groups)`` for a crop decoder whose sampler is ``sampler``
    (``"rrc"`` or ``"center"``): the RNG's draws, the area resize and the TurboJPEG batch kernel
    on the helper, the upscale and the pipeline's sampler here (module docstring). The other
    sampler is left to its own first use (0.35 s for CenterCrop, 1.3 s for RandomResizedCrop
    here): compiled ahead, it was still missing whenever a trainer exited soon after its first
    batch, and every later short process started a helper for it again."""
    return ("rng", "resize", *(("tj3",) if tj3 else ())), ("upscale", sampler)


def _run(calls: Calls) -> None:
    for disp, args in calls:
        disp(*args)


def _missing(calls: Calls, store: Any) -> bool:
    """Whether some call of ``calls`` has neither a compiled overload here nor a cache entry."""
    from beton_serve.pipeline.compile_cache import entry_key

    for disp, args in calls:
        sig = tuple(disp.typeof_pyval(a) for a in args)
        if sig in disp.overloads:
            continue
        key = entry_key(disp, args)
        if key is not None and not store.has(key):
            return True
    return False


def _group_missing(name: str, calls: Callable[[], Calls], store: Any) -> bool:
    try:
        return _missing(calls(), store)
    except Exception as exc:  # e.g. no TurboJPEG library: nothing of this group to compile
        log.debug("prewarm: group %s not looked up (%r)", name, exc)
        return False


# -- this process's side -----------------------------------------------------------------
_lock = threading.Lock()
_started: set[tuple[str, str]] = set()  # (cache directory, group) looked up ("": local)
_pending: dict[str, threading.Event] = {}  # group -> set once the helper is done with it
_procs: list[subprocess.Popen[bytes]] = []
_proc_of: dict[str, subprocess.Popen[bytes]] = {}  # group -> the helper compiling it
#: Helpers a wait timed out on (hung): stopped at exit.
_given_up: set[subprocess.Popen[bytes]] = set()
_threads: list[threading.Thread] = []
#: Work queued behind this process's own compile (:func:`ahead`), and whether the
#: ``beton-prewarm`` thread still takes it (guarded by :data:`_lock`).
_queued: list[Callable[[], None]] = []
_local_open = False


def start(
    helper: Sequence[str] = ("rng", "resize"),
    local: Sequence[str] = ("rrc", "upscale"),
) -> None:
    """Start compiling what of the :data:`GROUPS` named is missing from the compile cache:
    ``helper`` in a helper process, ``local`` on this process's ``beton-prewarm`` thread (see
    the module docstring); returns at once. Each name once per process and cache directory,
    whichever lane asked first; never raises."""
    global _local_open
    if os.environ.get(ENV, "1").strip() == "0":
        return
    try:
        from beton_serve.pipeline.compile_cache import default_store

        store = default_store()
        if store is None or not store.ready():
            return
        root = str(store.root)
        with _lock:
            todo = [g for g in dict.fromkeys(helper) if g in GROUPS and (root, g) not in _started]
            _started.update((root, g) for g in todo)
            mine = [g for g in dict.fromkeys(local) if g in GROUPS and (root, g) not in _started]
            _started.update((root, g) for g in mine)
        todo = [g for g in todo if _group_missing(g, GROUPS[g], store)]
        mine = [g for g in mine if _group_missing(g, GROUPS[g], store)]
    except Exception as exc:  # the look-up must never stop a Loader
        log.debug("prewarm: look-up failed (%r); compiling as needed", exc)
        return
    if todo:
        _spawn(todo, store.root)
    if mine:
        t = threading.Thread(target=_compile_local, args=(mine,), name="beton-prewarm", daemon=True)
        with _lock:
            _threads.append(t)
            _local_open = True
        t.start()


def spawn_early(helper: Sequence[str]) -> None:
    """Start only the helper process's part of :func:`start` (the in-process Loader calls this
    before it opens its file; the decoder's own :func:`start` then adds this process's lane).
    Nothing is left for this process to wait for at exit if the Loader then fails."""
    start(helper, ())


def _compile_local(names: Sequence[str]) -> None:
    for name in names:
        try:
            _run(GROUPS[name]())
        except Exception as exc:  # the decoder's own call then fails the same way, with its sample
            log.warning("prewarm: compiling the %s kernels failed: %r", name, exc)
    _drain()


def ahead(fn: Callable[[], None]) -> bool:
    """Run ``fn``, compile work of this process (``Plan._compile_ahead``), on a prewarm
    thread, when a cold compile is under way here: queued behind this process's own
    ``beton-prewarm`` compile, or on a thread of its own while only the helper process
    compiles (this process would otherwise wait for it with its compile lock idle). Returns
    ``False``, and ``fn`` is not run, when nothing is under way (a warm cache, or
    ``BETON_SERVE_PREWARM=0``). What ``fn`` raises is logged at debug level; never raises."""
    if os.environ.get(ENV, "1").strip() == "0":
        return False
    with _lock:
        if _local_open:
            _queued.append(fn)
            return True
        if not any(not ev.is_set() for ev in _pending.values()):
            return False
        t = threading.Thread(target=_call, args=(fn,), name="beton-prewarm", daemon=True)
        _threads.append(t)
    t.start()
    return True


def _drain() -> None:
    """Run what :func:`ahead` queued, until nothing is left; then the thread takes no more."""
    global _local_open
    while True:
        with _lock:
            if not _queued:
                _local_open = False
                return
            fn = _queued.pop(0)
        _call(fn)


def _call(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as exc:  # what was not compiled here is compiled at its first call
        log.debug("prewarm: compiling ahead failed (%r)", exc)


def _command(groups: Sequence[str]) -> list[str]:
    flags = ["-P"] if sys.version_info >= (3, 11) else []  # no cwd on sys.path
    return [sys.executable, *flags, "-m", "beton_serve._prewarm", *groups]


def _spawn(groups: Sequence[str], root: Path) -> None:
    events = {g: threading.Event() for g in groups}
    if not sys.executable:
        return
    env = dict(os.environ)
    # the helper imports this very package, however this process found it
    here = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    env["BETON_SERVE_CACHE_DIR"] = str(root)
    env[ENV] = "0"
    env[_PARENT_ENV] = str(os.getpid())
    try:
        proc = subprocess.Popen(
            _command(groups),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(root),
            close_fds=True,
        )
    except OSError as exc:
        log.info("prewarm: no helper process (%s); compiling here", exc)
        return
    with _lock:
        _pending.update(events)
        _procs.append(proc)
        _proc_of.update(dict.fromkeys(groups, proc))
    watcher = threading.Thread(
        target=_watch, args=(proc, events), name="prewarm-watch", daemon=True
    )
    watcher.start()


def _watch(proc: subprocess.Popen[bytes], events: dict[str, threading.Event]) -> None:
    assert proc.stdout is not None
    other: list[str] = []
    try:
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip()
            word, _, group = line.partition(" ")
            if word == "done" and group in events:
                events[group].set()
            else:
                other = [*other[-20:], line]
    finally:
        proc.stdout.close()
        rc = proc.wait()
        for ev in events.values():
            ev.set()
        with _lock:
            if proc in _procs:
                _procs.remove(proc)
        if rc != 0:
            log.warning(
                "prewarm: the helper process exited with %s; compiling here. Its output: %s",
                rc,
                " | ".join(other) or "(none)",
            )


def wait(group: str, timeout: float = WAIT_TIMEOUT_S) -> None:
    """Block until the helper is done with ``group`` (at most ``timeout`` s); at once when no
    helper compiles it. The caller then loads the group's kernels (or compiles them)."""
    ev = _pending.get(group)
    if ev is None or ev.is_set():
        return
    if not ev.wait(timeout):
        log.warning(
            "prewarm: the helper did not finish %r in %.0f s; compiling here", group, timeout
        )
        with _lock:
            if group in _proc_of:
                _given_up.add(_proc_of[group])
        ev.set()


def join(timeout: float = WAIT_TIMEOUT_S) -> bool:
    """Wait for the helper processes and this process's compile thread; ``True`` when all are
    done (used at exit and by tests)."""
    with _lock:
        procs, threads = list(_procs), list(_threads)
    ok = True
    for proc in procs:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            ok = False
    for t in threads:
        t.join(timeout)
        ok = ok and not t.is_alive()
    return ok


@atexit.register
def _at_exit() -> None:
    # A helper still running is left to its orphan rule (main): waiting, it exits at once;
    # compiling, it finishes that group into the cache and exits, instead of being stopped
    # with the group lost. One that a wait gave up on (hung) is stopped.
    with _lock:
        hung, threads = [p for p in _given_up if p in _procs], list(_threads)
    for proc in hung:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    for t in threads:  # a process must not finalize while numba compiles on another thread
        t.join(WAIT_TIMEOUT_S)


def _reset_for_tests() -> None:
    """Forget what this process started (tests that point the cache elsewhere)."""
    join()
    with _lock:
        _started.clear()
        _pending.clear()
        _proc_of.clear()
        _given_up.clear()
        _threads.clear()
        _queued.clear()


# -- the helper process ------------------------------------------------------------------
def _wait_for_entries(calls: Calls, store: Any, timeout: float) -> None:
    """Poll until every call of ``calls`` has its cache entry, at most ``timeout`` s."""
    import time

    deadline = time.monotonic() + timeout
    while _missing(calls, store) and time.monotonic() < deadline:
        time.sleep(0.05)


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


#: The pid of the process that started the helper (it may die before the helper looks).
_PARENT_ENV = "BETON_SERVE_PREWARM_PARENT"
#: Seconds between the helper's checks that the process that started it is still there.
ORPHAN_POLL_S = 0.2
#: Seconds an orphaned helper may go on compiling its current group before it exits anyway.
ORPHAN_FINISH_S = 60.0


_helper_lock = threading.Lock()
_helper_busy = False  # a group is compiling (guarded by _helper_lock)
_helper_orphaned = False  # the parent is gone (guarded by _helper_lock)


def _exit_when_orphaned(parent: int) -> None:
    """Stop this helper once ``parent`` is gone (a trainer killed with SIGKILL runs no atexit
    hook to stop it): its parent pid changes to a reaper's. Waiting, it exits at once. While it
    compiles a group, it finishes that group, so that the group's entries reach the cache, and
    then exits (:func:`main`): a trainer that exits right after its first batch (a short
    script, a benchmark, a crash) would otherwise leave the cache without the kernel the
    helper was compiling, and every later start would compile it again. Entries are written
    atomically, so stopping between them loses nothing."""
    import time

    global _helper_orphaned
    while True:
        time.sleep(ORPHAN_POLL_S)
        if os.getppid() != parent:
            with _helper_lock:
                _helper_orphaned = True
                if not _helper_busy:
                    os._exit(0)
            break
    time.sleep(ORPHAN_FINISH_S)  # a group that compiles this long is hung: stop anyway
    os._exit(0)


def _compile_group(name: str) -> bool:
    """Compile group ``name`` unless the parent is gone; ``False``: stop now (orphaned)."""
    global _helper_busy
    with _helper_lock:
        if _helper_orphaned:
            return False
        _helper_busy = True
    try:
        _say(f"compiling {name}")
        _run(GROUPS[name]())
    finally:
        with _helper_lock:
            _helper_busy = False
            orphaned = _helper_orphaned
    return not orphaned


#: The groups a first batch waits for; the helper compiles the others at a lower priority.
FOREGROUND = frozenset({"rng", "resize", "upscale"})
#: The helper's ``nice`` increment for the groups not in :data:`FOREGROUND` (:func:`_background`).
BACKGROUND_NICE = 10


_niced = False


def _background() -> None:
    """Lower this helper's CPU priority, once: the groups outside :data:`FOREGROUND` (the
    TurboJPEG batch kernel) are not on the first batch's path, and at the same priority they
    took a core's share from the trainer's own compile and first batches."""
    global _niced
    if _niced:
        return
    _niced = True
    try:
        os.nice(BACKGROUND_NICE)
    except OSError:  # not allowed: compile at the same priority
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m beton_serve._prewarm GROUP...``: compile the groups into the compile cache,
    printing ``compiling GROUP`` before and ``done GROUP`` after each; from the first group
    outside :data:`FOREGROUND` on, at a lower CPU priority (``nice`` +:data:`BACKGROUND_NICE`).
    Exit status 2 when the cache cannot be used. Once its parent is gone it exits within
    ``ORPHAN_POLL_S``, or, if it is compiling a group then, as soon as that group is in the cache
    (a few seconds; at most ``ORPHAN_FINISH_S``; never another group)."""
    import fcntl

    parent = os.environ.get(_PARENT_ENV, "")
    ppid = int(parent) if parent.isdigit() else os.getppid()
    if ppid != os.getppid():
        return 0  # the process that started us died while we were starting
    threading.Thread(
        target=_exit_when_orphaned, args=(ppid,), name="prewarm-orphan", daemon=True
    ).start()
    groups = list(sys.argv[1:] if argv is None else argv)
    if not FOREGROUND.intersection(groups):
        _background()  # nothing a first batch waits for: even the imports yield to the trainer

    from beton_serve.pipeline.compile_cache import default_store

    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        _say(f"unknown group(s) {unknown}; known: {sorted(GROUPS)}")
        return 2
    store = default_store()
    if store is None or not store.ready():
        _say("the compile cache cannot be used")
        return 2
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(store.root / _LOCK_NAME, flags, 0o600)
    try:
        # another helper compiling the same groups: wait for it, then load its entries
        fcntl.flock(fd, fcntl.LOCK_EX)
        for g in groups:
            if g not in FOREGROUND:
                _background()
            if g == "tj3":
                callees = [c for name in TJ3_CALLEES for c in GROUPS[name]()]
                _wait_for_entries(callees, store, AFTER_LOCAL_S)
            if not _compile_group(g):
                return 0  # orphaned: the group it was compiling is in the cache
            _say(f"done {g}")
    except BrokenPipeError:  # the process that started us is gone
        return 0
    finally:
        os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
