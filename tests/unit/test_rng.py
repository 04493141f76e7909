"""Counter-based RNG: numba versions equal the pure-Python reference; distributions are sane."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from beton_serve.pipeline import rng


def test_random_u64_matches_python_reference() -> None:
    gen = np.random.default_rng(0)
    for _ in range(200):
        key = int(gen.integers(0, 2**63)) * 2 + int(gen.integers(0, 2))
        sid = int(gen.integers(0, 2**40))
        c = int(gen.integers(0, 1000))
        assert int(rng.random_u64(np.uint64(key), np.uint64(sid), c)) == rng.py_random_u64(
            key, sid, c
        )
        assert rng.uniform(np.uint64(key), np.uint64(sid), c) == rng.py_uniform(key, sid, c)


def test_callable_from_compiled_code_and_same_values() -> None:
    @numba.njit
    def draws(key, ids):
        out = np.empty(ids.shape[0])
        for i in range(ids.shape[0]):
            out[i] = rng.uniform(key, ids[i], 3)
        return out

    key = rng.derive_seed_key(7, 1, 2)
    ids = np.arange(50, dtype=np.uint64)
    compiled = draws(key, ids)
    python = np.array([rng.py_uniform(int(key), i, 3) for i in range(50)])
    np.testing.assert_array_equal(compiled, python)


def test_derive_seed_key_separates_seed_epoch_position() -> None:
    keys = {int(rng.derive_seed_key(s, e, p)) for s in range(3) for e in range(3) for p in range(3)}
    assert len(keys) == 27
    assert rng.derive_seed_key(1, 2, 3) == rng.derive_seed_key(1, 2, 3)
    assert rng.derive_seed_key(0, 0, "mixup") == rng.derive_seed_key(0, 0, "mixup")
    assert rng.derive_seed_key(0, 0, "mixup") != rng.derive_seed_key(0, 1, "mixup")
    assert isinstance(rng.derive_seed_key(0, 0, 0), np.uint64)


def test_uniform_distribution() -> None:
    key = rng.derive_seed_key(0, 0, 0)
    u = np.array([rng.uniform(key, np.uint64(i), 0) for i in range(20000)])
    assert u.min() >= 0.0 and u.max() < 1.0
    hist, _ = np.histogram(u, bins=10, range=(0, 1))
    # each bin expects 2000 +- ~42 (binomial sd); 6 sd is a loose but real check
    assert np.all(np.abs(hist - 2000) < 260)
    # consecutive counters of one sample are uncorrelated
    v = np.array([rng.uniform(key, np.uint64(5), c) for c in range(20000)])
    assert abs(np.corrcoef(v[:-1], v[1:])[0, 1]) < 0.05


def test_randint_range_and_coverage() -> None:
    key = rng.derive_seed_key(1, 0, 0)
    vals = np.array([rng.randint(key, np.uint64(i), 0, 3, 9) for i in range(3000)])
    assert vals.min() == 3 and vals.max() == 8
    assert set(vals.tolist()) == set(range(3, 9))


def test_normal_moments() -> None:
    key = rng.derive_seed_key(2, 0, 0)
    x = np.array([rng.normal(key, np.uint64(i), 0) for i in range(20000)])
    assert abs(x.mean()) < 0.05 and abs(x.std() - 1) < 0.05


@pytest.mark.parametrize(("a", "b"), [(0.2, 0.2), (1.0, 1.0), (2.0, 5.0)])
def test_beta_moments(a: float, b: float) -> None:
    key = rng.derive_seed_key(3, 0, 0)
    x = np.array([rng.beta(key, np.uint64(i), 0, a, b) for i in range(8000)])
    assert np.all((x >= 0) & (x <= 1))
    mean = a / (a + b)
    var = a * b / ((a + b) ** 2 * (a + b + 1))
    assert abs(x.mean() - mean) < 0.02
    assert abs(x.var() - var) < 0.02
