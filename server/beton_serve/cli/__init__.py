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

If the first argument is not a subcommand (e.g. ``beton-serve data.beton``) and the
:data:`DEFAULT_SUBCOMMAND` is registered, it is inserted (``beton-serve serve data.beton``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from beton_serve.errors import BetonError

__all__ = ["DEFAULT_SUBCOMMAND", "SUBCOMMANDS", "build_parser", "main"]

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
]
#: Used when the first argument is not a subcommand name (only if it is registered).
DEFAULT_SUBCOMMAND = "serve"


def build_parser() -> argparse.ArgumentParser:
    """The full parser, with every module of :data:`SUBCOMMANDS` registered."""
    parser = argparse.ArgumentParser(
        prog="beton-serve",
        description="Serve, inspect and write FFCV .beton datasets.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMANDS:
        importlib.import_module(module_name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 error, 2 usage)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    sub_action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    names = set(sub_action.choices)
    if (
        args_list
        and not args_list[0].startswith("-")
        and args_list[0] not in names
        and DEFAULT_SUBCOMMAND in names
    ):
        args_list.insert(0, DEFAULT_SUBCOMMAND)
    try:
        args = parser.parse_args(args_list)
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
