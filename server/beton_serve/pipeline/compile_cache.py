"""The persistent compile cache's public surface: where it lives, and one store of entries.

``cache_dir(environ)`` is the directory (``$BETON_SERVE_CACHE_DIR``, else
``$XDG_CACHE_HOME/beton-serve``, else ``~/.cache/beton-serve``; ``None`` when there is none),
``default_store(environ)`` the :class:`DiskStore` in it (``None`` when disabled), and
``DiskStore(path).info()`` / ``.clear()`` what ``beton-serve cache`` prints and does
(:class:`CacheInfo`). ``attach(dispatcher, store)`` makes a Numba dispatcher load and save its
overloads there (``Compiler`` calls it). The entry format, the key and the safety rules are
described in ``beton_serve.pipeline._compile_cache``, which implements them.

A module of its own rather than names in ``beton_serve.pipeline``, so that importing the package
(and ``beton_serve.transforms``) does not load the cache code. Numba is imported on first use.
"""

from __future__ import annotations

from beton_serve.pipeline._compile_cache import (
    DEFAULT_MAX_BYTES,
    FORMAT_VERSION,
    CacheInfo,
    DiskStore,
    attach,
    cache_dir,
    default_store,
)

__all__ = [
    "DEFAULT_MAX_BYTES",
    "FORMAT_VERSION",
    "CacheInfo",
    "DiskStore",
    "attach",
    "cache_dir",
    "default_store",
]
