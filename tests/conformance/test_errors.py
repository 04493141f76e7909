"""Conformance: bad input is refused the same way by every backend: the same error class
(``beton_serve.errors.X`` and ``beton_client.errors.X`` by name) and an equivalent message, when
the Loader is built or at its first batch (issue 12 §3: "identical errors")."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from beton_serve.fields.decoders import IntDecoder, NDArrayDecoder, RandomResizedCropRGBImageDecoder
from beton_serve.transforms import Convert, Squeeze, ToDevice, ToTensor
from helpers.daemon import DaemonProcess
from helpers.labelled import write_labelled

from conformance._backends import (
    SERVED,
    assert_same_error,
    attempt,
    make_loader,
    module_daemon,
    serving,
)

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parents[1]

N = 20


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_labelled(tmp_path_factory.mktemp("conf-errors") / "labelled.beton", N, 0)


@pytest.fixture(scope="module")
def daemon(data: Path) -> Iterator[DaemonProcess]:
    with module_daemon([data]) as d:
        yield d


def pipes() -> dict[str, Any]:
    return {"vec": [NDArrayDecoder(), ToTensor()], "label": [IntDecoder(), ToTensor()]}


class NotAnOp:
    """Something that is neither an FFCV Operation, a torch Module nor a callable."""


class Boom(torch.nn.Module):
    """A torch module that fails on the batch (a client-side tail op, accepted by both)."""

    def forward(self, x: Any) -> Any:
        raise ValueError("boom: a client-side op failed")


def _with(**changes: Any) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        return {**pipes(), **changes}

    return make


#: id -> (Loader arguments, pipelines factory, regex both messages must match)
CASES: dict[str, tuple[dict[str, Any], Callable[[], dict[str, Any]], str]] = {
    "negative_batch_size": ({"batch_size": -1}, pipes, r"batch_size"),
    "zero_batch_size": ({"batch_size": 0}, pipes, r"batch_size"),
    "float_batch_size": ({"batch_size": 2.5}, pipes, r"batch_size must be an int"),
    "string_batch_size": ({"batch_size": "4"}, pipes, r"batch_size must be an int, not '4'"),
    "zero_batches_ahead": ({"batches_ahead": 0}, pipes, r"batches_ahead"),
    "negative_seed": ({"seed": -1}, pipes, r"seed"),
    "huge_seed": ({"seed": 2**64}, pipes, r"seed"),
    "index_out_of_range": ({"indices": [0, N]}, pipes, r"indices|sample"),
    "negative_index": ({"indices": [3, -1]}, pipes, r"indices|negative"),
    "fractional_index": ({"indices": [0.5, 1.0]}, pipes, r"indices|integer"),
    "empty_indices": ({"indices": []}, pipes, r"indices"),
    "unknown_field": ({}, _with(nope=[IntDecoder()]), r"nope"),
    "unknown_op": ({}, _with(label=[IntDecoder(), NotAnOp()]), r"NotAnOp"),
    "string_as_op": ({}, _with(label=[IntDecoder(), "ToTensor"]), r"ToTensor|str"),
    "wrong_decoder_for_field": (
        {},
        _with(label=[RandomResizedCropRGBImageDecoder((8, 8)), ToTensor()]),
        r"label|RandomResizedCrop|IntField",
    ),
    "bad_order": ({"order_value": 7}, pipes, r"order"),
    "pipeline_not_a_list": ({}, _with(label="IntDecoder"), r"label|list|pipeline"),
    "torch_op_before_to_tensor": (
        {},
        lambda: {**pipes(), "label": [IntDecoder(), Squeeze(), ToTensor()]},
        r"Squeeze|ToTensor",
    ),
    "convert_before_to_tensor": (
        {},
        lambda: {**pipes(), "vec": [NDArrayDecoder(), Convert(torch.float16), ToTensor()]},
        r"Convert|ToTensor",
    ),
    "tail_op_raises": (
        {},
        lambda: {**pipes(), "label": [IntDecoder(), ToTensor(), Boom()]},
        r"boom",
    ),
}

#: Cases where the backends disagree today: the observed difference, for the lead to fix.
XFAIL: dict[str, str] = {}

#: Cases whose messages are the same text on every backend (the others name the same thing in
#: the backend's own words, e.g. the daemon adds where the refusal came from).
SAME_TEXT = {
    "negative_batch_size",
    "zero_batch_size",
    "float_batch_size",
    "string_batch_size",
    "zero_batches_ahead",
    "negative_seed",
    "huge_seed",
    "index_out_of_range",
    "negative_index",
    "empty_indices",
    "unknown_field",
}


def _case_params() -> list[Any]:
    return [
        pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=XFAIL[c])) if c in XFAIL else c
        for c in sorted(CASES)
    ]


def _run(backend: str, address: str, data: Path, case: str) -> BaseException | None:
    kw, make_pipes, _ = CASES[case]
    kw = {"batch_size": 4, **kw}

    def go() -> None:
        if "order_value" in kw:  # not an order name: pass the raw value through
            args = {k: v for k, v in kw.items() if k != "order_value"}
            _loader_with_raw_order(backend, address, data, kw["order_value"], make_pipes(), args)
            return
        with make_loader(backend, data, make_pipes(), address=address, **kw) as ld:
            next(iter(ld))

    return attempt(go)


def _loader_with_raw_order(
    backend: str, address: str, data: Path, order: Any, pipelines: Any, kw: Any
) -> None:
    if backend == "inproc":
        from beton_serve.loader import Loader

        ld: Any = Loader(str(data), pipelines=pipelines, order=order, num_workers=1, **kw)
    else:
        from beton_client import Loader as ClientLoader

        ld = ClientLoader(
            str(data), pipelines=pipelines, order=order, **serving(address, backend), **kw
        )
    with ld:
        next(iter(ld))


@pytest.mark.parametrize("case", _case_params())
@pytest.mark.parametrize("backend", SERVED)
def test_bad_input_is_refused_alike(
    data: Path, daemon: DaemonProcess, backend: str, case: str
) -> None:
    want = _run("inproc", daemon.address, data, case)
    got = _run(backend, daemon.address, data, case)
    assert_same_error(got, want, CASES[case][2], f"{backend}, {case}")
    if case in SAME_TEXT:
        assert str(got) == str(want), f"{backend}, {case}"


@pytest.mark.parametrize("backend", SERVED)
def test_the_daemon_still_serves_after_bad_requests(
    data: Path, daemon: DaemonProcess, backend: str
) -> None:
    for case in ("unknown_field", "wrong_decoder_for_field", "index_out_of_range"):
        _run(backend, daemon.address, data, case)
    with make_loader(backend, data, pipes(), address=daemon.address, batch_size=4) as ld:
        assert sum(len(b[0]) for b in ld) == N
    assert daemon.proc.poll() is None


#: id -> (arguments of the Loader that saves, of the one that loads, regex for both messages)
STATE_CASES: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {
    "seed": ({"seed": 1}, {"seed": 2}, r"seed"),
    "order": ({"order": "RANDOM"}, {"order": "QUASI_RANDOM"}, r"order"),
    "batch_size": ({"batch_size": 4}, {"batch_size": 5}, r"batch_size"),
    "indices": ({"indices": [1, 2, 3, 4]}, {"indices": [1, 2, 3, 5]}, r"indices"),
    "drop_last": ({"drop_last": True}, {"drop_last": False}, r"drop_last"),
}


@pytest.mark.parametrize("case", sorted(STATE_CASES))
@pytest.mark.parametrize("backend", SERVED)
def test_a_state_from_other_arguments_is_refused_alike(
    data: Path, daemon: DaemonProcess, backend: str, case: str
) -> None:
    saver, loader, pattern = STATE_CASES[case]
    base: dict[str, Any] = {"batch_size": 4, "order": "RANDOM", "seed": 1}
    with make_loader("inproc", data, pipes(), **{**base, **saver}) as ld:
        next(iter(ld))
        state = ld.state_dict()

    def load(b: str) -> None:
        with make_loader(b, data, pipes(), address=daemon.address, **{**base, **loader}) as ld:
            ld.load_state_dict(state)
            next(iter(ld))

    want, got = attempt(lambda: load("inproc")), attempt(lambda: load(backend))
    assert_same_error(got, want, pattern, f"{backend}, state with another {case}")


RANKS = {
    "rank_past_world": ("5", "2", r"rank|world"),
    "world_zero": ("0", "0", r"world"),
    "rank_not_int": ("one", "2", r"RANK|integer"),
}


@pytest.mark.parametrize("case", sorted(RANKS))
@pytest.mark.parametrize("backend", SERVED)
def test_bad_rank_environment_is_refused_alike(
    data: Path, daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch, backend: str, case: str
) -> None:
    rank, world, pattern = RANKS[case]
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)

    def go(b: str) -> None:
        kw: dict[str, Any] = {"batch_size": 4, "distributed": True, "seed": 0}
        with make_loader(b, data, pipes(), address=daemon.address, **kw) as ld:
            next(iter(ld))

    want, got = attempt(lambda: go("inproc")), attempt(lambda: go(backend))
    assert_same_error(got, want, pattern, f"{backend}, RANK={rank} WORLD_SIZE={world}")


# -- ToDevice('cuda') on a host without CUDA ---------------------------------------------------
NO_CUDA = pytest.mark.skipif(
    torch.cuda.is_available(), reason="not applicable: this host has CUDA, so the op is valid"
)


def _cuda_pipes() -> dict[str, Any]:
    return {**pipes(), "label": [IntDecoder(), ToTensor(), ToDevice("cuda:0")]}


def _beton_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("beton-") and t.is_alive()}


def _in_process_cuda_attempt(data: Path) -> tuple[BaseException | None, list[str]]:
    """The in-process Loader's error, and the names of worker threads the failed epoch left
    running (stopped here, so that one known leak does not fail later tests)."""
    from beton_serve.loader import Loader

    before = _beton_threads()
    made: list[Any] = []

    def run() -> None:
        made.append(Loader(str(data), 4, pipelines=_cuda_pipes(), num_workers=1))
        next(iter(made[0]))

    try:
        exc = attempt(run)  # refused when the pipeline is planned (the Loader's constructor)
    finally:
        for ld in made:
            ld.close()
    time.sleep(0.2)
    leaked = sorted(t.name for t in _beton_threads() - before)
    for ld in made:
        engine = getattr(ld._source, "engine", None)
        if leaked and engine is not None:
            engine.close()
    return exc, leaked


def _cuda_params() -> list[Any]:
    return ["shm", "grpc"]


@NO_CUDA
@pytest.mark.parametrize("backend", _cuda_params())
def test_to_device_cuda_without_cuda_is_refused_alike(
    data: Path, daemon: DaemonProcess, backend: str
) -> None:
    want, _ = _in_process_cuda_attempt(data)

    def served() -> None:
        with make_loader(backend, data, _cuda_pipes(), address=daemon.address, batch_size=4) as ld:
            next(iter(ld))

    assert_same_error(attempt(served), want, r"cuda", f"{backend}, ToDevice('cuda:0')")


@NO_CUDA
def test_an_epoch_that_fails_to_start_leaves_no_worker_running(data: Path) -> None:
    exc, leaked = _in_process_cuda_attempt(data)
    assert exc is not None
    assert not leaked, f"worker threads left running: {leaked}"


def _damage(src: Path, dst: Path, how: str) -> Path:
    if how == "missing":
        return dst
    if how == "directory":
        dst.mkdir()
        return dst
    raw = bytearray(src.read_bytes())
    if how == "truncated":
        del raw[len(raw) // 2 :]
    else:  # "bad_magic": not a .beton file at all
        raw[:16] = b"\0" * 16
    dst.write_bytes(bytes(raw))
    return dst


@pytest.mark.parametrize("how", ["truncated", "bad_magic", "missing", "directory"])
@pytest.mark.parametrize("backend", SERVED)
def test_a_damaged_file_is_refused_alike(
    data: Path, daemon: DaemonProcess, tmp_path: Path, backend: str, how: str
) -> None:
    """The daemon opens the damaged copy on demand and refuses it with the in-process Loader's
    error: ``FormatError`` by name (the client's used to be ``DataError``; a corrupt-JPEG fuzz
    trial whose spoilt bytes reached the allocation table found it). A path that is no file
    was "unknown dataset 'x'" (``SpecError``): the daemon looked the stem up as a name."""
    bad = _damage(data, tmp_path / f"{how}.beton", how)

    def go(b: str) -> None:
        with make_loader(b, bad, pipes(), address=daemon.address, batch_size=4) as ld:
            next(iter(ld))

    want, got = attempt(lambda: go("inproc")), attempt(lambda: go(backend))
    pattern = r"No such file|not a regular file" if how in ("missing", "directory") else "offset"
    assert_same_error(got, want, pattern, f"{backend}, {how}")
    assert type(want).__name__ == "FormatError"
    assert daemon.proc.poll() is None


@pytest.mark.parametrize("how", ["missing", "directory"])
def test_a_path_that_is_no_file_is_refused_before_spawning_a_daemon(
    tmp_path: Path, how: str
) -> None:
    """With ``spawn=True`` (the default) the client refuses such a path itself, before any
    daemon is started, with the in-process Loader's error (it was a ``SpecError``)."""
    from beton_client import Loader as ClientLoader
    from beton_client import ServeOptions

    bad = _damage(tmp_path, tmp_path / f"{how}.beton", how)
    sock = tmp_path / "nobody.sock"
    want = attempt(lambda: make_loader("inproc", bad, pipes(), batch_size=4))
    got = attempt(
        lambda: ClientLoader(
            str(bad), 4, pipelines=pipes(), serve=ServeOptions(server=f"unix://{sock}")
        )
    )
    assert_same_error(got, want, r"No such file|not a regular file", how)
    assert not sock.exists()


