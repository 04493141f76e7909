"""The persistent compile cache (issue 14): keys, hits across processes, bad entries, bounds.

Every test points the cache at ``tmp_path`` (``BETON_SERVE_CACHE_DIR``) or passes a store.
Hits are counted (store counters, Numba compile events), never timed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from beton_serve.cli._cache import main as cache_main
from beton_serve.pipeline import compiler
from beton_serve.pipeline._compile_key import fingerprint
from beton_serve.pipeline.compile_cache import (
    DEFAULT_MAX_BYTES,
    DiskStore,
    cache_dir,
    default_store,
)
from beton_serve.pipeline.compiler import Compiler
from helpers.child import child_env, run_json

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _every_compile_as_in_a_new_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests compile a function twice to see the second compile go to disk, as a new
    process does: the in-process reuse of ``Compiler.compile`` (tests/unit/test_compiler_reuse.py)
    is off here."""
    monkeypatch.setattr(compiler, "_memo_key", lambda fn, cache: None)


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> DiskStore:
    monkeypatch.setenv("BETON_SERVE_CACHE_DIR", str(tmp_path / "cc"))
    s = default_store()
    assert s is not None and s.root == tmp_path / "cc"
    return s


def _make_scale(k: float):
    """A generated closure, as ops' generate_code() return them."""

    def scale(x, out):  # pragma: no cover - compiled
        for i in range(x.shape[0]):
            out[i] = x[i] * k
        return out

    return scale


def _run(fn, n: int = 7) -> np.ndarray:
    x = np.arange(n, dtype=np.float64) / 3.0
    return fn(x, np.empty_like(x))  # type: ignore[no-any-return]


def _entries(s: DiskStore) -> list[Path]:
    return sorted(s.entries_dir.glob("*.nbk"))


# -- keys ------------------------------------------------------------------------------------
def test_key_covers_closure_values_and_callees() -> None:
    assert fingerprint(_make_scale(2.0)) == fingerprint(_make_scale(2.0))
    assert fingerprint(_make_scale(2.0)) != fingerprint(_make_scale(3.0))

    from beton_serve._kernels import crop

    base = fingerprint(crop.rrc_batch.py_func)
    assert base is not None
    # a callee two modules away (rng) is part of the key: change one of its frozen globals
    from beton_serve.pipeline import rng

    old = rng._INV53  # read by rng.uniform, which crop.random_resized_crop calls
    try:
        rng._INV53 = old * 0.5
        assert fingerprint(crop.rrc_batch.py_func) != base
    finally:
        rng._INV53 = old
    assert fingerprint(crop.rrc_batch.py_func) == base


def test_unkeyable_function_compiles_uncached(store: DiskStore) -> None:
    path = ctypes.util.find_library("m")
    if path is None:
        pytest.skip("no libm")
    cos = ctypes.CDLL(path).cos
    cos.restype, cos.argtypes = ctypes.c_double, [ctypes.c_double]

    def use_cos(x):  # pragma: no cover - compiled
        return cos(x)

    assert fingerprint(use_cos) is None
    fn = Compiler.compile(use_cos)
    assert fn(0.0) == 1.0
    assert _entries(store) == [] and store.saves == 0


# -- hits ------------------------------------------------------------------------------------
def test_hit_in_process_is_bit_identical(store: DiskStore) -> None:
    first = Compiler.compile(_make_scale(1.7))
    out1 = _run(first)
    assert store.saves == 1 and len(_entries(store)) == 1
    second = Compiler.compile(_make_scale(1.7))  # a new dispatcher, loaded from disk
    out2 = _run(second)
    assert store.hits == 1
    stats = second.stats  # type: ignore[attr-defined]
    assert stats.cache_hits and not stats.cache_misses
    uncached = _run(Compiler.compile(_make_scale(1.7), cache=False))
    np.testing.assert_array_equal(out1, uncached)
    np.testing.assert_array_equal(out2, uncached)
    assert out2.tobytes() == uncached.tobytes()


