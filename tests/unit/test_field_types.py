"""The field type table is injected into ``BetonReader`` (format sits below fields).

``BetonReader(path)`` reads with the built-in table that the package root supplies;
``field_types=`` replaces it; the format layer never imports ``beton_serve.fields``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from beton_serve.errors import FormatError
from beton_serve.fields import CLASS_BY_TYPE_ID, TYPE_NAMES, IntField, type_id_of
from beton_serve.format import BetonReader, default_field_types


def test_default_table_is_the_builtin_one(fixtures_dir: Path) -> None:
    assert default_field_types() is CLASS_BY_TYPE_ID
    with BetonReader(fixtures_dir / "mixed_fields.beton") as r:
        assert r.field_types is CLASS_BY_TYPE_ID
        assert [type(r.handlers[n]) for n in r.field_names] == [
            CLASS_BY_TYPE_ID[t] for t in r.type_ids
        ]


def test_injected_table_builds_the_handlers(fixtures_dir: Path) -> None:
    class CountingInt(IntField):
        built = 0

        @staticmethod
        def from_binary(binary):  # type: ignore[no-untyped-def]
            IntField.from_binary(binary)  # the same argument check
            CountingInt.built += 1
            return CountingInt()

    table = {**CLASS_BY_TYPE_ID, 1: CountingInt}
    with BetonReader(fixtures_dir / "mixed_fields.beton", field_types=table) as r:
        assert r.field_types is table
        assert type(r.handlers["int"]) is CountingInt and CountingInt.built == 1
        assert type(r.handlers["float"]) is CLASS_BY_TYPE_ID[0]
    # custom_fields (by name) still win over the table (FFCV's rule).
    with BetonReader(
        fixtures_dir / "mixed_fields.beton", {"int": IntField}, field_types=table
    ) as r:
        assert type(r.handlers["int"]) is IntField


def test_type_id_missing_from_the_table_is_unknown(fixtures_dir: Path) -> None:
    table = {k: v for k, v in CLASS_BY_TYPE_ID.items() if k != 1}
    with pytest.raises(FormatError, match=r"unknown type id 1 \(known: 0, 2-6, 255\)"):
        BetonReader(fixtures_dir / "mixed_fields.beton", field_types=table)


def test_builtin_tables_are_read_only() -> None:
    with pytest.raises(TypeError):
        CLASS_BY_TYPE_ID[7] = IntField  # type: ignore[index]
    with pytest.raises(TypeError):
        TYPE_NAMES[7] = "x"  # type: ignore[index]
    assert TYPE_NAMES[255] == "custom" and TYPE_NAMES[2] == "RGBImageField"
    assert type_id_of(IntField()) == 1
    assert type_id_of(type("Sub", (IntField,), {})()) == 255  # exact class, as FFCV


def test_format_alone_loads_no_fields_until_a_reader_opens(fixtures_dir: Path) -> None:
    """``import beton_serve`` stays cheap (the CLI's ``--help``); ``from beton_serve.format
    import BetonReader; BetonReader(p)`` works in a fresh process without importing fields
    first: the root's provider loads them when the first reader asks."""
    code = (
        "import sys\n"
        "import beton_serve\n"
        "assert 'numpy' not in sys.modules and 'beton_serve.fields' not in sys.modules\n"
        "from beton_serve.format import BetonReader\n"
        "assert 'beton_serve.fields' not in sys.modules\n"
        f"r = BetonReader({str(fixtures_dir / 'mixed_fields.beton')!r})\n"
        "print(sorted(type(h).__name__ for h in r.handlers.values()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(
        sorted(["IntField", "FloatField", "NDArrayField", "BytesField", "JSONField"])
    )


def test_the_clis_help_imports_no_numpy() -> None:
    """``beton-serve --help`` (and a subcommand's) stays cheap: no numpy."""
    code = (
        "import sys, contextlib, io\n"
        "from beton_serve.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['--help']) == 0 and main(['demo', '--help']) == 0\n"
        "assert 'numpy' not in sys.modules, 'numpy imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
