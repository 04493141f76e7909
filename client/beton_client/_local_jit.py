"""The one client module that imports ``beton_serve``: compiling ops the daemon handed back.

Route c of docs/custom-ops.md: a user's Numba op that the daemon may not (or cannot) build runs
in the training process, on the received batch, compiled here exactly as the daemon and the
in-process Loader compile it (``beton_serve.pipeline.compiler.Compiler``, same options), with
the same seed keys (``beton_serve.pipeline.rng.derive_seed_key``), so its output is bit-identical.

The imports are function-local: ``import beton_client`` imports neither beton_serve nor Numba,
and a trainer whose pipelines all run in the daemon never loads them. The user's op already
subclasses ``beton_serve``'s ``Operation``, so beton_serve is installed wherever this runs. The
import-linter contract "the client and the server never import each other" ignores exactly these
two edges (pyproject.toml, docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from beton_client.errors import SpecError

__all__ = ["compile_op", "seed_key"]

_FLAGS = ("with_indices", "with_seed", "python")


def compile_op(fn: Callable[..., Any], where: str) -> Callable[..., Any]:
    """``fn`` compiled as the daemon compiles a jit op (its ``with_*`` flags kept).

    Raises:
        SpecError: beton_serve (or Numba) is missing here, or Numba cannot compile ``fn``.
    """
    try:
        from beton_serve.pipeline.compiler import Compiler
    except ImportError as exc:
        raise SpecError(
            f"{where} must run in this process, which needs beton-serve's compiler and Numba "
            f"({exc}); pip install beton-serve here"
        ) from None
    flags = {k: getattr(fn, k) for k in _FLAGS if hasattr(fn, k)}
    try:
        out = Compiler.compile(fn)
    except Exception as exc:
        raise SpecError(f"{where}: numba could not compile it here: {exc}") from None
    for k, v in flags.items():
        try:
            setattr(out, k, v)
        except AttributeError:
            pass
    return out


def seed_key(seed: int, epoch: int, position: int) -> Any:
    """``derive_seed_key(seed, epoch, position)`` (a ``numpy.uint64``), as the daemon derives it."""
    from beton_serve.pipeline.rng import derive_seed_key

    return derive_seed_key(seed, epoch, position)
