# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""Exactly-once resume: a daemon SIGKILLed mid-epoch and restarted on the same socket, and a
trainer restarted from ``state_dict()``; a second daemon on a served address is refused."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from beton_client import Loader, OrderOption, RetryPolicy, ServerError, ServerUnavailable
from beton_serve.daemon._streams import MAX_RING_SLOTS
from beton_serve.fields.decoders import (
    IntDecoder,
    NDArrayDecoder,
    RandomResizedCropRGBImageDecoder,
)
from beton_serve.transforms import RandomHorizontalFlip, ToTensor
from helpers.daemon import (  # noqa: F401
    SHM,
    daemon_factory,
    daemons_serving,
    short_tmp,
    start_daemon,
    wait_until_serving,
)
from helpers.labelled import write_labelled, write_pixels

pytestmark = pytest.mark.slow


def _pipelines() -> dict:
    # Random crops and flips: a resumed batch only equals the reference if the daemon
    # reproduces (seed, epoch, sample) exactly.
    return {
        "image": [
            RandomResizedCropRGBImageDecoder((16, 16)),
            RandomHorizontalFlip(0.5),
            ToTensor(),
        ],
        "label": [IntDecoder(), ToTensor()],
        "weight": None,
    }


KW = dict(batch_size=4, order=OrderOption.RANDOM, seed=99, batches_ahead=2, copy=True)


def _loader(address: str, **kw: object) -> Loader:
    args = {**KW, **kw}
    return Loader("images_jpg", pipelines=_pipelines(), server=address, **args)  # type: ignore[arg-type]


def _epoch(ld: Loader) -> list[tuple[torch.Tensor, torch.Tensor, np.ndarray]]:
    out = []
    for image, label in ld:
        out.append((image.clone(), label.clone(), ld.last_sample_ids.copy()))
    return out


def _same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for (xi, xl, xs), (yi, yl, ys) in zip(a, b, strict=True):
        assert np.array_equal(xs, ys)
        assert torch.equal(xl, yl)
        assert torch.equal(xi, yi)


def _restart_and_read_on(
    daemon_factory, beton: Path, d1, ld: Loader, it, got: list
) -> tuple[Any, float]:
    """Start a new daemon on ``d1``'s socket without waiting for it, read the rest of the epoch
    from ``it`` into ``got``; return the new daemon and how long its first batch took (the
    client's next() retries with backoff until the new daemon answers)."""
    d2 = daemon_factory([beton], socket=d1.socket, wait=False)
    t0 = time.monotonic()
    image, label = next(it)
    waited = time.monotonic() - t0
    got.append((image.clone(), label.clone(), ld.last_sample_ids.copy()))
    got.extend((i.clone(), lab.clone(), ld.last_sample_ids.copy()) for i, lab in it)
    assert d2.proc.poll() is None and d2.pid != d1.pid
    return d2, waited


