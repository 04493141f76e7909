"""The SIGBUS handler of :mod:`beton_serve.format._guard`, as a cached Numba ``cfunc``.

Importing this module compiles (or loads from the compile cache, see ``beton_serve._cfunc_hook``) ``handler``, a C function
``void handler(int sig, siginfo_t *info, void *ctx)``. Nothing specific to one process is baked
into its machine code, so the cache is valid in every process: the table of guarded ranges and
the saved previous ``struct sigaction`` are reached through two external symbols,
``_guard.TABLE_SYMBOL`` and ``_guard.PREVIOUS_SYMBOL``, which :mod:`._guard` registers with
``llvmlite.binding.add_symbol`` *before* it imports this module; ``mmap`` and ``sigaction`` are
libc's, linked by name. Measured here: about 0.4 s to compile, 0.15 s to load from the cache.

Do not import this module anywhere else: without the two symbols registered, linking would
fail with an LLVM error that aborts the process, so an import out of turn (a documentation tool
importing every module, say) raises ``ImportError`` instead.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import carray, types
from numba.extending import intrinsic

from beton_serve import _cfunc_hook
from beton_serve.format._guard import MAX_REGIONS, PREVIOUS_SYMBOL, TABLE_SYMBOL

if not all(llvm_binding.address_of_symbol(s) for s in (TABLE_SYMBOL, PREVIOUS_SYMBOL)):
    raise ImportError(
        "beton_serve.format._guard_handler is loaded by beton_serve.format._guard, which first "
        "registers the symbols it links to; import beton_serve.format instead"
    )

#: Rows of the table (``lo``, ``hi``, ``hits``, ``in use``: 0, or 1 read-only, 2 writable; all
#: ``uint64``).
ROWS = MAX_REGIONS

_PAGE = np.uint64(mmap.PAGESIZE)
_SIGBUS = 7  # Linux, x86-64 and AArch64
_PROT_READ = 0x1
_PROT_READ_WRITE = 0x3
_WRITABLE = np.uint64(2)  # _guard._WRITABLE
_MAP_FIXED_PRIVATE_ANON = 0x02 | 0x10 | 0x20
_ONE = np.uint64(1)
_ZERO = np.uint64(0)

_mmap: Any = types.ExternalFunction(
    "mmap",
    types.voidptr(types.voidptr, types.uintp, types.int32, types.int32, types.int32, types.int64),
)
_sigaction: Any = types.ExternalFunction(
    "sigaction", types.int32(types.int32, types.voidptr, types.voidptr)
)


def _symbol(name: str) -> Any:
    def impl(typingctx: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            module = builder.module
            gv = module.globals.get(name)
            if gv is None:
                gv = ir.GlobalVariable(module, ir.IntType(8), name=name)
                gv.linkage = "external"
            return builder.bitcast(gv, ir.IntType(8).as_pointer())

        return types.voidptr(), codegen

    return intrinsic(impl)


def _as_ptr_impl(typingctx: Any, addr: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

    return types.voidptr(types.uint64), codegen


_table_ptr: Any = _symbol(TABLE_SYMBOL)
_previous_ptr: Any = _symbol(PREVIOUS_SYMBOL)
_as_ptr: Any = intrinsic(_as_ptr_impl)
# the persistent compile cache when beton_serve.pipeline is loaded, else Numba's own cache
_compile: Any = _cfunc_hook.cfunc(types.void(types.int32, types.voidptr, types.voidptr))


@_compile
def handler(sig: int, info: Any, ctx: Any) -> None:  # pragma: no cover - runs as C
    """Map a zero page over a fault inside a guarded range and count it; else chain."""
    words = carray(info, 4, np.uint64)
    addr = words[2]  # si_addr: offset 16 of siginfo_t on 64-bit Linux
    table = carray(_table_ptr(), (ROWS, 4), np.uint64)
    for i in range(ROWS):
        if table[i, 0] <= addr and addr < table[i, 1]:
            at = addr - (addr % _PAGE)
            prot = _PROT_READ_WRITE if table[i, 3] == _WRITABLE else _PROT_READ
            _mmap(_as_ptr(at), _PAGE, prot, _MAP_FIXED_PRIVATE_ANON, -1, 0)
            table[i, 2] += _ONE
            return
    # Not ours: put the previous handler back; the instruction faults again into it.
    _sigaction(_SIGBUS, _previous_ptr(), _as_ptr(_ZERO))
