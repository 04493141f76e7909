"""Counter-based random numbers: every draw is a pure function of its coordinates.

FFCV draws augmentations from Numba's per-thread MT19937 state, so a crop depends on which
thread ran the sample and on what that thread drew before; batches cannot be reproduced. beton-serve
instead makes every draw a pure function of where it is used::

    seed_key = derive_seed_key(seed, epoch, op_position)     # once per op per epoch (engine)
    u64      = random_u64(seed_key, sample_id, counter)      # one draw (inside the op)

The scheme (all arithmetic modulo 2**64, ``G = 0x9E3779B97F4A7C15``, the golden-ratio increment
of SplitMix64, and ``mix`` = the SplitMix64 output finaliser
``z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31``)::

    derive_seed_key(seed, epoch, pos) = mix(mix(mix(seed + G) ^ (epoch + 2G)) ^ (pos' + 3G))
        pos' = pos for an int position, or the 64-bit FNV-1a hash of the UTF-8 name for a named
        stream (ops that must share draws, e.g. ImageMixup and LabelMixup, use the stream "mixup")
    stream(seed_key, sample_id)       = mix(seed_key ^ mix(sample_id + G))
    random_u64(seed_key, sample_id, c) = mix(stream(seed_key, sample_id) + (c + 1) * G)

``random_u64`` is therefore SplitMix64 seeded per (op, epoch, sample) and read at position
``counter``; an op numbers its draws for one sample 0, 1, 2, ... Derived values:

* ``uniform``: ``(u64 >> 11) * 2**-53``, a double in ``[0, 1)`` with 53 random bits;
* ``uniform_range(a, b)``: ``a + (b - a) * uniform`` (as numpy's ``uniform``);
* ``randint(lo, hi)``: ``lo + floor(uniform * (hi - lo))`` in ``[lo, hi)`` (bias below 2**-40
  for ranges under 2**13, i.e. any image dimension);
* ``normal``: Box-Muller from counters ``c`` and ``c + 1``;
* ``gamma`` / ``beta``: Marsaglia-Tsang rejection reading counters in
  ``[c * 3072, (c + 1) * 3072)`` (a draw that needs more than 1023 tries, probability below
  1e-100, returns the last candidate), ``beta(a, b) = X / (X + Y)`` with ``X = gamma(a)`` at counter ``c`` and
  ``Y = gamma(b)`` at counter ``c + 1``.

Consequences: the same (seed, epoch, op position, sample id) gives the same draws whatever the
worker count, thread timing or batch slicing; a different epoch or op position gives independent
draws. The functions are Numba ``njit`` dispatchers (``nogil``), callable from Python and from
compiled op code; ``py_*`` twins in pure Python (exact integers) are the reference.
"""

from __future__ import annotations

import math

import numpy as np

from beton_serve.pipeline.compiler import Compiler

__all__ = [
    "beta",
    "derive_seed_key",
    "gamma",
    "mix64",
    "normal",
    "py_random_u64",
    "py_uniform",
    "randint",
    "random_u64",
    "stream_key",
    "uniform",
    "uniform_range",
]

_MASK = (1 << 64) - 1
_G = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB

_UG = np.uint64(_G)
_UM1 = np.uint64(_M1)
_UM2 = np.uint64(_M2)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
_S11 = np.uint64(11)
_ONE = np.uint64(1)
_INV53 = 1.0 / 9007199254740992.0  # 2**-53
_GAMMA_TRIES = 1023


# -- pure-Python reference (exact integer arithmetic) -------------------------------------------
def py_mix64(z: int) -> int:
    """SplitMix64 finaliser on a Python int (reference for :func:`mix64`)."""
    z &= _MASK
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def py_random_u64(seed_key: int, sample_id: int, counter: int) -> int:
    """Reference for :func:`random_u64` in pure Python."""
    state = py_mix64(int(seed_key) ^ py_mix64(int(sample_id) + _G))
    return py_mix64(state + (int(counter) + 1) * _G)


def py_uniform(seed_key: int, sample_id: int, counter: int) -> float:
    """Reference for :func:`uniform` in pure Python."""
    return (py_random_u64(seed_key, sample_id, counter) >> 11) * _INV53


def _fnv1a64(text: str) -> int:
    h = 0xCBF29CE484222325
    for byte in text.encode("utf-8"):
        h = ((h ^ byte) * 0x100000001B3) & _MASK
    return h


def derive_seed_key(seed: int, epoch: int, op_position: int | str) -> np.uint64:
    """The ``seed_key`` an op receives for one epoch (see the module docstring).

    Args:
        seed: the loader/stream seed (any int; taken modulo 2**64).
        epoch: the epoch number.
        op_position: the op's position in the plan (an int), or the name of a shared stream
            (a str) for ops that must draw the same values, e.g. ``"mixup"``.

    Returns:
        The key as ``np.uint64``.
    """
    pos = _fnv1a64(op_position) if isinstance(op_position, str) else int(op_position)
    k = py_mix64(int(seed) + _G)
    k = py_mix64(k ^ ((int(epoch) + 2 * _G) & _MASK))
    k = py_mix64(k ^ ((pos + 3 * _G) & _MASK))
    return np.uint64(k)


