"""``Compiler.compile`` reuses, within a process, the dispatcher of a function it compiled
before with the same fingerprint (code and the values Numba freezes into it): every new Loader
generates its ops' closures anew, and each new dispatcher kept its machine code for the life of
the process (tests/adversarial/test_inprocess_cycles.py has the 1,000-Loader check)."""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path

import numpy as np
import pytest
from beton_serve.pipeline import compiler
from beton_serve.pipeline.compile_cache import DiskStore, default_store
from beton_serve.pipeline.compiler import Compiler


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> DiskStore:
    monkeypatch.setenv("BETON_SERVE_CACHE_DIR", str(tmp_path / "cc"))
    compiler._forget_compiled()
    s = default_store()
    assert s is not None
    yield s
    compiler._forget_compiled()


def _make_scale(k: float):
    def scale(x, out):  # pragma: no cover - compiled
        for i in range(x.shape[0]):
            out[i] = x[i] * k
        return out

    return scale


def _run(fn, n: int = 7) -> np.ndarray:
    x = np.arange(n, dtype=np.float64) / 3.0
    return fn(x, np.empty_like(x))  # type: ignore[no-any-return]


def test_same_function_is_compiled_once_per_process(store: DiskStore) -> None:
    first = Compiler.compile(_make_scale(1.7))
    out1 = _run(first)
    again = Compiler.compile(_make_scale(1.7))  # a new closure, as every new Loader makes
    assert again is first
    np.testing.assert_array_equal(_run(again), out1)
    assert store.saves == 1 and store.hits == 0  # not even a disk look-up
    other = Compiler.compile(_make_scale(2.5))  # another frozen value: other machine code
    assert other is not first
    np.testing.assert_array_equal(_run(other), np.arange(7) / 3.0 * 2.5)
    flagged = _make_scale(1.7)
    flagged.with_seed = True  # type: ignore[attr-defined]  # the plan sets flags on dispatchers
    assert Compiler.compile(flagged) is not first
    assert Compiler.compile(_make_scale(1.7), cache=False) is not first


def test_unkeyable_function_is_compiled_anew(store: DiskStore) -> None:
    path = ctypes.util.find_library("m")
    if path is None:
        pytest.skip("no libm")
    cos = ctypes.CDLL(path).cos
    cos.restype, cos.argtypes = ctypes.c_double, [ctypes.c_double]

    def make():
        def use_cos(x):  # pragma: no cover - compiled
            return cos(x)

        return use_cos

    a, b = Compiler.compile(make()), Compiler.compile(make())
    assert a is not b  # no fingerprint, no reuse (as before)
    assert a(0.0) == b(0.0) == 1.0


def test_a_function_compiled_for_many_captured_values_is_reported(
    store: DiskStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Each value's machine code stays for good: the 16th distinct value of one generated
    function logs a warning naming it (then the 32nd, 64th...), and a repeat value does not
    count."""
    caplog.set_level("WARNING", logger="beton_serve.compile")
    n = compiler.VARIANTS_WARN
    for k in range(n - 1):
        Compiler.compile(_make_scale(1.0 + k))
        Compiler.compile(_make_scale(1.0))  # the same value again: reused, not counted
    assert not caplog.records
    Compiler.compile(_make_scale(100.0))
    (rec,) = caplog.records
    msg = rec.getMessage()
    assert "_make_scale.<locals>.scale" in msg and f"for {n} distinct captured values" in msg
    assert "docs/custom-ops.md" in msg
    for k in range(n - 1):
        Compiler.compile(_make_scale(200.0 + k))
    assert len(caplog.records) == 1
    Compiler.compile(_make_scale(999.0))
    assert len(caplog.records) == 2 and f"for {2 * n} distinct" in caplog.records[1].getMessage()