def test_sigkilled_daemon_restarted_on_the_same_socket_resumes_exactly_once(
    daemon_factory, fixtures_dir: Path
) -> None:
    beton = fixtures_dir / "images_jpg.beton"
    d1 = daemon_factory([beton])
    with _loader(d1.address) as ref_ld:
        reference = [_epoch(ref_ld) for _ in range(2)]
    n = len(reference[0])
    assert n == 16
    ids = np.concatenate([s for _, _, s in reference[1]])
    assert sorted(ids.tolist()) == list(range(64))

    ld = _loader(d1.address, reconnect=RetryPolicy(budget_s=60.0, initial_s=0.05, max_s=0.5))
    try:
        first = _epoch(ld)
        it = iter(ld)
        got = []
        for _ in range(5):
            image, label = next(it)
            got.append((image.clone(), label.clone(), ld.last_sample_ids.copy()))
        stale = d1.segments()
        assert stale
        d1.proc.send_signal(signal.SIGKILL)
        d1.proc.wait(10)
        assert os.path.exists(d1.socket)  # the dead daemon's socket file is left behind
        # Its segments are left behind too, but any daemon that starts on this host now (another
        # test's, another user's session) may sweep them first: only their absence once d2
        # serves is checked below, not who removed them.
        # Restart without waiting: the client's next() retries with backoff until it answers.
        d2, waited = _restart_and_read_on(daemon_factory, beton, d1, ld, it, got)
        assert waited > 0.0
        _same(first, reference[0])
        _same(got, reference[1])  # the interrupted epoch equals the uninterrupted one
        seen = np.concatenate([s for _, _, s in got])
        assert len(seen) == 64 and len(set(seen.tolist())) == 64  # no duplicate, no gap
        # Batches the dead daemon had already published (notices in the client's socket buffer,
        # data in the still-mapped ring) are read before the client reconnects, so the new
        # daemon decoded at most the 11 unread batches of this epoch, possibly none.
        wait_until_serving(d2.address, d2.proc, 30)
        decoded = {x.name: x.samples_decoded for x in d2.stats().datasets}["images_jpg"]
        assert 0 <= decoded <= 4 * (n - 5)
        assert not any((SHM / s).exists() for s in stale)  # swept, by d2 or another daemon
        # The next epoch runs on the new daemon as usual.
        assert len(_epoch(ld)) == n
        decoded_after = {x.name: x.samples_decoded for x in d2.stats().datasets}["images_jpg"]
        assert decoded_after - decoded == 4 * n
    finally:
        ld.close()


def _by_name(address: str, pipes: dict, transport: str = "auto") -> Loader:
    """``Loader("train")``, SEQUENTIAL batches of 8, reconnecting after a daemon dies."""
    return Loader(
        "train",
        batch_size=8,
        order=OrderOption.SEQUENTIAL,
        pipelines=pipes,
        server=address,
        transport=transport,
        batches_ahead=1,
        copy=True,
        reconnect=RetryPolicy(budget_s=60.0, initial_s=0.05, max_s=0.5),
    )


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["auto", "grpc"])
def test_a_daemon_restarted_with_another_file_of_the_same_name_is_refused(
    daemon_factory, short_tmp: Path, transport: str
) -> None:
    """``Loader("train")`` (by name), the daemon killed and restarted on another
    ``train.beton`` of the same size and schema: the Loader reconnected and went on reading
    the other file's samples in the same epoch, with no word. It now raises ``ServerError``;
    the batches it yielded are all the first file's."""
    a = write_labelled(short_tmp / "a" / "train.beton", 256, base=0)
    b = write_labelled(short_tmp / "b" / "train.beton", 256, base=10_000)
    d1 = daemon_factory([a])
    ld = _by_name(d1.address, {"vec": None, "label": [IntDecoder(), ToTensor()]}, transport)
    try:
        it = iter(ld)
        labels = [next(it)[0].reshape(-1).tolist() for _ in range(3)]
        assert labels == [list(range(i * 8, i * 8 + 8)) for i in range(3)]
        d1.proc.send_signal(signal.SIGKILL)
        d1.proc.wait(10)
        daemon_factory([b], socket=d1.socket)
        with pytest.raises(ServerError, match=r"now serves other files as 'train'"):
            for (label,) in it:
                assert int(label.max()) < 10_000  # published by d1 before it died
        with pytest.raises(ServerError, match="other files"):
            next(iter(ld))  # nor at the next epoch
    finally:
        ld.close()
    # The same file under the same name (a plain restart) still resumes: test above.