# -- Numba versions (also callable from Python) -------------------------------------------------
# Compiler.kernel: the same options as every op, and the persistent compile cache (issue 14).
# Compiled callers pass the counter (and randint's bounds) as ``np.int64(k)``, not a literal
# ``k``: Numba types a literal argument as its own constant, so each literal compiled (and
# cached) its own copy of the draw, and a flip's ``uniform(..., 0)`` could not load the entry the
# crop sampler's ``uniform(..., counter)`` had written into the cache (a cold start compiled it
# again, ~0.2 s). The values, and so the draws, are the same.
_jit = Compiler.kernel


@_jit
def mix64(z: np.uint64) -> np.uint64:  # pragma: no cover - compiled
    """SplitMix64 finaliser on a uint64."""
    z = np.uint64(z)
    z = (z ^ (z >> _S30)) * _UM1
    z = (z ^ (z >> _S27)) * _UM2
    return z ^ (z >> _S31)


@_jit
def stream_key(seed_key: np.uint64, sample_id: np.uint64) -> np.uint64:  # pragma: no cover
    """Per-(op, epoch, sample) SplitMix64 state."""
    return mix64(np.uint64(seed_key) ^ mix64(np.uint64(sample_id) + _UG))


@_jit
def random_u64(
    seed_key: np.uint64, sample_id: np.uint64, counter: int
) -> np.uint64:  # pragma: no cover
    """Draw number ``counter`` of sample ``sample_id`` under ``seed_key``: a uint64."""
    state = stream_key(seed_key, sample_id)
    return mix64(state + (np.uint64(counter) + _ONE) * _UG)


@_jit
def uniform(seed_key: np.uint64, sample_id: np.uint64, counter: int) -> float:  # pragma: no cover
    """A float64 uniform in ``[0, 1)`` with 53 random bits."""
    return float(random_u64(seed_key, sample_id, counter) >> _S11) * _INV53


@_jit
def uniform_range(
    seed_key: np.uint64, sample_id: np.uint64, counter: int, low: float, high: float
) -> float:  # pragma: no cover
    """A float64 uniform in ``[low, high)``: ``low + (high - low) * uniform``."""
    return low + (high - low) * uniform(seed_key, sample_id, counter)


@_jit
def randint(
    seed_key: np.uint64, sample_id: np.uint64, counter: int, low: int, high: int
) -> int:  # pragma: no cover
    """An int64 in ``[low, high)`` (``high > low`` required)."""
    return low + math.floor(uniform(seed_key, sample_id, counter) * (high - low))


@_jit
def normal(seed_key: np.uint64, sample_id: np.uint64, counter: int) -> float:  # pragma: no cover
    """A standard normal draw (Box-Muller on counters ``counter`` and ``counter + 1``)."""
    u1 = 1.0 - uniform(seed_key, sample_id, counter)  # in (0, 1]
    u2 = uniform(seed_key, sample_id, counter + 1)
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


@_jit
def gamma(
    seed_key: np.uint64, sample_id: np.uint64, counter: int, shape: float
) -> float:  # pragma: no cover
    """A Gamma(shape, 1) draw (Marsaglia-Tsang), ``shape > 0``; see the module docstring."""
    base = counter * 3072
    boost = 1.0
    a = shape
    if a < 1.0:
        # Gamma(a) = Gamma(a + 1) * U**(1/a); U uses the first counter of the block.
        u = 1.0 - uniform(seed_key, sample_id, base)
        boost = u ** (1.0 / a)
        a = a + 1.0
    d = a - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    v = 1.0
    for k in range(_GAMMA_TRIES):
        x = normal(seed_key, sample_id, base + 1 + 3 * k)
        v = 1.0 + c * x
        if v <= 0.0:
            continue
        v = v * v * v
        u = uniform(seed_key, sample_id, base + 3 + 3 * k)
        if u < 1.0 - 0.0331 * x * x * x * x:
            break
        if math.log(u) < 0.5 * x * x + d * (1.0 - v + math.log(v)):
            break
    return d * max(v, 1e-300) * boost


@_jit
def beta(
    seed_key: np.uint64, sample_id: np.uint64, counter: int, a: float, b: float
) -> float:  # pragma: no cover
    """A Beta(a, b) draw from two gamma draws at counters ``counter`` and ``counter + 1``."""
    x = gamma(seed_key, sample_id, counter, a)
    y = gamma(seed_key, sample_id, counter + 1, b)
    if x + y <= 0.0:
        return 0.5
    return x / (x + y)
