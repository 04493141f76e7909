"""The private-modules contract of ``pyproject.toml`` (docs/architecture.md, "Import layers").

``lint-imports`` runs it in CI; these tests prove that the configured contract catches a new
edge into another package's ``_name`` module and names it, and that the repository keeps it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

importlinter_api = pytest.importorskip("importlinter.api")
grimp = pytest.importorskip("grimp")
from importlinter.contracts.private_modules import PrivateModulesContract  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONTRACT_ID = "private-modules"
_LINT_IMPORTS = "from importlinter.cli import lint_imports_command as m; m()"


def _config() -> dict[str, Any]:
    return importlinter_api.read_configuration(str(ROOT / "pyproject.toml"))


def _options() -> dict[str, Any]:
    found = [c for c in _config()["contracts_options"] if c.get("id") == CONTRACT_ID]
    assert len(found) == 1, f"pyproject.toml has no contract with id {CONTRACT_ID!r}"
    assert found[0]["type"] == "private_modules"
    return found[0]


def _contract(*, with_ignores: bool) -> PrivateModulesContract:
    options = dict(_options())
    if not with_ignores:
        options.pop("ignore_imports", None)  # they name real modules, absent from a fake graph
    return PrivateModulesContract(
        name=options["name"], session_options=_config()["session_options"], contract_options=options
    )


def _graph(*edges: tuple[str, str, int]) -> Any:
    graph = grimp.ImportGraph()
    for importer, imported, line in edges:
        for module in (importer, imported):
            graph.add_module(module)
        graph.add_import(
            importer=importer, imported=imported, line_number=line, line_contents="import ..."
        )
    return graph


def test_an_import_of_another_packages_private_module_is_reported() -> None:
    graph = _graph(
        # allowed: inside the owning package, at any depth
        ("beton_serve.pipeline.compiler", "beton_serve.pipeline._compile_cache", 55),
        ("beton_serve.pipeline._plan", "beton_serve.pipeline._boundary", 3),
        ("beton_client._loader", "beton_client._transport.shm", 70),
        ("beton_serve.format._reader", "beton_serve._field_types", 40),  # root's private module
        # allowed: public modules, and the package API
        ("beton_serve.engine._source", "beton_serve.pipeline", 51),
        ("beton_serve.fields.base", "beton_serve.format", 36),
        # violations: from a sibling package, and from the client into the server
        ("beton_serve.engine._source", "beton_serve.pipeline._plan", 51),
        ("beton_serve.fields.base", "beton_serve.format._layout", 36),
        ("beton_client._local_jit", "beton_serve.pipeline._compile_key", 9),
    )
    check = _contract(with_ignores=False).check(graph, verbose=False)
    assert not check.kept
    reported = {
        (link["importer"], link["imported"], tuple(link["line_numbers"]))
        for link in check.metadata["illegal_imports"]
    }
    assert reported == {
        ("beton_serve.engine._source", "beton_serve.pipeline._plan", (51,)),
        ("beton_serve.fields.base", "beton_serve.format._layout", (36,)),
        ("beton_client._local_jit", "beton_serve.pipeline._compile_key", (9,)),
    }


def test_a_private_module_under_a_private_package_is_its_parents_own() -> None:
    # import-linter's rule uses the innermost private component: `a._x._y` belongs to `a._x`.
    graph = _graph(
        ("beton_serve._kernels.crop", "beton_serve._kernels._simd", 1),
        ("beton_serve.transforms.flip", "beton_serve._kernels._simd", 2),
        ("beton_serve.transforms.flip", "beton_serve._kernels.crop", 3),
    )
    check = _contract(with_ignores=False).check(graph, verbose=False)
    assert [(link["importer"], link["imported"]) for link in check.metadata["illegal_imports"]] == [
        ("beton_serve.transforms.flip", "beton_serve._kernels._simd")
    ]


def test_the_repository_keeps_the_contract() -> None:
    session = _config()["session_options"]
    graph = grimp.build_graph(
        *session["root_packages"], include_external_packages=True, cache_dir=None
    )
    check = _contract(with_ignores=True).check(graph, verbose=False)
    offending = [f"{x['importer']} -> {x['imported']}" for x in check.metadata["illegal_imports"]]
    assert check.kept, f"imports of other packages' private modules: {offending}"
    assert check.ignored_import_count <= 3  # TODO(issue 12 §4): the daemon's three, then none


def test_lint_imports_names_the_offending_edge(tmp_path: Path) -> None:
    """End to end, as CI runs it: ``lint-imports`` fails and prints ``importer -> imported``."""
    pkg = tmp_path / "pkg"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("from pkg.a._x import VALUE\n")
    (pkg / "a" / "_x.py").write_text("VALUE = 1\n")
    (pkg / "b.py").write_text("import os\nfrom pkg.a._x import VALUE\n")
    options = _options()
    (tmp_path / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""\
            [tool.importlinter]
            root_packages = ["pkg"]

            [[tool.importlinter.contracts]]
            id = "{CONTRACT_ID}"
            name = "{options["name"]}"
            type = "{options["type"]}"
            """
        )
    )
    out = subprocess.run(
        [sys.executable, "-c", _LINT_IMPORTS, "--no-cache"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "- pkg.b -> pkg.a._x (l.2)" in out.stdout
    assert "Contracts: 0 kept, 1 broken." in out.stdout
