"""``--plugin``: import the modules that register a daemon's custom ops and fields.

A plugin is named one of two ways:

* a **module name** (``mypkg.ops``), imported with :func:`importlib.import_module` from
  ``sys.path`` (so it must be installed, or on ``PYTHONPATH``);
* a **file path** (``ops/normalize.py``, ``./my_ops.py``) or a package directory holding an
  ``__init__.py`` (``./mypkg``). A spec is a path when it ends in ``.py``, contains a path
  separator, or names an existing directory. The file is imported under a unique module name,
  ``beton_plugin_<stem>_<hash of its real path>``, with no change to ``sys.path``: two plugins
  called ``ops.py`` in two directories never collide, and the same file named twice is imported
  once. A package directory's modules may import each other relatively (``from . import x``);
  a single file that imports a sibling module needs that module on ``sys.path``.

Importing runs the plugin's top-level code, which registers its ops
(:func:`beton_serve.pipeline.registry.register_op`). Every failure is a
:class:`~beton_serve.errors.ConfigError` that names the plugin and says what to change; the
daemon does not start with a plugin it could not import.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
import sys
import traceback
from collections.abc import Iterable
from types import ModuleType
from typing import Any

from beton_serve.errors import ConfigError

__all__ = [
    "add_custom_field_option",
    "is_plugin_path",
    "load_field_classes",
    "load_plugin",
    "load_plugins",
    "plugin_module_name",
]

_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def is_plugin_path(spec: str) -> bool:
    """Whether ``spec`` names a file or directory (not a module name); see the module docstring."""
    return spec.endswith(".py") or os.sep in spec or "/" in spec or os.path.isdir(spec)


def plugin_module_name(path: str) -> str:
    """The unique module name a plugin file (or package directory) is imported under."""
    real = os.path.realpath(path)
    base = os.path.basename(real[:-3] if real.endswith(".py") else real)
    stem = re.sub(r"\W", "_", base) or "plugin"
    digest = hashlib.blake2b(real.encode(), digest_size=6).hexdigest()
    return f"beton_plugin_{stem}_{digest}"


def _where(exc: BaseException) -> str:
    """``" (file:line)"`` of the innermost frame of ``exc``'s traceback, or ``""``."""
    frames = traceback.extract_tb(exc.__traceback__)
    if isinstance(exc, SyntaxError) and exc.filename:
        return f" ({exc.filename}:{exc.lineno})"
    return f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _import_path(spec: str) -> ModuleType:
    path = os.path.abspath(os.path.expanduser(spec))
    if os.path.isdir(path):
        init = os.path.join(path, "__init__.py")
        if not os.path.isfile(init):
            raise ConfigError(
                f"--plugin {spec}: {path} is a directory without an __init__.py; name a .py "
                "file, or a package directory"
            )
        file, search = init, [path]
    elif os.path.isfile(path):
        if not path.endswith(".py"):
            raise ConfigError(f"--plugin {spec}: {path} is not a Python file (.py)")
        file, search = path, None
    else:
        raise ConfigError(
            f"--plugin {spec}: no such file or directory ({path}); a module name (mypkg.ops) "
            "is imported from sys.path instead, a path must exist"
        )
    name = plugin_module_name(path)
    loaded = sys.modules.get(name)
    if loaded is not None:
        return loaded
    module_spec = importlib.util.spec_from_file_location(
        name, file, submodule_search_locations=search
    )
    if module_spec is None or module_spec.loader is None:  # pragma: no cover - .py always loads
        raise ConfigError(f"--plugin {spec}: cannot import {file}")
    module = importlib.util.module_from_spec(module_spec)
    # In sys.modules before it runs, as for an ordinary import: dataclasses, pickle-free
    # introspection and relative imports inside a package look the module up by name.
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException as exc:
        sys.modules.pop(name, None)
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        raise ConfigError(
            f"--plugin {spec}: importing {file} raised {type(exc).__name__}: {exc}{_where(exc)}"
        ) from None
    return module


def _import_module(spec: str) -> ModuleType:
    if not _MODULE_NAME.match(spec):
        raise ConfigError(
            f"--plugin {spec!r}: not a module name (mypkg.ops) nor a path to a .py file"
        )
    try:
        return importlib.import_module(spec)
    except ModuleNotFoundError as exc:
        if exc.name is not None and spec.startswith(exc.name):
            raise ConfigError(
                f"--plugin {spec}: no module named {exc.name!r} on sys.path; install it, set "
                "PYTHONPATH, or pass the file's path instead (--plugin path/to/ops.py)"
            ) from None
        raise ConfigError(
            f"--plugin {spec}: importing it failed: {exc}{_where(exc)}; the plugin needs a "
            "module that is not installed where the daemon runs"
        ) from None
    except Exception as exc:
        raise ConfigError(
            f"--plugin {spec}: importing it raised {type(exc).__name__}: {exc}{_where(exc)}"
        ) from None


def load_plugin(spec: str) -> ModuleType:
    """Import one plugin, a module name or a path (see the module docstring).

    Returns:
        The imported module (already imported: the same module object, not run twice).

    Raises:
        ConfigError: empty spec, no such module or file, or the plugin's code raised (the
            message names the plugin, the exception and where it was raised).
    """
    spec = spec.strip()
    if not spec:
        raise ConfigError("--plugin needs a module name (mypkg.ops) or a path to a .py file")
    return _import_path(spec) if is_plugin_path(spec) else _import_module(spec)


def load_plugins(specs: Iterable[str]) -> list[ModuleType]:
    """Import every plugin, in order; the first failure raises (see :func:`load_plugin`)."""
    return [load_plugin(s) for s in specs]


def add_custom_field_option(parser: Any) -> None:
    """``--custom-field NAME=MODULE:CLASS`` (repeatable) on a command that opens files
    (inspect, checksum); :func:`load_field_classes` reads ``args.custom_field``."""
    parser.add_argument(
        "--custom-field",
        action="append",
        default=[],
        metavar="NAME=MODULE:CLASS",
        help="read field NAME with a custom Field class (FFCV's custom_fields): MODULE is a "
        "module name or a path to a .py file, as for --plugin; repeat for several fields",
    )


def load_field_classes(entries: Iterable[str]) -> dict[str, type]:
    """``--custom-field NAME=MODULE:CLASS`` entries -> ``{NAME: class}``: ``MODULE`` is loaded
    as a plugin (:func:`load_plugin`: a module name, or a path to a ``.py`` file).

    Raises:
        ConfigError: a malformed entry, a module that does not import, no such class, or a
            class that is not a ``Field`` subclass.
    """
    from beton_serve.fields import Field

    out: dict[str, type] = {}
    for entry in entries:
        name, eq, rest = entry.partition("=")
        module, colon, qualname = rest.rpartition(":")
        if not (eq and colon and name and module and qualname):
            raise ConfigError(
                f"--custom-field {entry!r}: expected NAME=MODULE:CLASS "
                "(e.g. label=mypkg.fields:MyField or label=./fields.py:MyField)"
            )
        obj: object = load_plugin(module)
        for part in qualname.split("."):
            obj = getattr(obj, part, None)
        if not (isinstance(obj, type) and issubclass(obj, Field)):
            raise ConfigError(
                f"--custom-field {entry!r}: {module} has no Field subclass named {qualname}"
            )
        out[name] = obj
    return out
