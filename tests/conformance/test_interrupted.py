"""Ctrl-C in a training loop: the epoch goes on with exactly the batches not yet yielded.

A ``KeyboardInterrupt`` that reaches the loop from inside ``next()`` (a notebook user pressing
Ctrl-C while the loop waits for a batch, or while a client-side op runs) used to end the epoch:
continuing the same iterator then stopped after the batches already seen, silently, on every
backend. FFCV's iterator goes on where it was. Now the epoch's feed is dropped and re-opened at
the first batch not yielded, so continuing yields the rest of the epoch, pixel for pixel the
batches an uninterrupted run yields; the next epoch is unchanged too.

The interrupt is injected where it lands in practice, on every backend:

* ``waiting``: before the backend hands over the batch (the wait for it);
* ``consumed``: after the backend handed it over but before it was yielded (the worst case:
  the backend's position has moved past a batch the loop never saw);
* ``tail``: inside a client-side op of the batch (here a torch ``nn.Module``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from beton_serve.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
from beton_serve.transforms import (
    Convert,
    RandomHorizontalFlip,
    Squeeze,
    ToTensor,
    ToTorchImage,
)
from helpers.daemon import DaemonProcess

from conformance._backends import (
    BACKENDS,
    assert_same_batches,
    epoch,
    epochs,
    make_loader,
    module_daemon,
    snap,
)

pytestmark = pytest.mark.slow

BATCH = 8
AT = 2  # the batch whose next() is interrupted


@pytest.fixture(scope="module")
def beton(fixtures_dir: Path) -> Path:
    return fixtures_dir / "images_jpg.beton"


@pytest.fixture(scope="module")
def daemon(beton: Path) -> Iterator[DaemonProcess]:
    with module_daemon([beton]) as d:
        yield d


class Halve(torch.nn.Module):
    """A client-side op: the tail's last step."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / 2


def pipes() -> dict[str, Any]:
    return {
        "image": [
            RandomResizedCropRGBImageDecoder((32, 32)),
            RandomHorizontalFlip(),
            ToTensor(),
            ToTorchImage(),
            Convert(torch.float32),
            Halve(),
        ],
        "label": [IntDecoder(), ToTensor(), Squeeze()],
    }


def _loader(backend: str, beton: Path, daemon: DaemonProcess) -> Any:
    return make_loader(
        backend, beton, pipes(), address=daemon.address, order="RANDOM", seed=7, batch_size=BATCH
    )


def _interrupt_once(monkeypatch: pytest.MonkeyPatch, cls: type, name: str, after: bool) -> None:
    """``cls.name`` raises ``KeyboardInterrupt`` on its next call: before doing its work, or
    (``after``) once its work is done and its result would be returned."""
    real = getattr(cls, name)

    def interrupted(self: Any, *args: Any, **kw: Any) -> Any:
        monkeypatch.setattr(cls, name, real)  # once
        if after:
            real(self, *args, **kw)
        raise KeyboardInterrupt

    monkeypatch.setattr(cls, name, interrupted)


