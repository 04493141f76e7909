"""``beton-serve cache info`` / ``beton-serve cache clear``: the persistent compile cache.

The cache directory is ``$BETON_SERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/beton-serve``, else
``~/.cache/beton-serve`` (see :mod:`beton_serve.pipeline.compile_cache`); ``--dir`` overrides
it. ``info`` never creates the directory; ``clear`` removes every entry, and is safe while
trainers or a daemon run (they recompile what they miss). A path that is not a usable cache
directory (a file, another user's) makes ``clear`` remove nothing and exit 1, with the reason
``info`` gives as "not used: ...".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from beton_serve.pipeline.compile_cache import DiskStore

__all__ = ["main", "register"]


def _add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION")
    for name, text in (
        ("info", "where the cache is, its entries and size"),
        ("clear", "remove every cached kernel"),
    ):
        q = sub.add_parser(name, help=text, description=text)
        q.add_argument("--dir", type=Path, default=None, help="the cache directory to use")
        if name == "info":
            q.add_argument("--json", action="store_true", help="print one JSON object")


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``cache`` to the ``beton-serve`` command line (see ``cli/__init__.py``)."""
    p = subparsers.add_parser("cache", help="inspect or clear the persistent compile cache")
    _add_arguments(p)
    p.set_defaults(func=run)


def _store(args: argparse.Namespace) -> object:
    from beton_serve.pipeline.compile_cache import DiskStore, _max_bytes, default_store

    if args.dir is not None:
        return DiskStore(args.dir, max_bytes=_max_bytes(os.environ))
    return default_store(os.environ)


def _mib(n: int) -> str:
    return f"{n / (1024 * 1024):.1f} MiB"


def run(args: argparse.Namespace) -> int:
    """Run ``cache info`` or ``cache clear``; returns the exit status."""
    from beton_serve.pipeline.compile_cache import DiskStore

    action = getattr(args, "action", None)
    if action not in ("info", "clear"):
        print("usage: beton-serve cache {info,clear} [--dir DIR]", file=sys.stderr)
        return 2
    store = _store(args)
    if not isinstance(store, DiskStore):
        print("the compile cache is off (BETON_SERVE_CACHE_DIR=off)")
        return 0
    if action == "clear":
        problem = _clear_problem(store)
        if problem:
            # As ``info`` says it; clearing "0 kernels" from a path that is not a cache
            # directory (BETON_SERVE_CACHE_DIR naming a file) used to exit 0.
            print(f"error: not used: {problem}; nothing removed", file=sys.stderr)
            return 1
        removed = store.clear()
        print(f"removed {removed} cached kernel(s) from {store.entries_dir}")
        left = store.info().entries
        if left:
            print(
                f"error: {left} entr{'y' if left == 1 else 'ies'} could not be removed from "
                f"{store.entries_dir} (permissions?)",
                file=sys.stderr,
            )
            return 1
        return 0
    info = store.info()
    exists = info.path.exists()
    problem = info.reason if exists else _cannot_create(info.path)
    if args.json:
        print(
            json.dumps(
                {
                    "path": str(info.path),
                    "exists": exists,
                    "entries": info.entries,
                    "bytes": info.total_bytes,
                    "max_bytes": info.max_bytes,
                    "usable": not problem,
                    "problem": problem,
                }
            )
        )
        return 0
    print(f"path:     {info.path}")
    if not exists and problem:
        print(f"status:   not usable: {problem} (Loaders compile in memory, every process)")
    elif not exists:
        print("status:   empty (created on the first compile)")
    elif info.enabled:
        print("status:   ok")
    else:
        print(f"status:   not used: {info.reason}")
    print(f"entries:  {info.entries}")
    print(f"size:     {_mib(info.total_bytes)} of {_mib(info.max_bytes)}")
    return 0


def _clear_problem(store: DiskStore) -> str:
    """Why ``clear`` must not touch ``store``'s directory (the reason ``info`` gives as
    "not used: ..."), or ``""`` when it may. An absent directory, or an absent ``kernels/``
    in it, is not a problem: there is nothing to clear."""
    return store.problem(create=False) if os.path.lexists(store.root) else ""


def _cannot_create(path: Path) -> str:
    """Why ``path`` (absent) could not be created by this user, or ``""`` if it could."""
    parent = path
    while not parent.exists():
        if parent.parent == parent:
            return ""
        parent = parent.parent
    if not parent.is_dir():
        return f"cannot create {path}: {parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot create {path}: {parent} is not writable by this user"
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    """``beton-serve cache ...`` as a function: ``main(["info"])``, ``main(["clear"])``."""
    parser = argparse.ArgumentParser(prog="beton-serve cache", description=__doc__)
    _add_arguments(parser)
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    return run(args)
