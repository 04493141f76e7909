"""The default field type table of ``BetonReader``: the seam between ``format`` and ``fields``.

A ``.beton`` descriptor stores a *type id* per column (FFCV's table: 0 ``FloatField`` ... 6
``TorchTensorField``, 255 custom). ``BetonReader`` builds each column's Field from it, so it needs
a table ``{type id: Field class}``. The Field classes live in ``beton_serve.fields``, one layer
*above* ``beton_serve.format`` (fields use the format's layout), and the format must not import
them (docs/architecture.md, "Import layers"). So the table is injected:

- ``BetonReader(path, field_types=table)`` uses ``table``;
- ``BetonReader(path)`` uses :func:`default_field_types`, which calls the provider installed by
  :func:`set_default_provider`. The package root (``beton_serve/__init__``), which sits above
  every layer, installs the built-in one at ``import beton_serve``: it returns
  ``beton_serve.fields.CLASS_BY_TYPE_ID`` (importing ``beton_serve.fields`` the first time).

The provider is a function rather than the table itself so that ``import beton_serve`` (and so
``beton-serve --help``) stays cheap: neither numpy nor the fields load until a reader is opened.
This module imports nothing of beton_serve; ``format`` reaches it as ``beton_serve._field_types``
(a private module of the root package, which holds every layer).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

__all__ = ["FieldTypes", "default_field_types", "set_default_provider"]

#: A field type table: type id -> Field class (a class with ``from_binary(blob)``; see
#: ``beton_serve.fields.Field``). Type id 255 (custom) is never looked up in it.
FieldTypes = Mapping[int, type]

_provider: Callable[[], FieldTypes] | None = None


def set_default_provider(provider: Callable[[], FieldTypes]) -> None:
    """Install the function that :func:`default_field_types` calls.

    Called once, by ``beton_serve/__init__`` at import; readers opened without ``field_types``
    use what it returns. It may be called from any thread, is not expected to be called again,
    and must return a table that nobody mutates (the built-in one is read-only).
    """
    global _provider
    _provider = provider


def default_field_types() -> FieldTypes:
    """The table ``BetonReader`` uses when it is given none (the built-in Field classes).

    Raises:
        RuntimeError: no provider is installed (``beton_serve/__init__`` did not run, which
            Python's import system rules out for any ``beton_serve.*`` import).
    """
    provider = _provider
    if provider is None:
        raise RuntimeError(
            "no default field type table is installed (beton_serve/__init__ installs it); "
            "pass BetonReader(..., field_types={type_id: FieldClass})"
        )
    return provider()
