"""The persistent compile cache: Numba machine code kept on disk under a key of our own.

A public module (``beton-serve cache`` uses it) rather than names in ``beton_serve.pipeline``, so
that importing the package (and ``beton_serve.transforms``) does not load the cache code.

Layout. One directory per user (:func:`cache_dir`: ``$BETON_SERVE_CACHE_DIR``, else
``$XDG_CACHE_HOME/beton-serve``, else ``~/.cache/beton-serve``), mode ``0700``, holding one file
per compiled overload, ``kernels/<key>.nbk``::

    b"BSNK\\x01"  | key (32 bytes, sha256) | sha256 of the payload (32 bytes) | payload

The payload is Numba's own reduced ``CompileResult`` (``CompileResult._reduce``: the object
code, the function descriptor, the environment), serialised as Numba's ``FunctionCache`` does.

Key. ``sha256`` over:

* the build: Python, numba, llvmlite and numpy versions, numba's codegen options that change
  the code (``OPT``, ``BOUNDSCHECK``, debug info), the target triple, CPU name and CPU features
  (``codegen.magic_tuple()``), and :data:`FORMAT_VERSION`;
* the code (:func:`~beton_serve.pipeline._compile_key.fingerprint`): the bytecode of the
  function and of everything it reaches, their source files, and the values of the globals and
  closure cells it reads (Numba freezes them into the machine code; Numba's own cache keys on
  neither globals nor callees, numba#6845);
* the Numba extensions registered outside the libraries (``@overload`` and the like, with
  their source files: :func:`~beton_serve.pipeline._compile_key.extensions_key`), which a
  function may call without reaching their module;
* the signature (argument types, so dtypes, dimensions, layouts and record layouts).

A function whose reachable values cannot all be described (an object of a user class, a ctypes
function, a jitclass) is compiled as before and not cached.

Safety. An entry is used only when its file is a regular file owned by this user, not writable
by group or others, with the expected magic, the same key and a matching checksum; anything else
is a miss (and is replaced by the next save). Writers write a temporary file in the same
directory and ``os.replace`` it, so concurrent processes never see a partial entry. A cache
directory owned by another user, or one this user cannot create, disables the cache with a
warning in the log: compiling never fails because of the cache.

Size. After each save, the least recently used entries (by mtime; a hit touches its entry) are
removed until the directory holds at most ``max_bytes`` (default :data:`DEFAULT_MAX_BYTES`).

Numba is imported on first use, never at import time.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from beton_serve.pipeline._compile_key import (
    FORMAT_VERSION,
    build_key,
    extensions_key,
    fingerprint,
)

__all__ = [
    "DEFAULT_MAX_BYTES",
    "FORMAT_VERSION",
    "CacheInfo",
    "DiskStore",
    "attach",
    "cache_dir",
    "cached_cfunc",
    "default_store",
    "entry_key",
]

_log = logging.getLogger("beton_serve.compile_cache")

#: Default size bound of the cache directory.
DEFAULT_MAX_BYTES = 512 * 1024 * 1024
_MAGIC = b"BSNK\x01"
_HEADER = len(_MAGIC) + 64
_SUFFIX = ".nbk"
_TMP_PREFIX = ".tmp-"
_TMP_MAX_AGE_S = 3600.0


def cache_dir(environ: Mapping[str, str] | None = None) -> Path | None:
    """The cache directory the environment selects, or ``None`` when caching is off.

    ``BETON_SERVE_CACHE_DIR`` (``off``, ``0`` or ``none`` turn the cache off), else
    ``$XDG_CACHE_HOME/beton-serve`` (an absolute ``XDG_CACHE_HOME``), else ``~/.cache/beton-serve``. Read when called (on the
    first compile), never at import.
    """
    env = os.environ if environ is None else environ
    explicit = env.get("BETON_SERVE_CACHE_DIR")
    if explicit is not None:
        if explicit.strip().lower() in ("", "off", "0", "none", "false"):
            return None
        return Path(explicit).expanduser()
    xdg = env.get("XDG_CACHE_HOME")
    # The XDG spec: a relative path is invalid and ignored (it named a directory under each
    # process's working directory).
    base = Path(xdg).expanduser() if xdg and Path(xdg).expanduser().is_absolute() else None
    base = base or Path.home() / ".cache"
    return base / "beton-serve"


def _max_bytes(environ: Mapping[str, str]) -> int:
    raw = environ.get("BETON_SERVE_CACHE_MAX_MB")
    if not raw:
        return DEFAULT_MAX_BYTES
    try:
        mb = float(raw)
        if not 0 < mb < 1 << 40:  # NaN, inf, 0 and negatives too
            raise ValueError(raw)
        return max(1, int(mb * 1024 * 1024))
    except (ValueError, OverflowError):
        _log.warning(
            "BETON_SERVE_CACHE_MAX_MB=%r is not a positive number of MiB; using the default "
            "(%d MiB)",
            raw,
            DEFAULT_MAX_BYTES >> 20,
        )
        return DEFAULT_MAX_BYTES


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheInfo:
    """What :meth:`DiskStore.info` reports."""

    path: Path
    entries: int
    total_bytes: int
    max_bytes: int
    enabled: bool
    reason: str


class DiskStore:
    """A directory of cache entries (see the module docstring). Thread- and process-safe.

    Attributes:
        hits, misses, saves, rejected: counters for this process (``rejected``: entries found
            but not used because they were corrupt, stale or foreign).
    """

    def __init__(self, root: Path, *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.root = Path(root)
        self.max_bytes = int(max_bytes)
        self.hits = 0
        self.misses = 0
        self.saves = 0
        self.rejected = 0
        self._lock = threading.Lock()
        self._ready: bool | None = None
        self._reason = ""

    @property
    def entries_dir(self) -> Path:
        return self.root / "kernels"

    # -- directory -----------------------------------------------------------------------
    def _check_dir(self, path: Path, *, create: bool) -> str:
        """``""`` when ``path`` is a private directory of this user, else why not."""
        uid = os.geteuid()
        if create:
            try:
                path.mkdir(mode=0o700, parents=True, exist_ok=True)
            except OSError as exc:
                return f"cannot create {path}: {exc.strerror}"
        try:
            st = os.stat(path)
        except OSError as exc:
            return f"cannot stat {path}: {exc.strerror}"
        if not stat.S_ISDIR(st.st_mode):
            return f"{path} is not a directory"
        if st.st_uid != uid:
            return f"{path} belongs to uid {st.st_uid}, not to this user ({uid})"
        if st.st_mode & 0o077:
            try:
                os.chmod(path, 0o700)
            except OSError as exc:
                return f"{path} is mode {st.st_mode & 0o777:o} and chmod failed: {exc.strerror}"
        return ""

    def problem(self, *, create: bool = True) -> str:
        """``""`` when the cache can be used, else why not. With ``create`` (the default) the
        directory is created and the answer is remembered for this store."""
        with self._lock:
            if self._ready is not None:
                return self._reason
            reason = self._check_dir(self.root, create=create)
            # Without ``create``, a missing ``kernels/`` is an empty cache, not a problem (the
            # first compile makes it): `cache info` said "not used: cannot stat .../kernels".
            if not reason and (create or os.path.lexists(self.entries_dir)):
                reason = self._check_dir(self.entries_dir, create=create)
            if create:
                if reason:
                    _log.warning("compile cache disabled: %s", reason)
                self._ready, self._reason = not reason, reason
            return reason

    def ready(self) -> bool:
        """Whether the cache can be used (checked once per store; creates the directory)."""
        return not self.problem()

    # -- entries -------------------------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        return self.entries_dir / (key.hex() + _SUFFIX)

    def get(self, key: bytes) -> bytes | None:
        """The payload stored under ``key`` (32 bytes), or ``None``; never raises."""
        if not self.ready():
            return None
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            self._count("misses")
            return None
        except OSError as exc:  # ELOOP (a symlink), EACCES, ...
            self._reject(path, f"cannot open ({exc.strerror})")
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                self._reject(path, "not a regular file")
                return None
            if st.st_uid != os.geteuid() or st.st_mode & 0o022:
                self._reject(path, f"foreign entry (uid {st.st_uid}, mode {st.st_mode & 0o777:o})")
                return None
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read()
        except OSError as exc:
            self._reject(path, f"unreadable ({exc.strerror})")
            return None
        finally:
            os.close(fd)
        if (
            len(data) < _HEADER
            or data[: len(_MAGIC)] != _MAGIC
            or data[len(_MAGIC) : len(_MAGIC) + 32] != key
        ):
            self._reject(path, "bad header")
            return None
        payload = data[_HEADER:]
        if hashlib.sha256(payload).digest() != data[len(_MAGIC) + 32 : _HEADER]:
            self._reject(path, "checksum mismatch")
            return None
        try:
            os.utime(path)  # LRU: a hit makes the entry the most recent
        except OSError:
            pass
        self._count("hits")
        return payload

    def has(self, key: bytes) -> bool:
        """Whether an entry file exists under ``key`` (a look-up hint: :meth:`get` is what
        validates an entry)."""
        return self.ready() and self._path(key).is_file()

    def put(self, key: bytes, payload: bytes) -> bool:
        """Store ``payload`` under ``key`` atomically; ``False`` (logged) when it could not."""
        if not self.ready():
            return False
        blob = _MAGIC + key + hashlib.sha256(payload).digest() + payload
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=self.entries_dir)
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.chmod(tmp, 0o600)
            dst = self._path(key)
            try:
                os.replace(tmp, dst)
            except IsADirectoryError:  # not an entry (a directory in its place): replaced
                _unlink(dst)
                os.replace(tmp, dst)
            tmp = None
        except OSError as exc:
            _log.warning("compile cache: could not save an entry: %s", exc)
            return False
        finally:
            if tmp is not None:
                _unlink(Path(tmp))
        self._count("saves")
        self.evict()
        return True

    def _entries(self) -> Iterator[tuple[Path, os.stat_result]]:
        try:
            it = list(os.scandir(self.entries_dir))
        except OSError:
            return
        for e in it:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            yield Path(e.path), st

    def evict(self) -> int:
        """Remove least recently used entries until the total is within ``max_bytes``; also
        stale temporary files of crashed writers. Returns the number of files removed."""
        now = time.time()
        entries = []
        removed = 0
        for path, st in self._entries():
            if path.name.startswith(_TMP_PREFIX):
                if now - st.st_mtime > _TMP_MAX_AGE_S and _unlink(path):
                    removed += 1
            elif path.name.endswith(_SUFFIX):
                entries.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in entries)
        entries.sort()
        for _, size, path in entries:
            if total <= self.max_bytes:
                break
            if _unlink(path):
                removed += 1
                total -= size
        return removed

    def clear(self) -> int:
        """Remove every entry (and temporary file); returns how many files were removed."""
        removed = 0
        for path, _ in self._entries():
            if (path.name.endswith(_SUFFIX) or path.name.startswith(_TMP_PREFIX)) and _unlink(path):
                removed += 1
        return removed

    def info(self) -> CacheInfo:
        """Entries and bytes on disk, without creating the directory."""
        reason = self.problem(create=False)
        sizes = [st.st_size for p, st in self._entries() if p.name.endswith(_SUFFIX)]
        return CacheInfo(
            path=self.root,
            entries=len(sizes),
            total_bytes=sum(sizes),
            max_bytes=self.max_bytes,
            enabled=not reason,
            reason=reason,
        )

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)

    def _reject(self, path: Path, why: str) -> None:
        _log.info("compile cache: ignoring %s: %s; recompiling", path.name, why)
        self._count("rejected")
        self._count("misses")


def _unlink(path: Path) -> bool:
    """Remove the file (or the directory: nothing of ours) at ``path``; ``False`` if it stays."""
    try:
        os.unlink(path)
        return True
    except IsADirectoryError:
        shutil.rmtree(path, ignore_errors=True)
        return not os.path.lexists(path)
    except OSError:
        return False


_stores: dict[tuple[str, int], DiskStore] = {}
_stores_lock = threading.Lock()


def default_store(environ: Mapping[str, str] | None = None) -> DiskStore | None:
    """The store the environment selects (:func:`cache_dir`), one instance per directory."""
    env = os.environ if environ is None else environ
    root = cache_dir(env)
    if root is None:
        return None
    key = (str(root), _max_bytes(env))
    with _stores_lock:
        store = _stores.get(key)
        if store is None:
            store = _stores[key] = DiskStore(root, max_bytes=key[1])
        return store


# -- the Numba side ----------------------------------------------------------------------
def _prepare(target_context: Any) -> None:
    """What loading machine code needs of the target: the runtime (NRT) it may call. Not
    ``target_context.refresh()`` (what Numba's own cache calls): that imports and installs every
    typing and lowering registry, which only compiling needs (each compile refreshes the
    contexts itself), and was 0.25 s of a warm process's 0.45 s Numba start-up."""
    from numba.core.runtime import rtsys

    rtsys.initialize(target_context)


#: Lowest first value of this process's Numba function ids (see :func:`_spread_function_ids`):
#: far above the ids a process numbers its functions with from 1.
_ID_FLOOR = 1 << 40
_ids_spread = False
#: The entry behind each function environment name this process compiled or loaded (Numba's
#: ``fndesc.env_name`` -> cache key): a second entry under a name already taken is not loaded.
_names: dict[str, bytes] = {}
_names_lock = threading.Lock()


def _claim(env_name: str, key: bytes) -> bool:
    """Take ``env_name`` for the entry ``key`` in this process; ``False`` when another entry
    has it (then that entry must be compiled here instead of loaded: see
    :func:`_spread_function_ids`)."""
    with _names_lock:
        held = _names.setdefault(env_name, key)
    return held == key


def _spread_function_ids() -> None:
    """Number this process's Numba functions from a random start (and again in a fork child).

    Numba names a compiled function's symbols, its code and its environment of Python constants
    (``NumbaEnv...``), after its qualified name and a per-process counter (``v1``, ``v2``, ...).
    Two entries of this cache compiled in two processes (two closures of one function with
    different captured values: a ``RandomHorizontalFlip`` of another probability, a
    ``NormalizeImage`` of another dtype) could therefore carry the same names, and loaded into one
    process the second one ran against the first one's environment: an array of float64 came
    back labelled float32 with garbage in it, or boxing failed with ``'descr' is NULL`` (found
    by a served-against-in-process fuzz, session 25). Counting from a random 62-bit start in
    every process makes two processes' names disjoint in practice (a collision needs two
    processes whose random starts lie within the number of functions they compile); a fork
    child, which would count on from its parent's counter, draws a new start. And should two
    entries still carry one name, the second is compiled instead of loaded (:func:`_claim`).
    """
    global _ids_spread
    from numba.core import bytecode

    def spread() -> None:
        start = _ID_FLOOR + int.from_bytes(os.urandom(8), "little") % (1 << 62)
        bytecode.FunctionIdentity._unique_ids = itertools.count(start)

    spread()
    if not _ids_spread:
        _ids_spread = True
        os.register_at_fork(after_in_child=spread)


def _cache_base() -> type:
    from numba.core.caching import _Cache

    return _Cache


def _make_cache_class() -> type:
    _spread_function_ids()  # before this process compiles anything it may save
    base = _cache_base()

    class KeyedCache(base):  # type: ignore[misc, valid-type]
        """A Numba ``_Cache`` (``Dispatcher._cache``) that keeps overloads in a
        :class:`DiskStore`. Numba calls it under its global compiler lock."""

        def __init__(self, dispatcher: Any, store: DiskStore | None) -> None:
            self._py_func = dispatcher.py_func
            self._options = sorted((k, repr(v)) for k, v in dispatcher.targetoptions.items())
            self._store = store
            self._fp: bytes | bool | None = False  # False: not computed yet
            self._enabled = True

        @property
        def cache_path(self) -> str | None:
            store = self._resolve()
            return None if store is None else str(store.root)

        def enable(self) -> None:
            self._enabled = True

        def disable(self) -> None:
            self._enabled = False

        def flush(self) -> None:
            store = self._resolve()
            if store is not None:
                store.clear()

        def _resolve(self) -> DiskStore | None:
            return self._store if self._store is not None else default_store()

        def _key(self, sig: Any, codegen: Any) -> bytes | None:
            if self._fp is False:
                self._fp = fingerprint(self._py_func)
            if self._fp is None:
                return None
            from numba.core import entrypoints

            entrypoints.init_all()  # extensions of installed packages: registered before keying
            h = hashlib.sha256(build_key(codegen))
            h.update(extensions_key())
            h.update(self._fp)  # type: ignore[arg-type]
            h.update(repr(self._options).encode())
            h.update(str(sig).encode())
            return h.digest()

        def load_overload(self, sig: Any, target_context: Any) -> Any:
            try:
                store = self._resolve()
                if not self._enabled or store is None:
                    return None
                key = self._key(sig, target_context.codegen())
                if key is None:
                    return None
                payload = store.get(key)
                if payload is None:
                    return None
            except Exception as exc:
                _log.warning("compile cache: lookup failed (%r); compiling", exc)
                return None
            try:
                import pickle

                from numba.core.compiler import CompileResult

                parts = pickle.loads(payload)
                if not _claim(parts[1].env_name, key):  # parts[1]: the function descriptor
                    _log.info(
                        "compile cache: entry for %s shares its symbol names with another "
                        "entry loaded here; compiling",
                        sig,
                    )
                    store.rejected += 1
                    return None
                _prepare(target_context)
                return CompileResult._rebuild(target_context, *parts)
            except Exception as exc:
                _log.info("compile cache: entry for %s unusable (%r); recompiling", sig, exc)
                store.rejected += 1
                return None

        def save_overload(self, sig: Any, cres: Any) -> None:
            try:
                store = self._resolve()
                if not self._enabled or store is None:
                    return
                if any(not x.can_cache for x in cres.lifted) or cres.library.has_dynamic_globals:
                    return
                key = self._key(sig, cres.codegen)
                if key is None:
                    return
                from numba.core.serialize import dumps

                _claim(cres.fndesc.env_name, key)
                store.put(key, dumps(cres._reduce()))
            except Exception as exc:
                _log.warning("compile cache: could not save %s (%r)", self._py_func, exc)

    return KeyedCache


_cache_class: type | None = None


def entry_key(dispatcher: Any, args: tuple[Any, ...]) -> bytes | None:
    """The key under which ``dispatcher(*args)`` keeps its machine code in the cache, or
    ``None`` when it is not cached (no cache attached, or code that cannot be keyed)."""
    cache: Any = getattr(dispatcher, "_cache", None)
    if _cache_class is None or not isinstance(cache, _cache_class):
        return None
    sig = tuple(dispatcher.typeof_pyval(a) for a in args)
    keyed: Any = cache  # a KeyedCache
    key: bytes | None = keyed._key(sig, dispatcher.targetctx.codegen())
    return key


def cached_cfunc(sig: Any) -> Any:
    """Like ``numba.cfunc(sig)``, compiled now, with its machine code in the compile cache (the
    default store) instead of Numba's own cache."""

    def decorate(fn: Any) -> Any:
        from numba.core import sigutils
        from numba.core.ccallback import CFunc

        global _cache_class
        if _cache_class is None:
            _cache_class = _make_cache_class()
        res: Any = CFunc(fn, sigutils.normalize_signature(sig), locals={}, options={})
        # KeyedCache reads py_func and targetoptions; "cfunc" keeps its entry apart from an
        # njit of the same function
        res._cache = _cache_class(_CFuncView(fn), None)
        res.compile()
        return res

    return decorate


@dataclass(frozen=True)
class _CFuncView:
    py_func: Any
    targetoptions: dict[str, Any] = field(default_factory=lambda: {"cfunc": True})


def attach(dispatcher: Any, store: DiskStore | None = None) -> Any:
    """Make ``dispatcher`` (a Numba ``Dispatcher``) load and save its overloads through the
    compile cache: ``store``, or the :func:`default_store` at each compile. Returns it."""
    global _cache_class
    if _cache_class is None:
        _cache_class = _make_cache_class()
    dispatcher._cache = _cache_class(dispatcher, store)
    return dispatcher