@pytest.mark.timeout(180)
def test_a_daemon_restarted_on_pixels_regenerated_between_the_files_ends_is_refused(
    daemon_factory, short_tmp: Path
) -> None:
    """As above, but the other ``train.beton`` is the same dataset with its raw pixels
    regenerated: same sizes, labels and order, and the same first and last 64 KiB. The dataset
    digest hashed only those, so the Loader went on with the new pixels at the old position."""
    old = write_pixels(short_tmp / "a" / "train.beton", 256)
    new = write_pixels(short_tmp / "b" / "train.beton", 256, shift=7, changed=range(40, 216))
    d1 = daemon_factory([old])
    pipes = {"pixels": [NDArrayDecoder(), ToTensor()], "label": [IntDecoder(), ToTensor()]}
    ld = _by_name(d1.address, pipes)
    try:
        it = iter(ld)
        for _ in range(3):
            pixels, label = next(it)
            assert torch.equal(pixels[:, 0].long(), label.reshape(-1).long() % 251)
        d1.proc.send_signal(signal.SIGKILL)
        d1.proc.wait(10)
        daemon_factory([new], socket=d1.socket)
        with pytest.raises(ServerError, match=r"now serves other files as 'train'"):
            for pixels, label in it:
                # published by d1 before it died: the old file's pixels
                assert torch.equal(pixels[:, 0].long(), label.reshape(-1).long() % 251)
    finally:
        ld.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["auto", "grpc"])
def test_a_daemon_restarted_with_sigterm_resumes_clients_that_allow_it_exactly_once(
    daemon_factory, fixtures_dir: Path, transport: str
) -> None:
    """An operator's restart (SIGTERM, then a new daemon on the same socket): a client with
    ``RetryPolicy(after_shutdown=True)`` resumes at the batch it had reached and its epoch equals
    the uninterrupted one bit for bit; a client with the default policy stops with
    ``ServerUnavailable`` naming the shutdown instead of waiting for a daemon that was stopped on
    purpose (issue 14: clients of a restarted daemon resume; bench_startup's client-resume row)."""
    beton = fixtures_dir / "images_jpg.beton"
    d1 = daemon_factory([beton])
    with _loader(d1.address) as ref_ld:
        reference = _epoch(ref_ld)
    policy = RetryPolicy(budget_s=60.0, initial_s=0.05, max_s=0.5, after_shutdown=True)
    ld = _loader(d1.address, reconnect=policy, transport=transport)
    strict = _loader(d1.address, reconnect=RetryPolicy(budget_s=60.0), transport=transport)
    try:
        it = iter(ld)
        got = []
        for _ in range(5):
            image, label = next(it)
            got.append((image.clone(), label.clone(), ld.last_sample_ids.copy()))
        it_strict = iter(strict)
        next(it_strict)
        d1.proc.send_signal(signal.SIGTERM)
        assert d1.proc.wait(30) == 0  # a clean drain
        with pytest.raises(ServerUnavailable) as stopped:
            for _ in it_strict:  # what was already published may still be read first
                pass
            # The daemon may have published the rest of this small epoch before the signal
            # (its ring holds all 16 batches): then the next epoch's start is what fails.
            for _ in range(2):
                for _ in strict:
                    pass
        assert stopped.value.server_error == "ShuttingDown", stopped.value
        _, waited = _restart_and_read_on(daemon_factory, beton, d1, ld, it, got)
        assert waited < 30
        _same(got, reference)
        seen = np.concatenate([s for _, _, s in got])
        assert len(seen) == 64 and len(set(seen.tolist())) == 64  # no duplicate, no gap
    finally:
        ld.close()
        strict.close()


def test_state_dict_resumes_across_a_trainer_restart(daemon_factory, fixtures_dir: Path) -> None:
    d = daemon_factory([fixtures_dir / "images_jpg.beton"])
    with _loader(d.address) as ref_ld:
        reference = [_epoch(ref_ld) for _ in range(2)]
    a = _loader(d.address)
    try:
        _epoch(a)
        it = iter(a)
        part = []
        for _ in range(6):
            image, label = next(it)
            part.append((image.clone(), label.clone(), a.last_sample_ids.copy()))
        state = a.state_dict()
        assert (state["epoch"], state["batch"], state["seed"], state["len"]) == (1, 6, 99, 16)
    finally:
        a.close()
    b = _loader(d.address)
    try:
        b.load_state_dict(state)
        rest = _epoch(b)
        _same(part + rest, reference[1])
        assert b.state_dict()["epoch"] == 2 and b.state_dict()["batch"] == 0
        with pytest.raises(Exception, match="seed"):
            _loader(d.address, seed=1).load_state_dict(state)
    finally:
        b.close()