@pytest.mark.slow
def test_kernels_hit_and_match_uncached(store: DiskStore) -> None:
    from beton_serve._kernels import resize as rz

    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, size=(61, 47, 3), dtype=np.uint8)
    outs = []
    for cache in (store, store, False):
        disp = Compiler.compile(rz.area_resize.py_func, cache=cache)
        dst = np.zeros((20, 17, 3), np.uint8)
        scratch = np.zeros(rz.scratch_size(45, 17), np.float32)
        disp(src, src.reshape(-1), 2, 1, 55, 45, dst, dst.reshape(-1), scratch)
        outs.append(dst)
    assert store.hits >= 1
    np.testing.assert_array_equal(outs[0], outs[2])
    np.testing.assert_array_equal(outs[1], outs[2])


_CHILD = textwrap.dedent(
    """
    import hashlib, json, sys
    from numba.core import event
    compiles = []

    class Count(event.Listener):
        def on_start(self, e):
            d = e.data["dispatcher"]
            # only what goes through the compile cache (Compiler.compile / Compiler.kernel)
            if type(d._cache).__name__ == "KeyedCache":
                compiles.append(d.py_func.__qualname__)

        def on_end(self, e):
            pass

    event.register("numba:compile", Count())
    from beton_serve.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from beton_serve.loader import Loader, OrderOption
    from beton_serve.pipeline.compile_cache import default_store
    from beton_serve.transforms import RandomHorizontalFlip

    pipes = {
        "image": [RandomResizedCropRGBImageDecoder((24, 24)), RandomHorizontalFlip()],
        "label": [IntDecoder()],
    }
    h = hashlib.sha256()
    with Loader(sys.argv[1], batch_size=4, num_workers=1, order=OrderOption.RANDOM, seed=5,
                pipelines=pipes) as ld:
        for img, label in ld:
            h.update(bytes(memoryview(img)))
            h.update(bytes(memoryview(label)))
    st = default_store()
    print(json.dumps({"compiles": len(compiles), "names": compiles, "hits": st.hits, "saves": st.saves,
                      "digest": h.hexdigest()}))
    """
)


class _Images:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        rng = np.random.default_rng(i)
        h, w = 30 + 3 * i, 40 + 2 * i
        img = np.clip(
            np.linspace(0, 255, h * w * 3).reshape(h, w, 3) + rng.normal(0, 9, (h, w, 3)), 0, 255
        )
        return img.astype(np.uint8), i


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_second_process_compiles_nothing(tmp_path: Path) -> None:
    from beton_serve.fields import IntField, RGBImageField
    from beton_serve.writer import DatasetWriter

    data = tmp_path / "img.beton"
    DatasetWriter(
        str(data), {"image": RGBImageField(write_mode="jpg"), "label": IntField()}
    ).from_indexed_dataset(_Images(12))
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = dict(os.environ, BETON_SERVE_CACHE_DIR=str(tmp_path / "cc"))

    def child() -> dict:
        out = subprocess.run(
            [sys.executable, str(script), str(data)],
            env=env,
            capture_output=True,
            text=True,
            timeout=200,
            cwd=ROOT,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]

    cold, warm = child(), child()
    assert cold["compiles"] > 0 and cold["saves"] > 0
    assert warm["compiles"] == 0, warm
    assert warm["hits"] > 0 and warm["saves"] == 0
    assert warm["digest"] == cold["digest"]  # cached machine code: the same bytes


