"""The ``beton-serve`` command line: one argparse parser, subcommands registered from modules.

Adding a subcommand
-------------------
Write a module ``beton_serve/cli/_<name>.py`` with one function::

    def register(subparsers: argparse._SubParsersAction) -> None:
        p = subparsers.add_parser("<name>", help="...")
        p.add_argument(...)
        p.set_defaults(func=run)      # run(args: argparse.Namespace) -> int (the exit status)

and add its module path to :data:`SUBCOMMANDS` below (one line). Keep heavy imports (numba,
cv2, grpc) inside ``run`` so that ``beton-serve --help`` stays fast. ``run`` may raise any
:class:`~beton_serve.errors.BetonError`: :func:`main` prints it as ``error: ...`` and returns 1.
Environment variables are read here, in ``cli/``, never at import of library modules.

If the first argument is not a subcommand nor a top-level option (``-h``, ``--version``), e.g.
``beton-serve data.beton`` or ``beton-serve --workers 2 data.beton``, and the
:data:`DEFAULT_SUBCOMMAND` is registered, it is inserted (``beton-serve serve ...``).

Options and positional arguments may be mixed in any order (``beton-serve a.beton --workers 2
b.beton``): a subcommand's arguments are parsed with ``parse_intermixed_args`` unless it has
subcommands of its own (``convert``), which keep argparse's ordinary rules.

``beton-serve cache ...`` is handed, unparsed, to ``beton_serve.cli._cache.main(argv)`` when that
module exists (it is imported only when the subcommand runs).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence

from beton_serve.errors import BetonError

__all__ = ["DEFAULT_SUBCOMMAND", "SUBCOMMANDS", "build_parser", "main", "parse_args"]

#: Modules that each define ``register(subparsers)``, in ``--help`` order.
SUBCOMMANDS: list[str] = [
    "beton_serve.cli._serve",
    "beton_serve.cli._inspect",
    "beton_serve.cli._checksum",
    "beton_serve.cli._convert",
    "beton_serve.cli._health",
    "beton_serve.cli._demo",
    "beton_serve.cli._bench",
    "beton_serve.cli._stats",
    "beton_serve.cli._daemonctl",
]
#: Used when the first argument is not a subcommand name (only if it is registered).
DEFAULT_SUBCOMMAND = "serve"
#: ``beton-serve cache ...`` runs ``main(argv)`` of this module, when it is installed.
CACHE_MODULE = "beton_serve.cli._cache"
#: Options of the top-level parser itself: before them, no subcommand is inserted.
_TOP_LEVEL_OPTIONS = frozenset({"-h", "--help", "--version"})


def _version() -> str:
    from beton_serve import __version__

    return f"beton-serve {__version__}"


def build_parser() -> argparse.ArgumentParser:
    """The full parser, with every module of :data:`SUBCOMMANDS` registered."""
    parser = argparse.ArgumentParser(
        prog="beton-serve",
        description="Serve, inspect and write FFCV .beton datasets.",
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMANDS:
        importlib.import_module(module_name).register(sub)
    if _has_cache_module() and "cache" not in sub.choices:
        # Parsed by the cache module itself (main() hands it the remaining arguments).
        sub.add_parser("cache", help="the on-disk compile cache: info, clear", add_help=False)
    return parser


def _has_cache_module() -> bool:
    if CACHE_MODULE in sys.modules:
        return True
    try:
        return importlib.util.find_spec(CACHE_MODULE) is not None
    except (ImportError, ValueError):
        return False


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _with_default_subcommand(args_list: list[str], names: set[str]) -> list[str]:
    """``args_list`` with :data:`DEFAULT_SUBCOMMAND` inserted when it names no subcommand."""
    if (
        args_list
        and args_list[0] not in names
        and args_list[0] not in _TOP_LEVEL_OPTIONS
        and DEFAULT_SUBCOMMAND in names
    ):
        return [DEFAULT_SUBCOMMAND, *args_list]
    return args_list


def parse_args(
    argv: Sequence[str], parser: argparse.ArgumentParser | None = None
) -> argparse.Namespace:
    """Parse a command line the way :func:`main` does (without running it).

    The default subcommand is inserted when the first argument names none, and a subcommand's
    options may come before, after or between its positional arguments.

    Raises:
        SystemExit: on ``--help``/``--version`` (status 0) and on usage errors (status 2),
            as argparse does.
    """
    parser = build_parser() if parser is None else parser
    subs = _subparsers(parser)
    args_list = _with_default_subcommand(list(argv), set(subs))
    if not args_list or args_list[0] not in subs:
        return parser.parse_args(args_list)
    name, rest = args_list[0], args_list[1:]
    sub = subs[name]
    if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
        return parser.parse_args(args_list)  # nested subcommands: argparse's ordinary rules
    return sub.parse_intermixed_args(rest, namespace=argparse.Namespace(command=name))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 error, 2 usage)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if args_list[:1] == ["cache"] and _has_cache_module():
        return int(importlib.import_module(CACHE_MODULE).main(args_list[1:]))
    try:
        args = parse_args(args_list, parser)
    except SystemExit as exc:  # argparse exits on --help (0) and usage errors (2)
        return int(exc.code or 0)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(func(args))
    except BetonError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_status
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
