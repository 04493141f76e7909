"""Keys of the persistent compile cache (:mod:`beton_serve.pipeline.compile_cache`).

:func:`fingerprint` digests what a function compiles to: the bytecode, constants and names of the
function and of every Python function and dispatcher it reaches through its globals, closure
cells and module attributes, the source file of each (so a changed helper in another module
changes the key: Numba's own cache misses that, numba#6845), each dispatcher's options, and the
*values* of the globals and closure cells it reads, which Numba freezes into the machine code.
It returns ``None`` when it reaches a value it cannot describe (a user object, a ctypes
function, a jitclass): such a function is compiled but never cached.

:func:`extensions_key` digests the Numba extensions registered outside the libraries
(``@overload``, ``@overload_method``, ``@overload_attribute``, ``@register_jitable``,
``@lower_builtin``): their code and their modules' source files. A function may call one without
reaching its module (an ``@overload`` of a numpy function, or of a helper defined in another
file), so the fingerprint alone would miss a change of that file and load stale machine code.
Every entry's key includes it: changing any such extension recompiles everything, which is
conservative.

:func:`build_key` digests the build: Python, numba, llvmlite and numpy versions, Numba's codegen
options, the target triple, CPU name and CPU features (``codegen.magic_tuple()``).

Numba is imported on first use, never at import time.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import types as pytypes
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["FORMAT_VERSION", "build_key", "extensions_key", "fingerprint"]

_log = logging.getLogger("beton_serve.compile_cache")

#: Bump when the entry format or the key derivation changes. 2: entries compiled with this
#: process's function ids spread (``compile_cache._spread_function_ids``); version 1 entries
#: could share symbol names with each other and are never loaded.
FORMAT_VERSION = 2


class _Unkeyable(Exception):
    pass


#: Top-level packages whose objects are versioned by the build part of the key.
_LIBRARIES = frozenset(
    {"numpy", "numba", "llvmlite", "math", "cmath", "operator", "_operator", "builtins"}
)
_MAX_ARRAY_BYTES = 16 * 1024 * 1024
_file_hashes: dict[tuple[str, int, int], bytes] = {}


def _is_library(obj: Any) -> bool:
    mod = obj.__name__ if isinstance(obj, pytypes.ModuleType) else getattr(obj, "__module__", None)
    if not isinstance(mod, str):
        mod = type(obj).__module__
    return mod.split(".", 1)[0] in _LIBRARIES


def _file_digest(filename: str) -> bytes:
    try:
        st = os.stat(filename)
    except OSError:
        return b"-"
    key = (filename, st.st_mtime_ns, st.st_size)
    digest = _file_hashes.get(key)
    if digest is None:
        try:
            digest = hashlib.sha256(Path(filename).read_bytes()).digest()
        except OSError:
            digest = b"-"
        _file_hashes[key] = digest
    return digest


class _Fingerprint:
    def __init__(self) -> None:
        self.h = hashlib.sha256()
        self.seen: set[int] = set()
        self.files: set[str] = set()

    def tag(self, *parts: Any) -> None:
        for p in parts:
            self.h.update(p if isinstance(p, bytes) else repr(p).encode())
            self.h.update(b"\x00")

    def code(self, co: pytypes.CodeType) -> set[str]:
        names = set(co.co_names)
        self.tag("code", co.co_name, co.co_code, co.co_varnames, co.co_freevars, co.co_names)
        for c in co.co_consts:
            if isinstance(c, pytypes.CodeType):
                names |= self.code(c)
            elif isinstance(c, frozenset):  # its repr's order follows string hashes (per run)
                self.tag("const", "frozenset", sorted(map(repr, c)))
            else:
                self.tag("const", type(c).__name__, c)
        return names

    def function(self, fn: pytypes.FunctionType) -> None:
        if id(fn) in self.seen:
            self.tag("seen", fn.__qualname__)
            return
        self.seen.add(id(fn))
        co = fn.__code__
        self.tag("fn", fn.__module__, fn.__qualname__, fn.__defaults__ is not None)
        if co.co_filename not in self.files:
            self.files.add(co.co_filename)
            self.tag("file", _file_digest(co.co_filename))
        names = self.code(co)
        for d in fn.__defaults__ or ():
            self.value(d, names)
        glb = fn.__globals__
        for name in sorted(names):
            if name in glb:
                self.tag("global", name)
                self.value(glb[name], names)
        for name, cell in zip(co.co_freevars, fn.__closure__ or (), strict=True):
            try:
                v = cell.cell_contents
            except ValueError:
                raise _Unkeyable(f"empty closure cell {name}") from None
            self.tag("cell", name)
            self.value(v, names)

    def value(self, v: Any, names: set[str]) -> None:
        import numpy as np
        from numba.core import types as nbtypes
        from numba.core.dispatcher import Dispatcher
        from numba.core.extending import _Intrinsic

        if v is None or isinstance(v, bool | int | float | complex | str | bytes):
            self.tag(type(v).__name__, v)
        elif isinstance(v, np.ndarray):
            if v.nbytes > _MAX_ARRAY_BYTES:
                # Numba does not freeze a large array into the code (it becomes a dynamic
                # global, never cacheable): do not spend time hashing it
                raise _Unkeyable(f"an array of {v.nbytes} bytes")
            self.tag("ndarray", v.dtype.str, v.dtype.descr, v.shape, v.flags.writeable)
            self.tag(hashlib.sha256(np.ascontiguousarray(v).tobytes()).digest())
        elif isinstance(v, np.generic):
            self.tag("scalar", v.dtype.str, v.tobytes())
        elif isinstance(v, np.dtype):
            self.tag("dtype", v.str, v.descr)
        elif isinstance(v, tuple | list):
            self.tag(type(v).__name__, len(v))
            for x in v:
                self.value(x, names)
        elif isinstance(v, Dispatcher):
            self.tag("dispatcher", sorted((k, repr(x)) for k, x in v.targetoptions.items()))
            self.function(v.py_func)
        elif isinstance(v, pytypes.FunctionType):
            if _is_library(v):
                self.tag("libfn", v.__module__, v.__qualname__)
            else:
                self.function(v)
        elif isinstance(getattr(v, "__wrapped__", None), pytypes.FunctionType) and not (
            _is_library(v.__wrapped__)
        ):
            # a numba wrapper of user code (a cfunc, ...): its code, not just its type's name
            self.tag("wrapper", type(v).__module__, type(v).__qualname__)
            self.function(v.__wrapped__)
        elif isinstance(v, _Intrinsic):
            self.tag("intrinsic", v._name)
            self.function(v._defn)
        elif isinstance(v, nbtypes.Type):
            self.tag("nbtype", str(v))
        elif isinstance(v, pytypes.ModuleType):
            self.tag("module", v.__name__)
            if not _is_library(v) and id(v) not in self.seen:
                self.seen.add(id(v))
                self.tag("file", _file_digest(getattr(v, "__file__", None) or ""))
                for name in sorted(names):
                    if name in vars(v):
                        self.tag("attr", name)
                        self.value(vars(v)[name], names)
        elif _is_library(v):
            self.tag("lib", type(v).__module__, getattr(v, "__qualname__", None) or repr(v))
        else:
            raise _Unkeyable(f"{type(v).__module__}.{type(v).__qualname__}")


def fingerprint(fn: Callable[..., Any]) -> bytes | None:
    """A digest of the code ``fn`` compiles to (see the module docstring), or ``None`` when some
    value it reaches cannot be described safely (then it must not be cached)."""
    fp = _Fingerprint()
    try:
        if not isinstance(fn, pytypes.FunctionType):
            raise _Unkeyable(type(fn).__qualname__)
        fp.function(fn)
    except _Unkeyable as exc:
        _log.debug("compile cache: %s is not cached (it reaches a %s)", fn, exc)
        return None
    except Exception as exc:  # never let a strange object stop a compile
        _log.debug("compile cache: cannot fingerprint %s: %r", fn, exc)
        return None
    return fp.h.digest()


_build_key: dict[Any, bytes] = {}


def build_key(codegen: Any) -> bytes:
    """A digest of the build and the target CPU (see the module docstring)."""
    import llvmlite
    import numba
    import numpy as np
    from numba.core import config

    magic = codegen.magic_tuple()
    key = _build_key.get(magic)
    if key is None:
        parts = (
            FORMAT_VERSION,
            sys.version,
            sys.platform,
            numba.__version__,
            llvmlite.__version__,
            np.__version__,
            getattr(config, "OPT", None),
            getattr(config, "BOUNDSCHECK", None),
            getattr(config, "DEBUGINFO_DEFAULT", None),
            magic,
        )
        key = _build_key[magic] = hashlib.sha256(repr(parts).encode()).digest()
    return key


_ext_cache: list[Any] = [None, b""]  # [registry sizes, digest]
_EXTENDING = "numba.core.extending"  # register_jitable's wrapper lives there; its cell holds the user's function


def _registry_sizes() -> tuple[int, ...]:
    from numba.core import imputils
    from numba.core.typing.templates import builtin_registry as reg

    low = imputils.builtin_registry
    return (
        len(reg.functions),
        len(reg.attributes),
        len(reg.globals),
        len(low.functions),
        len(low.getattrs),
        len(low.setattrs),
        len(low.casts),
        len(low.constants),
    )


def _extension_functions() -> list[Any]:
    """The Python functions of every registered extension (see :func:`extensions_key`)."""
    from numba.core import imputils
    from numba.core.typing.templates import builtin_registry as reg

    low = imputils.builtin_registry
    fns: list[Any] = []
    for tmpl in (*reg.functions, *reg.attributes):
        fns.append(getattr(tmpl, "_overload_func", None))
    for _, ty in reg.globals:
        for tmpl in getattr(ty, "templates", ()):
            fns.append(getattr(tmpl, "_overload_func", None))
    for table in (low.functions, low.getattrs, low.setattrs, low.casts, low.constants):
        for entry in table:
            fns.append(entry[0] if isinstance(entry, tuple) else entry)
    out = []
    for fn in fns:
        if not isinstance(fn, pytypes.FunctionType):
            continue
        if fn.__module__ == _EXTENDING:
            for cell in fn.__closure__ or ():
                try:
                    v = cell.cell_contents
                except ValueError:
                    continue
                if isinstance(v, pytypes.FunctionType):
                    out.append(v)
            continue
        out.append(fn)
    return out


def extensions_key() -> bytes:
    """A digest of the Numba extensions registered by non-library modules (see the module
    docstring): for each, its module, name, code and source file. Recomputed when the
    registries grow."""
    sizes = _registry_sizes()  # the registries only grow: unchanged sizes, unchanged digest
    if _ext_cache[0] == sizes:
        return _ext_cache[1]  # type: ignore[no-any-return]
    parts = set()
    for fn in _extension_functions():
        mod = fn.__module__ or ""
        if mod.split(".", 1)[0] in _LIBRARIES:
            continue
        fp = _Fingerprint()  # its bytecode, names and constants (marshal's bytes vary by run)
        try:
            fp.code(fn.__code__)
            code = fp.h.digest()
        except Exception:  # an odd constant: its name and file suffice
            code = b"?"
        parts.add((mod, fn.__qualname__, code, _file_digest(fn.__code__.co_filename)))
    h = hashlib.sha256()
    for part in sorted(parts):
        for p in part:
            h.update(p if isinstance(p, bytes) else p.encode())
            h.update(b"\x00")
    _ext_cache[0], _ext_cache[1] = sizes, h.digest()
    return _ext_cache[1]  # type: ignore[no-any-return]