# -- bad entries -----------------------------------------------------------------------------
def _one_entry(store: DiskStore, k: float = 1.25) -> Path:
    _run(Compiler.compile(_make_scale(k)))
    (entry,) = _entries(store)
    return entry


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty"])
def test_corrupt_entry_is_recompiled(store: DiskStore, damage: str) -> None:
    entry = _one_entry(store)
    data = bytearray(entry.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[-10] ^= 0xFF
    elif damage == "garbage":
        data = bytearray(os.urandom(len(data)))
    else:
        data = bytearray()
    entry.write_bytes(bytes(data))
    fn = Compiler.compile(_make_scale(1.25))
    np.testing.assert_array_equal(_run(fn), _run(Compiler.compile(_make_scale(1.25), cache=False)))
    assert store.rejected == 1 and store.saves == 2  # recompiled and replaced
    assert Compiler.compile(_make_scale(1.25)) is not fn
    _run(Compiler.compile(_make_scale(1.25)))
    assert store.hits == 1


def test_stale_entry_under_another_key_is_rejected(store: DiskStore) -> None:
    a = _one_entry(store, 1.5)
    _run(Compiler.compile(_make_scale(2.5)))
    b = next(p for p in _entries(store) if p != a)
    b.write_bytes(a.read_bytes())  # a valid entry, but for another key
    out = _run(Compiler.compile(_make_scale(2.5)))
    np.testing.assert_array_equal(out, np.arange(7) / 3.0 * 2.5)
    assert store.rejected == 1


def test_unpicklable_payload_is_recompiled(store: DiskStore) -> None:
    entry = _one_entry(store)
    key = bytes.fromhex(entry.name.split(".")[0])
    store.put(key, b"not a pickle")  # valid header and checksum, useless payload
    out = _run(Compiler.compile(_make_scale(1.25)))
    np.testing.assert_array_equal(out, np.arange(7) / 3.0 * 1.25)
    assert store.rejected == 1


def test_foreign_entries_are_not_used(store: DiskStore) -> None:
    entry = _one_entry(store)
    entry.chmod(0o666)  # writable by others: anyone could have replaced it
    _run(Compiler.compile(_make_scale(1.25)))
    assert store.rejected == 1 and store.hits == 0
    if os.geteuid() != 0:
        return
    entry = _entries(store)[0]
    os.chown(entry, 4321, -1)  # another user's file
    _run(Compiler.compile(_make_scale(1.25)))
    assert store.rejected == 2 and store.hits == 0
    link = entry.with_suffix(".tmp")
    entry.rename(link)
    entry.symlink_to(link)
    _run(Compiler.compile(_make_scale(1.25)))
    assert store.rejected == 3 and store.hits == 0


def test_directory_is_private_and_foreign_directory_disables(tmp_path: Path) -> None:
    root = tmp_path / "loose"
    root.mkdir(mode=0o755)
    root.chmod(0o755)
    s = DiskStore(root)
    assert s.ready()
    assert (root.stat().st_mode & 0o777) == 0o700
    assert (s.entries_dir.stat().st_mode & 0o777) == 0o700
    if os.geteuid() != 0:
        return
    other = tmp_path / "other"
    other.mkdir()
    os.chown(other, 4321, 4321)
    s2 = DiskStore(other)
    assert not s2.ready() and "uid 4321" in s2.problem()
    fn = Compiler.compile(_make_scale(4.0), cache=s2)  # compiles, uncached, no error
    np.testing.assert_array_equal(_run(fn), np.arange(7) / 3.0 * 4.0)
    assert s2.saves == 0 and not list(other.iterdir())


def test_env_selects_directory(tmp_path: Path) -> None:
    assert cache_dir({"BETON_SERVE_CACHE_DIR": "off"}) is None
    assert cache_dir({"BETON_SERVE_CACHE_DIR": str(tmp_path)}) == tmp_path
    assert cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "beton-serve"
    assert cache_dir({}) == Path.home() / ".cache" / "beton-serve"
    s = default_store({"BETON_SERVE_CACHE_DIR": str(tmp_path), "BETON_SERVE_CACHE_MAX_MB": "2"})
    assert s is not None and s.max_bytes == 2 * 1024 * 1024
    # XDG: a relative XDG_CACHE_HOME is ignored (it put the cache under each working directory)
    assert cache_dir({"XDG_CACHE_HOME": "rel/cache"}) == Path.home() / ".cache" / "beton-serve"
    # inf raised OverflowError (`cache info` crashed); 0 and negatives silently meant 1 byte
    for bad in ("inf", "1e400", "nan", "0", "-1", "lots"):
        env = {"BETON_SERVE_CACHE_DIR": str(tmp_path), "BETON_SERVE_CACHE_MAX_MB": bad}
        s = default_store(env)
        assert s is not None and s.max_bytes == DEFAULT_MAX_BYTES, bad


# -- concurrency and size ----------------------------------------------------------------------
_WRITER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from beton_serve.pipeline.compile_cache import DiskStore
    s = DiskStore(Path(sys.argv[1]))
    key = bytes(32)
    me = int(sys.argv[2])
    bad = 0
    for i in range(80):
        s.put(key, bytes([me]) * (1000 + 7919 * ((i + me) % 13)))
        got = s.get(key)
        if got is None or len(set(got)) != 1:
            bad += 1
    print(bad)
    """
)


@pytest.mark.timeout(60)
def test_concurrent_writers_never_expose_a_partial_entry(tmp_path: Path) -> None:
    root = tmp_path / "cc"
    DiskStore(root).ready()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(root), str(i)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for i in range(4)
    ]
    try:
        outs = [p.communicate(timeout=50)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
    assert [int(o.strip()) for o in outs] == [0, 0, 0, 0]
    s = DiskStore(root)
    assert s.get(bytes(32)) is not None and s.rejected == 0
    assert [p.name for p in s.entries_dir.iterdir()] == [bytes(32).hex() + ".nbk"]


def test_size_bound_evicts_least_recently_used(tmp_path: Path) -> None:
    s = DiskStore(tmp_path / "cc", max_bytes=10_500)  # five entries of 2,069 bytes
    keys = [bytes([i]) * 32 for i in range(8)]
    for i, k in enumerate(keys[:4]):
        s.put(k, b"x" * 2000)
        os.utime(s._path(k), (1000 + i, 1000 + i))
    assert s.get(keys[0]) is not None  # a hit: key 0 becomes the most recent
    for k in keys[4:]:
        s.put(k, b"y" * 2000)
    info = s.info()
    assert info.total_bytes <= 10_500 and info.entries == 5
    assert s.get(keys[0]) is not None
    assert s.get(keys[1]) is None and s.get(keys[2]) is None
    assert s.get(keys[7]) is not None


# -- info / clear ----------------------------------------------------------------------------
def test_cli_info_and_clear(store: DiskStore, capsys: pytest.CaptureFixture[str]) -> None:
    _one_entry(store)
    assert cache_main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["path"] == str(store.root) and info["entries"] == 1 and info["bytes"] > 0
    assert info["usable"] is True
    assert cache_main(["info"]) == 0
    assert "entries:  1" in capsys.readouterr().out
    assert cache_main(["clear"]) == 0
    assert "removed 1" in capsys.readouterr().out
    assert _entries(store) == []
    missing = store.root.parent / "nothing-here"
    assert cache_main(["info", "--dir", str(missing)]) == 0
    assert "empty" in capsys.readouterr().out and not missing.exists()
    assert cache_main([]) == 2


def test_a_directory_in_an_entrys_place_is_replaced_and_cleared(
    store: DiskStore, capsys: pytest.CaptureFixture[str]
) -> None:
    """A directory where an entry goes: every process failed to save it ("could not save an
    entry", forever), and ``cache clear`` said it removed 0 and exited 0 with it still there."""
    key = bytes([7]) * 32
    store.entries_dir.mkdir(parents=True, exist_ok=True)
    store._path(key).mkdir()
    (store._path(key) / "junk").write_bytes(b"z")
    assert store.put(key, b"payload") and store.get(key) == b"payload"
    other = bytes([8]) * 32
    store._path(other).mkdir()
    assert cache_main(["clear"]) == 0
    assert "removed 2" in capsys.readouterr().out
    assert _entries(store) == [] and not store._path(other).exists()


def test_cli_info_says_when_the_directory_could_never_be_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    where = a_file / "cache"  # under a regular file: mkdir fails with ENOTDIR
    assert cache_main(["info", "--dir", str(where)]) == 0
    out = capsys.readouterr().out
    assert f"not usable: cannot create {where}: {a_file} is not a directory" in out
    assert cache_main(["info", "--json", "--dir", str(where)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["usable"] is False and "is not a directory" in info["problem"]
    assert not info["exists"]


# -- pre-compiling -----------------------------------------------------------------------------
_PRECOMPILE_TOML = """
[[precompile]]
dataset = "img"
batch_size = 4
[precompile.pipelines]
image = [
  { op = "RandomResizedCropRGBImageDecoder", params = { output_size = [24, 24] } },
  { op = "RandomHorizontalFlip" },
]
label = [{ op = "IntDecoder" }]
"""


def test_precompile_config_parses_and_rejects(tmp_path: Path) -> None:
    from beton_serve.cli.config import load_config
    from beton_serve.errors import ConfigError

    cfg_path = tmp_path / "c.toml"
    cfg_path.write_text(_PRECOMPILE_TOML)
    (spec,) = load_config(cfg_path).precompile
    assert spec.dataset == "img" and spec.batch_size == 4
    assert [o.op for o in spec.pipelines["image"]] == [  # type: ignore[union-attr]
        "RandomResizedCropRGBImageDecoder",
        "RandomHorizontalFlip",
    ]
    assert dict(spec.pipelines["image"][0].params) == {"output_size": [24, 24]}  # type: ignore[index]
    for bad, needle in (
        (
            '[[precompile]]\nbatch_size = 4\n[precompile.pipelines]\nx = [{op = "IntDecoder"}]',
            "one of",
        ),
        ('[[precompile]]\ndataset = "a"\nfile = "b"\n[precompile.pipelines]\nx = []', "one of"),
        ('[[precompile]]\ndataset = "a"\ncolour = 1\n[precompile.pipelines]\nx = []', "colour"),
        (
            '[[precompile]]\ndataset = "a"\n[precompile.pipelines]\nx = [{name = "IntDecoder"}]',
            "op",
        ),
        ('[[precompile]]\ndataset = "a"', "pipelines"),
        ('precompile = "x"', "list of tables"),
    ):
        cfg_path.write_text(bad)
        with pytest.raises(ConfigError, match=needle):
            load_config(cfg_path)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_precompile_at_start_leaves_nothing_to_compile(
    tmp_path: Path, store: DiskStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from beton_serve.cli.config import load_config
    from beton_serve.daemon import Daemon, start_precompile
    from beton_serve.fields import IntField, RGBImageField
    from beton_serve.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from beton_serve.loader import Loader
    from beton_serve.transforms import RandomHorizontalFlip
    from beton_serve.writer import DatasetWriter
    from numba.core import event

    data = tmp_path / "img.beton"
    DatasetWriter(
        str(data), {"image": RGBImageField(write_mode="jpg"), "label": IntField()}
    ).from_indexed_dataset(_Images(6))
    cfg_path = tmp_path / "c.toml"
    cfg_path.write_text(_PRECOMPILE_TOML)
    specs = load_config(cfg_path).precompile
    daemon = Daemon.create({"img": [str(data)]}, num_workers=1, sweep=False)
    try:
        fut = start_precompile(daemon, specs)
        assert fut is not None
        (result,) = fut.result(timeout=200)
        assert result.error == "" and result.target == "img"
    finally:
        daemon.close()
    assert store.saves > 0

    compiled: list[str] = []

    class Count(event.Listener):
        def on_start(self, e: event.Event) -> None:
            d = e.data["dispatcher"]
            if type(d._cache).__name__ == "KeyedCache":  # what the compile cache can hold
                compiled.append(d.py_func.__qualname__)

        def on_end(self, e: event.Event) -> None:
            pass

    pipes: dict[str, Any] = {
        "image": [RandomResizedCropRGBImageDecoder((24, 24)), RandomHorizontalFlip()],
        "label": [IntDecoder()],
    }
    with event.install_listener("numba:compile", Count()):
        with Loader(str(data), batch_size=4, num_workers=1, pipelines=pipes) as ld:
            batches = list(ld)
    assert len(batches) == 1  # drop_last, as FFCV
    assert compiled == []  # the client's plan found every kernel compiled or cached


_OVERLOAD_CHILD = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import stubs_mod, ext_mod  # ext_mod registers an @overload of stubs_mod.bump
    from beton_serve.pipeline.compile_cache import default_store
    from beton_serve.pipeline.compiler import Compiler

    def make():
        def f(x):
            return stubs_mod.bump(x)
        return f

    fn = Compiler.compile(make())
    s = default_store()
    print(json.dumps({"out": fn(10), "hits": s.hits, "saves": s.saves}))
    """
)


def test_an_overload_in_another_file_is_part_of_the_key(tmp_path: Path) -> None:
    """The function reaches ``stubs_mod`` only; the machine code comes from ``ext_mod``'s
    ``@overload``. Changing ``ext_mod`` must recompile, never load the old code."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "stubs_mod.py").write_text("def bump(x):\n    return x\n")
    ext = mods / "ext_mod.py"

    def write_ext(k: int) -> None:
        ext.write_text(
            "from numba.extending import overload\n"
            "import stubs_mod\n\n\n"
            "@overload(stubs_mod.bump)\n"
            "def _ol(x):\n"
            f"    return lambda x: x + {k}\n"
        )

    env = child_env(BETON_SERVE_CACHE_DIR=str(tmp_path / "cc"), PYTHONDONTWRITEBYTECODE="1")

    def run() -> dict[str, Any]:
        return run_json(_OVERLOAD_CHILD, str(mods), env=env, timeout=120)  # type: ignore[no-any-return]

    write_ext(1)
    first = run()
    assert first == {"out": 11, "hits": 0, "saves": 1}
    assert run() == {"out": 11, "hits": 1, "saves": 0}  # unchanged: loaded from the cache
    write_ext(2)
    changed = run()
    assert changed["out"] == 12, "stale machine code of the old @overload was loaded"
    assert changed["hits"] == 0 and changed["saves"] == 1


_WARM_CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from beton_serve.pipeline.compile_cache import default_store
    from beton_serve.pipeline.compiler import Compiler

    def make(k):
        def scale(x, out):
            for i in range(x.shape[0]):
                out[i] = x[i] * k
            return out
        return scale

    fn = Compiler.compile(make(1.5))
    out = fn(np.arange(4.0), np.empty(4))
    s = default_store()
    print(json.dumps({"out": out.tolist(), "hits": s.hits,
                      "registries": "numba.np.arraymath" in sys.modules}))
    """
)


def test_a_warm_load_does_not_install_numbas_registries(tmp_path: Path) -> None:
    """Loading machine code needs the runtime, not Numba's typing and lowering registries
    (``refresh()``, ~0.25 s of a warm start-up): only a compile installs them."""
    env = child_env(BETON_SERVE_CACHE_DIR=str(tmp_path / "cc"))

    def run() -> dict[str, Any]:
        return run_json(_WARM_CHILD, env=env, timeout=120)  # type: ignore[no-any-return]

    cold = run()
    assert cold == {"out": [0.0, 1.5, 3.0, 4.5], "hits": 0, "registries": True}
    warm = run()
    assert warm == {"out": [0.0, 1.5, 3.0, 4.5], "hits": 1, "registries": False}


_LATER_GLOBAL_CHILD = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import later_mod
    from beton_serve.pipeline.compile_cache import default_store
    print(json.dumps({"out": later_mod.f(10), "hits": default_store().hits}))
    """
)


def test_a_kernel_is_keyed_on_globals_defined_below_it(tmp_path: Path) -> None:
    """``Compiler.kernel`` runs at import, before the module's later globals exist: the key is
    taken at the first compile, so a later global's value is in it (here it comes from the
    environment, so the file does not change)."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "later_mod.py").write_text(
        "import os\n"
        "from beton_serve.pipeline.compiler import Compiler\n\n\n"
        "@Compiler.kernel\n"
        "def f(x):\n"
        "    return x + K\n\n\n"
        "K = int(os.environ['LATER_K'])\n"
    )

    def run(k: int) -> dict[str, Any]:
        env = child_env(BETON_SERVE_CACHE_DIR=str(tmp_path / "cc"), LATER_K=str(k))
        return run_json(_LATER_GLOBAL_CHILD, str(mods), env=env, timeout=120)  # type: ignore[no-any-return]

    assert run(1) == {"out": 11, "hits": 0}
    assert run(1) == {"out": 11, "hits": 1}
    assert run(2) == {"out": 12, "hits": 0}, "the machine code of another K was loaded"


_CLOSURES = """
import json, sys
import numpy as np
from beton_serve.pipeline.compiler import Compiler

def make_fill(dtype):
    def fill(n):
        out = np.empty(n, dtype)  # boxed on return: its dtype is a constant of the environment
        for i in range(n):
            out[i] = i * 1.5
        return out
    return fill

if sys.argv[1] == "--same-ids":  # number functions as every process did before session 25
    import itertools

    import numba
    from beton_serve.pipeline import compile_cache
    from numba.core import bytecode

    compile_cache.attach(numba.njit(lambda: 0))  # the first attach spreads the ids ...
    bytecode.FunctionIdentity._unique_ids = itertools.count(7)  # ... undone here
    del sys.argv[1]
kept, out = [], {}
for name in sys.argv[1:]:
    fn = Compiler.compile(make_fill(getattr(np, name)))
    kept.append(fn)  # both alive, as two Loaders' plans are
    try:
        r = fn(4)
        out[name] = [str(r.dtype), r.tolist(), len(fn.stats.cache_hits)]
    except Exception as exc:
        out[name] = repr(exc)
print(json.dumps(out))
"""


def test_entries_compiled_in_different_processes_never_share_symbols(tmp_path: Path) -> None:
    """Two closures of one function with different captured values, each compiled as the first
    function of its own process, then both loaded from the cache into a third process: each must
    run with its own constants. Numba names a function's symbols (its code and its environment of
    constants) after a per-process counter; entries compiled at the same count in two processes
    had the same names, and the second one loaded took the first one's environment: the float64
    function returned its array labelled float32, with garbage values (or boxing failed with
    ``'descr' is NULL``: a RandomHorizontalFlip after a flip of another probability, found by a
    served-against-in-process fuzz). Function ids now start at a random point in every process."""
    env = child_env(BETON_SERVE_CACHE_DIR=str(tmp_path / "cc"))
    want = [0.0, 1.5, 3.0, 4.5]
    for name in ("float32", "float64"):  # each compiled (and saved) alone in a fresh process
        assert run_json(_CLOSURES, name, env=env) == {name: [name, want, 0]}
    for order in (("float32", "float64"), ("float64", "float32")):
        got = run_json(_CLOSURES, *order, env=env)  # both loaded from the cache
        assert got == {n: [n, want, 1] for n in order}


def test_an_entry_whose_names_another_entry_took_is_compiled_not_loaded(tmp_path: Path) -> None:
    """Should two entries still carry the same names (here forced: both compiled with the ids
    every process used before), the process that loads the first compiles the second instead of
    loading it, and both run with their own constants."""
    env = child_env(BETON_SERVE_CACHE_DIR=str(tmp_path / "cc"))
    want = [0.0, 1.5, 3.0, 4.5]
    for name in ("float32", "float64"):
        assert run_json(_CLOSURES, "--same-ids", name, env=env) == {name: [name, want, 0]}
    got = run_json(_CLOSURES, "float32", "float64", env=env)
    assert got == {"float32": ["float32", want, 1], "float64": ["float64", want, 0]}


def test_a_fork_child_numbers_its_functions_apart_from_its_parent() -> None:
    """A fork child would count on from its parent's function ids (and save entries whose names
    the parent's own functions carry): it draws a new start."""
    from beton_serve.pipeline import compile_cache
    from numba.core.bytecode import FunctionIdentity

    compile_cache._spread_function_ids()
    parent_next = next(FunctionIdentity._unique_ids)
    assert parent_next >= compile_cache._ID_FLOOR
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.write(w, str(next(FunctionIdentity._unique_ids)).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        child_next = int(f.read())
    os.waitpid(pid, 0)
    assert child_next >= compile_cache._ID_FLOOR
    assert abs(child_next - parent_next) > 1_000_000  # not the parent's count carried on


def test_precompile_stops_at_the_next_entry_once_the_daemon_stops(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SIGTERM during a precompile waited for every entry (12-16 s each, cold, on 2 cores): a
    daemon with several entries outlived the deploy files' 30 s grace. Now a stopping daemon
    skips the entries left, and an entry's run once its plan is built."""
    import threading

    from beton_serve.daemon._precompile import STOPPED, PrecompileOp, PrecompileSpec, precompile

    stopping = threading.Event()
    calls: list[str] = []

    class Plan:
        def acquire_workspace(self) -> None:
            calls.append("run")

    class FakeBackend:
        def build_op(self, name: str, params: dict) -> str:
            return name

        def compile(self, reader: Any, pipelines: Any, batch_size: int) -> Plan:
            calls.append(f"compile {reader}")
            if reader == "b":
                stopping.set()  # SIGTERM while this entry's plan compiles
            return Plan()

        def num_samples(self, reader: Any) -> int:
            raise AssertionError("a stopped entry does not run")

    class Datasets:
        def get(self, name: str) -> Any:
            return type("DS", (), {"reader": name})()

    ops = {"label": (PrecompileOp(op="IntDecoder"),)}
    specs = [PrecompileSpec(dataset=n, batch_size=4, pipelines=ops) for n in "bcd"]
    with caplog.at_level("INFO", logger="beton_serve.daemon"):
        results = precompile(specs, datasets=Datasets(), backend=FakeBackend(), stopping=stopping)
    assert calls == ["compile b"]
    assert [(r.target, r.error) for r in results] == [
        ("b", STOPPED),
        ("c", STOPPED),
        ("d", STOPPED),
    ]
    assert "precompile stopped target=b" in caplog.text
    assert "precompile stopped: the daemon is stopping (2 entries left)" in caplog.text
    assert "failed" not in caplog.text


def test_closing_the_plan_registry_tells_its_work_to_stop() -> None:
    from beton_serve.daemon._plans import PlanRegistry

    reg = PlanRegistry(backend=None, op_imports=None)  # type: ignore[arg-type]
    seen = reg.submit(reg.stopping.wait, 5.0)
    reg.close()
    assert seen.result(timeout=10) is True


@pytest.mark.timeout(60)
def test_a_draining_daemon_stops_its_precompile(fixtures_dir: Path) -> None:
    """SIGTERM drains the daemon's streams first: the precompile stops meanwhile."""
    import asyncio

    from beton_serve.daemon import Daemon

    daemon = Daemon.create(
        {"img": [str(fixtures_dir / "images_jpg.beton")]}, num_workers=1, sweep=False
    )
    try:
        assert not daemon.plans.stopping.is_set()
        asyncio.run(daemon.drain(0.1))
        assert daemon.plans.stopping.is_set()
    finally:
        daemon.close()
