"""``beton_serve._cfunc_hook``: the SIGBUS guard's handler compiles even where Numba cannot
cache it (found by the non-root audit: HOME unwritable, `inspect` printed "no SIGBUS guard")."""

from __future__ import annotations

from typing import Any

import numba
import pytest
from beton_serve import _cfunc_hook


def test_a_cache_numba_cannot_write_still_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    real = numba.cfunc
    calls: list[bool] = []

    def cfunc(sig: Any, cache: bool = False) -> Any:
        calls.append(cache)
        if cache:

            def refuse(fn: Any) -> Any:
                raise RuntimeError(f"cannot cache function {fn.__name__!r}: no locator available")

            return refuse
        return real(sig)

    monkeypatch.setattr(_cfunc_hook, "_factory", None)
    monkeypatch.setattr(numba, "cfunc", cfunc)

    def add_one(x: int) -> int:
        return x + 1

    compiled = _cfunc_hook.cfunc(numba.types.int64(numba.types.int64))(add_one)
    assert calls == [True, False]
    assert compiled.ctypes(41) == 42