@pytest.mark.parametrize("where", ["waiting", "consumed", "tail"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_interrupted_epoch_goes_on_with_the_batches_not_yet_yielded(
    beton: Path, daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch, backend: str, where: str
) -> None:
    reference = epochs(_loader("inproc", beton, daemon), 2)
    assert len(reference[0]) > AT + 2
    with _loader(backend, beton, daemon) as ld:
        it = iter(ld)
        head = [snap(next(it)) for _ in range(AT)]
        if where == "tail":
            image_tail = ld._tails[0]
            _interrupt_once(monkeypatch, type(image_tail), "__call__", after=False)
        else:
            _interrupt_once(monkeypatch, type(it._epoch_feed), "next", after=where == "consumed")
        with pytest.raises(KeyboardInterrupt):
            next(it)
        state = ld.state_dict()
        assert (state["epoch"], state["batch"]) == (0, AT)  # nothing more was yielded
        rest = epoch(it)
        assert_same_batches(head + rest, reference[0], f"{backend}, interrupted {where}")
        assert_same_batches(epoch(ld), reference[1], f"{backend}: the epoch after it")
        assert (ld.state_dict()["epoch"], ld.state_dict()["batch"]) == (2, 0)


@pytest.mark.parametrize("where", ["before", "after"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_interrupted_iter_takes_no_epoch_and_keeps_the_resume_position(
    beton: Path, daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch, backend: str, where: str
) -> None:
    """Ctrl-C inside ``iter(loader)``, here after a resume: the next ``iter()`` starts the
    same epoch at the same batch. It used to start the epoch after it (the interrupted call
    had taken the epoch and the resume position): the rest of the resumed epoch was skipped,
    silently, and a resumed run then ran one epoch further than the uninterrupted one."""
    from beton_client.frontend import EpochIterator

    reference = epochs(_loader("inproc", beton, daemon), 2)
    with _loader("inproc", beton, daemon) as src:  # a checkpoint in the middle of epoch 0
        it = iter(src)
        for _ in range(AT):
            next(it)
        state = src.state_dict()
    with _loader(backend, beton, daemon) as ld:
        ld.load_state_dict(state)
        if where == "before":  # before the iterator exists
            _interrupt_once(monkeypatch, type(ld), "_split", after=False)
        else:  # the iterator was made; the interrupt comes before iter() returns it
            _interrupt_once(monkeypatch, EpochIterator, "__init__", after=True)
        with pytest.raises(KeyboardInterrupt):
            iter(ld)
        assert ld.state_dict() == state
        assert_same_batches(epoch(ld), reference[0][AT:], f"{backend}: the resumed epoch")
        assert_same_batches(epoch(ld), reference[1], f"{backend}: the epoch after it")


@pytest.mark.parametrize("where", ["consumed", "tail"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_second_ctrl_c_inside_the_first_ones_handling_still_loses_nothing(
    beton: Path, daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch, backend: str, where: str
) -> None:
    """Ctrl-C pressed twice in quick succession: the second interrupt lands while ``next()``
    handles the first, before it could drop the epoch's feed (whose position already moved past
    the batch not yielded). The next call must still re-open at that batch: it used to go on
    with the old feed, skip the batch, and end the epoch one batch short."""
    reference = epochs(_loader("inproc", beton, daemon), 2)
    with _loader(backend, beton, daemon) as ld:
        it = iter(ld)
        head = [snap(next(it)) for _ in range(AT)]
        if where == "tail":
            _interrupt_once(monkeypatch, type(ld._tails[0]), "__call__", after=False)
        else:
            _interrupt_once(monkeypatch, type(it._epoch_feed), "next", after=True)
        _interrupt_once(monkeypatch, type(it), "_interrupted", after=False)
        with pytest.raises(KeyboardInterrupt):
            next(it)
        rest = epoch(it)
        assert_same_batches(head + rest, reference[0], f"{backend}, twice interrupted {where}")
        assert_same_batches(epoch(ld), reference[1], f"{backend}: the epoch after it")


@pytest.mark.parametrize("backend", BACKENDS)
def test_interrupted_twice_in_a_row_and_then_abandoned(
    beton: Path, daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """Ctrl-C twice (the second while nothing was yielded since the first), then a new epoch:
    the interrupted epoch is dropped cleanly and the next one is the reference's next one."""
    reference = epochs(_loader("inproc", beton, daemon), 2)
    with _loader(backend, beton, daemon) as ld:
        it = iter(ld)
        head = [snap(next(it))]
        for after in (True, False):
            cls = type(it._epoch_feed) if it._epoch_feed is not None else None
            if cls is None:  # re-opened lazily by the next next(): interrupt its tail instead
                _interrupt_once(monkeypatch, type(ld._tails[0]), "__call__", after=False)
            else:
                _interrupt_once(monkeypatch, cls, "next", after=after)
            with pytest.raises(KeyboardInterrupt):
                next(it)
        head.append(snap(next(it)))
        assert_same_batches(head, reference[0][:2], f"{backend}: twice interrupted")
        assert_same_batches(epoch(ld), reference[1], f"{backend}: the next epoch")


@pytest.mark.parametrize("backend", ["inproc", "shm", "grpc"])
def test_real_interrupts_at_random_moments_never_lose_or_repeat_a_batch(
    beton: Path, daemon: DaemonProcess, backend: str
) -> None:
    """SIGINT (what Ctrl-C sends) from a timer, 1-4 ms into each ``next()`` of a ``for`` loop
    that is re-entered after every interrupt, as a notebook user re-runs the cell: it lands in
    the wait, in the hand-over or in the tail, wherever it falls.

    The handler raises only while the loop is inside ``next()``: a ``KeyboardInterrupt`` that
    reaches the loop body would be the loop's own business, not the Loader's.

    On gRPC the interrupt lands in the wait for a message too, which the stream's reader thread
    keeps out of grpcio (an interrupt inside grpcio's locks used to leave a lock held and hang
    the next call). Re-opening a gRPC stream (OpenStream, a new call, its first batch) takes
    longer than 4 ms, so there the first interrupt after an interrupted one comes 30-33 ms in:
    otherwise every re-opened stream would be interrupted before its first batch, for ever.
    """
    import signal
    import threading

    inside = [False]
    # A real signal at the main thread, as Ctrl-C sends: it also breaks a blocking wait
    # (EINTR), which ``_thread.interrupt_main`` does not.
    main = threading.main_thread().ident

    def on_sigint(signum: int, frame: Any) -> None:
        if inside[0]:
            raise KeyboardInterrupt

    reference = epochs(_loader("inproc", beton, daemon), 4)
    interrupted = 0
    timers: list[threading.Timer] = []

    def arm(k: int, reopening: bool = False) -> None:
        delay = 0.001 * (1 + k % 4) + (0.03 if reopening and backend == "grpc" else 0.0)
        timer = threading.Timer(delay, signal.pthread_kill, (main, signal.SIGINT))
        timers.append(timer)
        timer.start()
        inside[0] = True

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        with _loader(backend, beton, daemon) as ld:
            for trial in range(4):
                it = iter(ld)
                got: list[Any] = []
                before = interrupted
                while True:
                    try:
                        # Armed inside the try: a signal is delivered at the loop's jumps too,
                        # and one delivered outside the try would end the test run.
                        arm(trial + len(got) + interrupted, reopening=interrupted > before)
                        for batch in it:
                            inside[0] = False
                            got.append(snap(batch))
                            arm(trial + len(got))
                        inside[0] = False
                        break
                    except KeyboardInterrupt:
                        inside[0] = False
                        interrupted += 1
                    assert interrupted < 200, "interrupted without end"
                assert_same_batches(got, reference[trial], f"{backend}, epoch {trial}")
    finally:
        inside[0] = False
        for timer in timers:
            timer.cancel()
            timer.join()
        signal.signal(signal.SIGINT, previous)
    assert interrupted > 0


def _fds() -> set[str]:
    import os

    out = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, gone by now
            out.add(f"{fd} {os.readlink(f'/proc/self/fd/{fd}')}")
    return out


@pytest.mark.parametrize(
    ("backend", "rounds"), [("inproc", 6), ("shm", 3), ("grpc", 3), ("two_daemons", 2)]
)
def test_real_interrupts_anywhere_in_a_checkpoint_and_resume_loop_lose_and_leak_nothing(
    beton: Path, daemon: DaemonProcess, backend: str, rounds: int
) -> None:
    """A training script that checkpoints and resumes, hit by SIGINT at random moments of any
    Loader call (construction, ``load_state_dict``, ``iter``, ``next``, ``state_dict``,
    ``close``), each call re-run when interrupted, as a notebook user re-runs a cell. The
    batches it collects over three epochs are those of one uninterrupted run, and no thread
    or descriptor is left behind.

    Found this way: an interrupted ``iter()`` took the epoch and the resume position (the rest
    of a resumed epoch was skipped, silently); an interrupt while ``iter()`` started the
    workers leaked them with their engine; one inside a gRPC call of a Loader's construction
    left the channel's lock held, and the channel's close hung; one right after a bare
    ``os.open`` leaked the descriptor.

    ``two_daemons``: the multi-daemon Loader (``server=[a, b]``, batches from both, over grpc).
    Every daemon ends with no stream open.
    """

    with contextlib.ExitStack() as stack:
        daemons = [daemon]
        if backend == "two_daemons":
            daemons.append(stack.enter_context(module_daemon([beton])))
        _resume_loop_under_interrupts(beton, daemons, backend, rounds)
    for d in daemons[:1]:  # the second one is stopped already
        deadline = time.monotonic() + 10
        while d.stats().streams and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(d.stats().streams) == []


def _make(backend: str, beton: Path, daemons: list[DaemonProcess]) -> Any:
    if backend != "two_daemons":
        return _loader(backend, beton, daemons[0])
    from beton_client import Loader, OrderOption, ServeOptions

    return Loader(
        str(beton),
        pipelines=pipes(),
        order=OrderOption.RANDOM,
        seed=7,
        batch_size=BATCH,
        serve=ServeOptions(server=[d.address for d in daemons], spawn=False),
    )


def _resume_loop_under_interrupts(
    beton: Path, daemons: list[DaemonProcess], backend: str, rounds: int
) -> None:
    import gc
    import random
    import signal
    import threading

    daemon = daemons[0]
    rng = random.Random(f"{backend}-resume")
    main = threading.main_thread().ident
    inside = [False]
    interrupts: dict[str, int] = {}

    def on_sigint(signum: int, frame: Any) -> None:
        if inside[0]:
            raise KeyboardInterrupt

    def call(what: str, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, re-run until a call is not interrupted (StopIteration passes)."""
        while True:
            delay = rng.choice([0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.004, 0.01, 1.0])
            timer = threading.Timer(delay, signal.pthread_kill, (main, signal.SIGINT))
            try:
                inside[0] = True
                timer.start()
                return fn(*args)
            except KeyboardInterrupt:
                interrupts[what] = interrupts.get(what, 0) + 1
                assert sum(interrupts.values()) < 2000, f"interrupted without end: {interrupts}"
            finally:
                inside[0] = False
                timer.cancel()
                timer.join()

    reference = [b for e in epochs(_loader("inproc", beton, daemon), 3) for b in e]
    per_epoch = len(reference) // 3
    warm = _make(backend, beton, daemons)  # what a first Loader sets up once per process
    epoch(warm)
    warm.close()
    del warm
    gc.collect()
    threads, fds = set(threading.enumerate()), _fds()
    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        for r in range(rounds):
            got: list[Any] = []
            state = None
            while len(got) < len(reference):
                ld = call("Loader()", _make, backend, beton, daemons)
                if state is not None:
                    call("load_state_dict", ld.load_state_dict, state)
                it = call("iter", iter, ld)
                for _ in range(rng.randint(1, per_epoch + 3)):
                    if len(got) == len(reference):
                        break
                    try:
                        got.append(snap(call("next", next, it)))
                    except StopIteration:
                        it = call("iter", iter, ld)
                state = call("state_dict", ld.state_dict)
                call("close", ld.close)
                del ld, it
            assert_same_batches(got, reference, f"{backend}, round {r}, {interrupts}")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert sum(interrupts.values()) > 10
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        gc.collect()
        if set(threading.enumerate()) <= threads and _fds() <= fds:
            break
        time.sleep(0.05)
    assert [t.name for t in set(threading.enumerate()) - threads] == []
    assert sorted(_fds() - fds) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_epoch_that_ends_early_is_an_error_not_a_short_epoch(
    beton: Path, daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    with _loader(backend, beton, daemon) as ld:
        it = iter(ld)
        next(it), next(it)
        cls = type(it._epoch_feed)
        monkeypatch.setattr(cls, "next", lambda self: None)  # a backend that says "the end"
        with pytest.raises(ld._errors.pipeline, match=f"epoch 0 ended after 2 of {len(ld)}"):
            next(it)


def test_sigint_is_held_back_while_a_stream_opens_and_delivered_after() -> None:
    import os
    import signal

    from beton_client.frontend import _sigint_deferred

    before = signal.getsignal(signal.SIGINT)
    steps = []
    with pytest.raises(KeyboardInterrupt):
        with _sigint_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # the handler runs between bytecodes: give it the chance
                steps.append(1)
            steps.append("opened")
    assert steps[-1] == "opened"  # the block ran to its end first
    assert signal.getsignal(signal.SIGINT) is before
    with _sigint_deferred():  # no SIGINT: nothing raised
        steps.append("again")
    assert signal.getsignal(signal.SIGINT) is before