#: Run in a child that cannot read a mode-000 file: each backend's error for it, as JSON.
_UNREADABLE = """
import json, os, sys
from pathlib import Path
from beton_serve.fields.decoders import IntDecoder, NDArrayDecoder
from beton_serve.transforms import ToTensor
from conformance._backends import SERVED, attempt, make_loader

path, address = Path(sys.argv[1]), sys.argv[2]
try:
    path.read_bytes()
except PermissionError:
    pass
else:
    print(json.dumps({"readable": True}))
    raise SystemExit(0)


def go(backend):
    pipes = {"vec": [NDArrayDecoder(), ToTensor()], "label": [IntDecoder(), ToTensor()]}
    with make_loader(backend, path, pipes, address=address, batch_size=4) as ld:
        next(iter(ld))


out = {}
for backend in ["inproc", *(b for b in SERVED if isinstance(b, str))]:
    exc = attempt(lambda: go(backend))
    out[backend] = None if exc is None else [type(exc).__name__, str(exc)]
print(json.dumps(out))
"""


def _without_root_reads() -> list[str]:
    """The command prefix under which this process's children cannot read a mode-000 file: none
    for another user than root; for root, ``setpriv`` dropping the capabilities that let root
    read any file (skips when that cannot be done here)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: a mode-000 file stays readable")
    return [setpriv, "--bounding-set=-dac_override,-dac_read_search"]


def test_a_file_this_process_may_not_read_is_refused_alike(
    data: Path, daemon: DaemonProcess, tmp_path: Path
) -> None:
    """A ``.beton`` the trainer has no permission to read: every backend raises the in-process
    ``FormatError`` ("cannot open or map the file: [Errno 13] Permission denied"). The served
    Loader raised ``SpecError`` ("dataset file ... cannot be read"), and it must refuse before
    asking the daemon, which may be allowed to read the file (here it is: the daemon runs with
    every capability of root)."""
    bad = tmp_path / "noperm.beton"
    shutil.copyfile(data, bad)
    os.chmod(bad, 0)
    os.chmod(tmp_path, 0o755)  # the child may reach the file, not read it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])}
    run = subprocess.run(
        [*_without_root_reads(), sys.executable, "-c", _UNREADABLE, str(bad), daemon.address],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    if got.get("readable"):
        pytest.skip("this process's children can read a mode-000 file")
    for backend, err in got.items():
        assert err is not None, f"{backend}: an unreadable file was served"
        name, message = err
        assert name == "FormatError", f"{backend}: {name}: {message}"
        assert "cannot open or map the file" in message, f"{backend}: {message}"
        assert "Permission denied" in message, f"{backend}: {message}"
        assert str(bad) in message, f"{backend}: {message}"
    assert set(got) >= {"inproc", "shm", "grpc"}
    assert daemon.proc.poll() is None