def test_budget_spent_raises_server_unavailable(daemon_factory, fixtures_dir: Path) -> None:
    d = daemon_factory([fixtures_dir / "images_jpg.beton"])
    # 64 batches of one sample: more than the daemon's ring (16 slots) can hold ahead, so the
    # epoch cannot end before the daemon is found gone. With the file's 16 batches of 4, the
    # daemon could publish the whole epoch before the SIGKILL landed (seen once in CI).
    ld = _loader(
        d.address, batch_size=1, reconnect=RetryPolicy(budget_s=1.0, initial_s=0.05, max_s=0.2)
    )
    try:
        it = iter(ld)
        next(it)
        assert len(ld) > MAX_RING_SLOTS + 1
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait(10)
        t0 = time.monotonic()
        with pytest.raises(ServerUnavailable, match="gave up after"):
            for _ in it:
                pass
        assert time.monotonic() - t0 < 10
    finally:
        ld.close()


def test_a_second_daemon_on_a_served_socket_is_refused(short_tmp: Path, fixtures_dir: Path) -> None:
    beton = fixtures_dir / "mixed_fields.beton"
    d1 = start_daemon([beton], short_tmp)
    try:
        d2 = start_daemon([beton], short_tmp, socket=d1.socket, wait=False)
        try:
            rc = d2.proc.wait(60)
        finally:
            d2.stop(signal.SIGKILL)
        assert rc == 75  # beton_wire.address.ADDRESS_IN_USE_STATUS: a spawner waits for d1
        assert "lock" in d2.log().lower() or "already" in d2.log().lower(), d2.log()
        assert d1.proc.poll() is None  # the first one still serves
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from beton_client import Loader; "
                "from beton_serve.fields.decoders import IntDecoder; "
                "p={'int':[IntDecoder()],'float':None,'array':None,'blob':None,'meta':None}; "
                "ld=Loader(sys.argv[1], batch_size=10, pipelines=p, server=sys.argv[2]); "
                "print(sum(len(b[0]) for b in ld)); ld.close()",
                str(beton),
                d1.address,
            ],
            capture_output=True,
            timeout=60,
        )
        # Auto-spawn against a served socket attaches to the running daemon, spawning none.
        assert out.returncode == 0, out.stderr.decode()[-2000:]
        assert out.stdout.strip() == b"50"
    finally:
        d1.stop()


def _lock_pid(sock: str) -> int:
    return int(Path(sock + ".lock").read_text().split()[0])


def _stop_child(pid: int) -> None:
    """SIGTERM an auto-spawned daemon (a child of this process) and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def test_an_auto_spawned_daemon_killed_mid_epoch_is_spawned_again(
    short_tmp: Path, fixtures_dir: Path
) -> None:
    from beton_serve.loader import Loader as InProcessLoader
    from beton_serve.loader import OrderOption as InProcessOrder

    beton = str(fixtures_dir / "images_jpg.beton")
    sock = str(short_tmp / "auto.sock")
    # The reference is the in-process Loader (served batches equal it bit for bit).
    local = InProcessLoader(
        beton,
        batch_size=4,
        order=InProcessOrder.RANDOM,
        seed=99,
        pipelines=_pipelines(),
        num_workers=1,
    )
    try:
        # Two epochs: the rest of the first may already sit in the client's ring when the
        # daemon dies, but the second needs a daemon, so the client must spawn a new one.
        reference = [(i.clone(), lab.clone()) for _ in range(2) for i, lab in local]
    finally:
        local.close()
    pids: list[int] = []
    ld = Loader(beton, pipelines=_pipelines(), server="unix://" + sock, **KW)  # type: ignore[arg-type]
    try:
        pids.append(_lock_pid(sock))
        it = iter(ld)
        got = []
        for _ in range(3):
            image, label = next(it)
            got.append((image.clone(), label.clone()))
        os.kill(pids[0], signal.SIGKILL)
        os.waitpid(pids[0], 0)
        got.extend((i.clone(), lab.clone()) for i, lab in it)
        got.extend((i.clone(), lab.clone()) for i, lab in ld)
        pids.append(_lock_pid(sock))
        assert pids[1] != pids[0]  # a new daemon was spawned by the reconnecting client
        assert len(got) == len(reference) == 32
        for (xi, xl), (yi, yl) in zip(got, reference, strict=True):
            assert torch.equal(xl, yl) and torch.equal(xi, yi)
    finally:
        ld.close()
        for pid in pids[1:]:
            _stop_child(pid)


def test_auto_spawn_racing_a_manual_start_leaves_one_daemon(
    short_tmp: Path, fixtures_dir: Path
) -> None:
    beton = str(fixtures_dir / "mixed_fields.beton")
    sock = str(short_tmp / "race.sock")
    client = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from beton_client import Loader; "
            "from beton_serve.fields.decoders import IntDecoder; "
            "p={'int':[IntDecoder()],'float':None,'array':None,'blob':None,'meta':None}; "
            "ld=Loader(sys.argv[1], batch_size=10, pipelines=p, server=sys.argv[2]); "
            "print(sum(len(b[0]) for b in ld)); ld.close()",
            beton,
            "unix://" + sock,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    manual = start_daemon([beton], short_tmp, socket=sock, wait=False)
    try:
        out, err = client.communicate(timeout=90)
        assert client.returncode == 0, err.decode()[-2000:]
        assert out.strip() == b"50"
        alive = daemons_serving(sock)
        assert len(alive) == 1, alive  # one of the two won the lock, the other exited
        assert alive == [_lock_pid(sock)]
        if manual.proc.poll() is not None:  # the auto-spawned one won
            assert manual.proc.returncode != 0 and "already serves" in manual.log()
    finally:
        if client.poll() is None:
            client.kill()
            client.wait(10)
        manual.stop()
        for pid in daemons_serving(sock):  # an auto-spawned winner is not our child
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while daemons_serving(sock) and time.monotonic() < deadline:
            time.sleep(0.1)
    assert not daemons_serving(sock)


def test_sigkilled_daemon_restarted_resumes_a_grpc_stream_exactly_once(
    daemon_factory, fixtures_dir: Path
) -> None:
    """The front end's reconnection is the same for every backend: a grpc stream whose daemon is
    SIGKILLed mid-epoch re-opens on the restarted daemon and resumes at the batch it had reached."""
    from helpers.daemon import free_port

    beton = fixtures_dir / "images_jpg.beton"
    port = free_port()
    listen = ["--listen", f"127.0.0.1:{port}"]
    d1 = daemon_factory([beton], args=listen)
    target = f"127.0.0.1:{port}"
    with _loader(target, transport="grpc") as ref_ld:
        reference = [_epoch(ref_ld) for _ in range(2)]
    ld = _loader(
        target, transport="grpc", reconnect=RetryPolicy(budget_s=60.0, initial_s=0.05, max_s=0.5)
    )
    try:
        _same(_epoch(ld), reference[0])
        it = iter(ld)
        got = []
        for _ in range(5):
            image, label = next(it)
            got.append((image.clone(), label.clone(), ld.last_sample_ids.copy()))
        d1.proc.send_signal(signal.SIGKILL)
        d1.proc.wait(10)
        d2 = daemon_factory([beton], socket=d1.socket, args=listen, wait=False)
        got.extend((i.clone(), lab.clone(), ld.last_sample_ids.copy()) for i, lab in it)
        assert d2.proc.poll() is None and d2.pid != d1.pid
        _same(got, reference[1])  # no batch lost or repeated, every pixel as uninterrupted
        assert ld.chosen_transport == "grpc"
    finally:
        ld.close()
