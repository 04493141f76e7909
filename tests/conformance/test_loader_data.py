"""Conformance: orders, distributed, drop_last, indices, seeds, epochs, resume and Loader options
behave the same, bit for bit, on every backend (issue 12 §3, issue 13 §3).

The dataset is :mod:`helpers.labelled`'s: sample ``i`` has ``vec == label == BASE + i``, so the
sample ids a backend delivered are read off its labels, and a wrong sample cannot pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from beton_serve.fields.decoders import IntDecoder, NDArrayDecoder
from beton_serve.pipeline import PipelineSpec
from beton_serve.transforms import Convert, Squeeze, ToTensor
from beton_wire.limits import MAX_EPOCH
from helpers.daemon import DaemonProcess
from helpers.labelled import write_labelled

from conformance._backends import (
    BACKENDS,
    SERVED,
    assert_same_batches,
    assert_same_epochs,
    column,
    epoch,
    epochs,
    make_loader,
    module_daemon,
    serving,
    snap,
)

pytestmark = pytest.mark.slow

N, BASE = 37, 1000
ORDERS = ["SEQUENTIAL", "RANDOM", "QUASI_RANDOM"]
SUBSET = [5, 3, 11, 2, 8, 13, 1, 21, 34, 0, 17, 9, 4, 30]
DUPLICATES = [1, 1, 2, 3, 3, 3, 36, 0, 36, 7, 7]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_labelled(tmp_path_factory.mktemp("conf-data") / "labelled.beton", N, BASE)


@pytest.fixture(scope="module")
def daemon(data: Path) -> Iterator[DaemonProcess]:
    with module_daemon([data]) as d:
        yield d


def pipes() -> dict[str, Any]:
    return {"vec": [NDArrayDecoder(), ToTensor()], "label": [IntDecoder(), ToTensor()]}


def ids(batches: list) -> list[int]:
    """The sample ids of snapshotted batches (from their labels, output 1)."""
    return [int(x) - BASE for x in column(batches, 1).reshape(-1)]


class Case:
    """A Loader configuration, built on any backend, with its in-process reference."""

    def __init__(self, data: Path, daemon: DaemonProcess, **kw: Any) -> None:
        self.data, self.address, self.kw = data, daemon.address, kw

    def loader(self, backend: str, **extra: Any) -> Any:
        kw = {"batch_size": 5, **self.kw, **extra}
        return make_loader(backend, self.data, pipes(), address=self.address, **kw)

    def run(self, backend: str, n_epochs: int, **extra: Any) -> list[list]:
        with self.loader(backend, **extra) as ld:
            return epochs(ld, n_epochs)

    def check(self, backend: str, n_epochs: int = 2, **extra: Any) -> list[list]:
        """``n_epochs`` on ``backend``, asserted equal to in-process; returns them."""
        want = self.run("inproc", n_epochs, **extra)
        got = self.run(backend, n_epochs, **extra)
        assert_same_epochs(got, want, f"{backend} vs in-process")
        return got


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_orders_and_drop_last(
    data: Path, daemon: DaemonProcess, backend: str, order: str, drop_last: bool
) -> None:
    got = Case(data, daemon, order=order, seed=11, drop_last=drop_last).check(backend, 3)
    n_batches = N // 5 if drop_last else -(-N // 5)
    for e, batches in enumerate(got):
        assert len(batches) == n_batches
        seen = ids(batches)
        assert len(seen) == (n_batches * 5 if drop_last else N)
        assert len(set(seen)) == len(seen)
        if order == "SEQUENTIAL":
            assert seen == list(range(len(seen))), f"epoch {e}"
        elif not drop_last:
            assert sorted(seen) == list(range(N))
    if order != "SEQUENTIAL":
        assert ids(got[0]) != ids(got[1]), "a random order repeats itself across epochs"


@pytest.mark.parametrize("order", ["RANDOM", "QUASI_RANDOM"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_seeds(data: Path, daemon: DaemonProcess, backend: str, order: str) -> None:
    runs = {}
    for seed in (0, 12345, 2**63 + 5):
        runs[seed] = Case(data, daemon, order=order, seed=seed, drop_last=False).check(backend, 1)
    orders = {seed: tuple(ids(r[0])) for seed, r in runs.items()}
    assert len(set(orders.values())) == 3, "different seeds gave the same order"


INDICES: dict[str, Any] = {
    "subset": SUBSET,
    "dups": DUPLICATES,
    "numpy_uint32": np.array(DUPLICATES, np.uint32),
}


@pytest.mark.parametrize(
    ("order", "kind"),
    [(o, k) for o in ORDERS for k in ("subset", "dups")] + [("RANDOM", "numpy_uint32")],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_indices(data: Path, daemon: DaemonProcess, backend: str, order: str, kind: str) -> None:
    indices = INDICES[kind]
    got = Case(data, daemon, order=order, seed=3, indices=indices, drop_last=False).check(
        backend, 2
    )
    for batches in got:
        seen = ids(batches)
        if order == "SEQUENTIAL":
            assert seen == list(indices)
        else:
            assert sorted(seen) == sorted(int(i) for i in indices)


@pytest.mark.parametrize(("world", "drop_last"), [(2, False), (3, True)])
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_distributed_ranks(
    data: Path,
    daemon: DaemonProcess,
    monkeypatch: pytest.MonkeyPatch,
    backend: str,
    order: str,
    world: int,
    drop_last: bool,
) -> None:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    per_rank = []
    for rank in range(world):
        monkeypatch.setenv("RANK", str(rank))
        case = Case(data, daemon, order=order, seed=5, distributed=True, drop_last=drop_last)
        per_rank.append(case.check(backend, 2))
    for e in range(2):
        seen = [ids(r[e]) for r in per_rank]
        assert len({len(s) for s in seen}) == 1, "ranks got different numbers of samples"
        if not drop_last:
            assert set().union(*map(set, seen)) == set(range(N)), f"epoch {e}: samples missed"


@pytest.mark.parametrize("backend", BACKENDS)
def test_distributed_with_indices(
    data: Path, daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    seen = []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        case = Case(data, daemon, order="RANDOM", seed=1, distributed=True, indices=SUBSET)
        seen.append(ids(case.check(backend, 1, drop_last=False)[0]))
    assert set(seen[0]) | set(seen[1]) == set(SUBSET)


@pytest.mark.parametrize("ahead", [1, 7])
@pytest.mark.parametrize("backend", BACKENDS)
def test_batches_ahead(data: Path, daemon: DaemonProcess, backend: str, ahead: int) -> None:
    Case(data, daemon, order="RANDOM", seed=2, batches_ahead=ahead).check(backend, 2)


@pytest.mark.parametrize("os_cache", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_os_cache(data: Path, daemon: DaemonProcess, backend: str, os_cache: bool) -> None:
    Case(data, daemon, order="QUASI_RANDOM", seed=2, os_cache=os_cache).check(backend, 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_recompile(data: Path, daemon: DaemonProcess, backend: str) -> None:
    Case(data, daemon, order="RANDOM", seed=4, recompile=True).check(backend, 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_len_and_epochs_without_iterating(data: Path, daemon: DaemonProcess, backend: str) -> None:
    case = Case(data, daemon, order="RANDOM", seed=8, drop_last=False)
    with case.loader("inproc") as ref, case.loader(backend) as ld:
        assert len(ld) == len(ref) == -(-N // 5)
        # an iterator abandoned after one batch still ends its epoch: the next one is epoch 1
        want = [epoch(ref, 1), epoch(ref)]
        got = [epoch(ld, 1), epoch(ld)]
    assert_same_epochs(got, want, f"{backend} vs in-process")


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_iterator_stopped_by_the_next_epoch_says_so(
    data: Path, daemon: DaemonProcess, backend: str
) -> None:
    """``iter()`` while an epoch is part-way ends that epoch's iterator. Asking it for another
    batch raised ``StopIteration``, so a loop over it (another thread's, a forgotten one) lost
    the rest of its epoch without a word; now it raises ``RuntimeError`` naming both epochs.
    An iterator that finished its epoch still only stops."""
    case = Case(data, daemon, order="RANDOM", seed=8, drop_last=False)
    with case.loader("inproc") as ref, case.loader(backend) as ld:
        want = [epoch(ref, 2), epoch(ref), epoch(ref)]
        it0 = iter(ld)
        got = [epoch(it0, 2)]
        it1 = iter(ld)
        with pytest.raises(
            RuntimeError,
            match="epoch 0 stopped after 2 of its 8 batches, when "
            "iter\\(\\) on its Loader started epoch 1",
        ):
            next(it0)
        got.append(epoch(it1))
        it2 = iter(ld)
        with pytest.raises(StopIteration):
            next(it1)  # finished its epoch before epoch 2 started
        got.append(epoch(it2))
    assert_same_epochs(got, want, f"{backend} vs in-process")


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_epoch_cut_short_by_close_says_so(
    data: Path, daemon: DaemonProcess, backend: str
) -> None:
    """``close()`` part-way through an epoch: the iterator's next ``next()`` raised
    ``StopIteration``, so a loop over it ended its epoch early without a word (and went on to
    save a checkpoint, say). Now it raises the Loader's closed error, naming how far it got.
    An iterator whose epoch was whole before the close just stops. What was yielded is the
    in-process Loader's data."""
    case = Case(data, daemon, order="RANDOM", seed=4, drop_last=False)
    with case.loader("inproc") as ref:
        want = [epoch(ref), epoch(ref, 3)]
    ld = case.loader(backend)
    got = [epoch(ld)]
    done = iter(ld)  # a whole epoch, read before the close
    got.append(epoch(done, 3))
    ld.close()
    with pytest.raises(
        Exception, match="epoch 1 stopped after 3 of its 8 batches, when its Loader was closed"
    ) as info:
        next(done)
    assert type(info.value).__name__ in ("BetonError", "BetonClientError"), info.value
    with pytest.raises(type(info.value), match="stopped after 3 of its 8"):  # and again
        next(done)
    assert_same_epochs(got, want, f"{backend} vs in-process")

    ld = case.loader(backend)
    whole = iter(ld)
    assert len(epoch(whole)) == 8
    ld.close()
    with pytest.raises(StopIteration):  # its epoch was complete: nothing was lost
        next(whole)


def _fails_on_batch_3(x: Any) -> Any:
    """A tail op failing on batch 3 of a SEQUENTIAL epoch of batch size 5 (labels 1015..1019)."""
    if int(x.min()) == BASE + 15:
        raise ValueError("no batch 3 today")
    return x


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_epoch_ended_by_a_failed_batch_says_so_again(
    data: Path, daemon: DaemonProcess, backend: str
) -> None:
    """A batch failed, and a loop that caught the error called ``next()`` again: it got
    ``StopIteration`` and took an epoch of 3 batches out of 8 for a whole one. Now each later
    ``next()`` raises the Loader's pipeline error, naming the batch and the cause."""
    pipelines = {"vec": None, "label": [IntDecoder(), ToTensor(), _fails_on_batch_3]}
    kw = {"batch_size": 5, "order": "SEQUENTIAL", "drop_last": False}
    with make_loader(backend, data, pipelines, address=daemon.address, **kw) as ld:
        it = iter(ld)
        got = [int(next(it)[0].min()) for _ in range(3)]
        assert got == [BASE, BASE + 5, BASE + 10]
        with pytest.raises(Exception, match="no batch 3 today") as first:
            next(it)
        assert type(first.value).__name__ == "PipelineError", first.value
        for _ in range(2):
            with pytest.raises(
                type(first.value),
                match=r"epoch 0 stopped after 3 of its 8 batches, when batch 3 failed "
                r"\(PipelineError: .*ValueError: no batch 3 today\); iterate the Loader again",
            ):
                next(it)


@pytest.mark.parametrize("backend", BACKENDS)
def test_next_epoch_is_checked_and_the_last_epochs_match_in_process(
    data: Path, daemon: DaemonProcess, backend: str
) -> None:
    """``next_epoch`` (an attribute FFCV scripts set to resume) and a state's epoch run up to
    ``MAX_EPOCH``; the last two epochs are the in-process Loader's, bit for bit (the order's
    seed is ``seed + epoch``). Beyond it, or not an int, ``iter()`` refuses with a spec error
    and leaves the Loader usable; from 2**63 on a served Loader used to get an "internal
    error" (the daemon's 64-bit arithmetic overflowed) and past 2**64 a bare ``ValueError``."""
    case = Case(data, daemon, order="RANDOM", seed=2**64 - 3, drop_last=False)
    with case.loader("inproc") as ref:
        ref.next_epoch = MAX_EPOCH - 1
        want = epochs(ref, 2)
    with case.loader(backend) as ld:
        state = ld.state_dict()
        ld.load_state_dict({**state, "epoch": MAX_EPOCH - 1})
        got = epochs(ld, 2)
        assert ld.next_epoch == MAX_EPOCH + 1
        for bad in (MAX_EPOCH + 1, 2**63, 2**64, -1, "3", 1.0, True, None):
            ld.next_epoch = bad
            with pytest.raises(
                Exception, match=r"next_epoch must be an int in 0\.\.4294967295"
            ) as info:
                iter(ld)
            assert type(info.value).__name__ == "SpecError", info.value
        with pytest.raises(Exception, match="past the last epoch a Loader starts"):
            ld.load_state_dict({**state, "epoch": MAX_EPOCH + 1})
        ld.next_epoch = np.int64(MAX_EPOCH)  # a numpy int is an int
        got.append(epoch(ld))
    assert_same_epochs(got, [*want, want[1]], f"{backend} vs in-process")
    assert ids(got[0]) != ids(got[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_epoch_read_again_on_the_same_stream_is_the_in_process_one(
    data: Path, daemon: DaemonProcess, backend: str
) -> None:
    """The same epoch read again and again on one open Loader (``next_epoch`` set back, as a
    script that re-runs a validation epoch or resumes does), each time bit for bit the
    in-process Loader's. Served over shm it delivered other batches' rows in about half the
    runs of the test above: a slot's release word still held the token the client stored when
    it released the same batch of the same epoch in that slot the time before, the daemon
    armed the same token for the new lease, took the stale word for a release, and decoded
    the next batch into the slot the client was about to read."""
    case = Case(data, daemon, order="RANDOM", seed=5, batch_size=4)
    with case.loader("inproc") as ref:
        ref.next_epoch = 3
        want = epoch(ref)
    with case.loader(backend) as ld:
        for _ in range(8):
            ld.next_epoch = 3
            assert_same_batches(epoch(ld), want, f"{backend}, epoch 3 again")


def test_identical_loaders_reading_epochs_again_at_once_get_the_in_process_batches(
    data: Path, daemon: DaemonProcess
) -> None:
    """Three identical served Loaders at once (two shm, one grpc: one sharing group on the
    daemon), each reading epochs 3 and 4 again and again in its own order, every batch bit for
    bit the in-process Loader's: epochs read again meet sharing groups and the rings' release
    words together."""
    import threading

    case = Case(data, daemon, order="RANDOM", seed=5, batch_size=4)
    want = {}
    with case.loader("inproc") as ref:
        for e in (3, 4):
            ref.next_epoch = e
            want[e] = epoch(ref)
    errors: list[BaseException] = []

    def read(i: int, backend: str) -> None:
        try:
            with case.loader(backend) as ld:
                for r in range(10):
                    e = 3 if (r + i) % 3 else 4
                    ld.next_epoch = e
                    assert_same_batches(epoch(ld), want[e], f"{backend} #{i}, round {r}, epoch {e}")
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=read, args=(i, b)) for i, b in enumerate(["shm", "shm", "grpc"])
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_loader_and_its_iterator_refuse_pickle_and_copy(
    data: Path, daemon: DaemonProcess, backend: str
) -> None:
    """A Loader owns worker threads or a daemon's stream. ``copy.copy`` made a second Loader on
    the same ones (closing either closed both); ``pickle`` and ``deepcopy`` failed on an
    internal object ("cannot pickle 'mappingproxy'", "no default __reduce__"). Each now raises
    a ``TypeError`` that says what to do, and the Loader goes on untouched."""
    import copy
    import pickle

    case = Case(data, daemon, order="RANDOM", seed=3, drop_last=False)
    with case.loader("inproc") as ref:
        want = epochs(ref, 1)
    with case.loader(backend) as ld:
        it = iter(ld)
        got = [epoch(it, 2)]
        for obj, what in ((ld, "a Loader"), (it, "an epoch iterator")):
            for fn in (pickle.dumps, copy.copy, copy.deepcopy):
                with pytest.raises(
                    TypeError,
                    match=f"^{what} cannot be pickled or copied: .* Build a Loader in each process",
                ):
                    fn(obj)
        got[0] += epoch(it)
    assert_same_epochs(got, want, f"{backend} vs in-process")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_one_loader_iterated_from_two_threads_errors_and_never_mixes_batches(
    data: Path, daemon: DaemonProcess, backend: str
) -> None:
    """Two threads loop over one Loader at once (each calls ``iter()``). A Loader serves one
    ``iter()`` or ``next()`` at a time: the other thread's call raises ``RuntimeError``, and the
    epoch that one thread stopped raises it there too. What was yielded is the right data. On
    shm the losing thread had got ``TransportError('no sample ids for slot 0 ...')`` or a
    silently short epoch.

    The Loader copies each batch inside ``next()`` (``copy=True``): a zero-copy batch is valid
    until the Loader's next ``iter()``, from whichever thread, and the other thread's ``iter()``
    could come while this one still read its epoch's last batch, which the new epoch then
    overwrote (a CI run of session 35 failed so, on shm: 1 run in many; what ``copy=False``
    promises is in ``test_a_batch_is_overwritten_only_after_the_loaders_next_iter``)."""
    import threading

    case = Case(data, daemon, order="RANDOM", seed=8, drop_last=False)
    with case.loader("inproc") as ref:
        want = epochs(ref, 2 * 20)
    errors: list[BaseException] = []
    got: dict[int, list] = {}
    with case.loader(backend, copy=True) as ld:
        for _round in range(20):
            out: dict[int, Any] = {}

            def loop(k: int, ld: Any = ld, out: dict[int, Any] = out) -> None:
                try:
                    it = iter(ld)
                    out[k] = (it.epoch, epoch(it))
                except RuntimeError as exc:
                    out[k] = exc

            threads = [threading.Thread(target=loop, args=(k,)) for k in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not any(t.is_alive() for t in threads)
            for res in out.values():
                if isinstance(res, RuntimeError):
                    assert "in use by another thread" in str(res) or "started epoch" in str(res)
                    errors.append(res)
                else:
                    e, batches = res
                    got[e] = batches
            assert len(out) == 2
    assert errors  # the threads did collide
    assert got  # and some epochs were read whole
    for e, batches in got.items():
        assert_same_batches(batches, want[e], f"{backend}, epoch {e} read by one of two threads")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batch_is_overwritten_only_after_the_loaders_next_iter(
    data: Path, daemon: DaemonProcess, backend: str
) -> None:
    """A zero-copy batch stays as yielded until the Loader is asked for more: its iterator's
    next ``next()``, or the Loader's next ``iter()``, whichever thread calls it. The last batch
    of an epoch, not asked past, keeps its data while the backend prepares ahead; once the next
    epoch starts, its buffers may be reused. With ``copy=True`` a batch is the caller's for
    good, the next epoch read whole included."""
    import time

    case = Case(data, daemon, order="RANDOM", seed=8, drop_last=False)
    with case.loader("inproc") as ref:
        want = epochs(ref, 2)
    for copy in (False, True):
        with case.loader(backend, copy=copy) as ld:
            it = iter(ld)
            held = [next(it) for _ in range(len(ld))]
            time.sleep(0.2)  # the daemon decodes ahead meanwhile (the next epoch's batches)
            what = f"{backend}, copy={copy}"
            assert_same_batches([snap(held[-1])], [want[0][-1]], f"{what}: the last batch, held")
            assert_same_epochs([epoch(iter(ld))], [want[1]], f"{what}: the next epoch")
            if copy:
                assert_same_batches(
                    [snap(b) for b in held], want[0], f"{what}: the held epoch, after the next"
                )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stop", ["close", "drop", "break"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batch_outlives_the_epoch_it_came_from_until_the_next_iter(
    data: Path, daemon: DaemonProcess, backend: str, stop: str
) -> None:
    """``x, y = next(iter(loader))`` drops the epoch's iterator at once. Over gRPC its close
    gave the batch's buffer back and then drained the batches still in flight into it: the
    batch held showed another batch's samples (batch 2's, with batches_ahead 3), no error."""
    import gc
    import time

    case = Case(data, daemon, order="RANDOM", seed=8, drop_last=False)
    with case.loader("inproc") as ref:
        want = epochs(ref, 2)
    with case.loader(backend) as ld:
        if stop == "close":
            it = iter(ld)
            held = next(it)
            it.close()
        elif stop == "drop":
            held = next(iter(ld))
            gc.collect()
        else:
            for batch in ld:
                held = batch
                break
        time.sleep(0.2)  # the drained batches arrive meanwhile
        assert_same_batches([snap(held)], [want[0][0]], f"{backend}, {stop}: the batch held")
        # the next epoch starts from its own first batch, then may reuse the held buffer
        assert_same_epochs([epoch(iter(ld))], [want[1]], f"{backend}, {stop}: the next epoch")


# -- resume -------------------------------------------------------------------------------------
#: Every checkpoint-on-one, resume-on-another pair, and in-process on its own.
PAIRS: list[Any] = [("inproc", "inproc")] + [
    (a, b) for a in ("inproc", "shm", "grpc") for b in ("inproc", "shm", "grpc") if a != b
]
PAIRS_GPU: list[Any] = [
    pytest.param(("cuda_ipc", "inproc"), marks=pytest.mark.gpu),
    pytest.param(("inproc", "cuda_ipc"), marks=pytest.mark.gpu),
]
RESUME_CONFIGS = {
    "random": {"order": "RANDOM", "seed": 99, "drop_last": False},
    "quasi_subset": {"order": "QUASI_RANDOM", "seed": 7, "indices": SUBSET + DUPLICATES},
    "seq_dist_rank1": {"order": "SEQUENTIAL", "seed": 0, "distributed": True, "drop_last": False},
}


@pytest.mark.parametrize("config", sorted(RESUME_CONFIGS))
@pytest.mark.parametrize("pair", PAIRS + PAIRS_GPU, ids=lambda p: f"{p[0]}-to-{p[1]}")
def test_resume_mid_epoch_across_backends(
    data: Path,
    daemon: DaemonProcess,
    monkeypatch: pytest.MonkeyPatch,
    pair: tuple[str, str],
    config: str,
) -> None:
    src, dst = pair
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    case = Case(data, daemon, **RESUME_CONFIGS[config])
    reference = case.run("inproc", 3)
    assert len(reference[1]) >= 3
    with case.loader(src) as a:
        assert_same_batches(epoch(a), reference[0], f"{src}: epoch 0")
        head = epoch(a, 2)  # abandoned after two batches of epoch 1
        state = a.state_dict()
    assert (state["epoch"], state["batch"]) == (1, 2)
    with case.loader(dst) as b:
        b.load_state_dict(state)
        rest = epoch(b)
        after = epoch(b)
        assert (b.state_dict()["epoch"], b.state_dict()["batch"]) == (3, 0)
    assert_same_batches(head + rest, reference[1], f"{src} then {dst}: epoch 1")
    assert_same_batches(after, reference[2], f"{dst}: the epoch after the resumed one")


@pytest.mark.parametrize("backend", BACKENDS)
def test_load_state_dict_stops_the_epoch_being_iterated(
    data: Path, daemon: DaemonProcess, backend: str
) -> None:
    """``load_state_dict()`` while an iterator is live stops it, as ``iter()`` does. It went on
    yielding batches of the old position, which the resumed epoch then yielded again, and
    ``state_dict()`` then reported that old position."""
    case = Case(data, daemon, order="RANDOM", seed=5)
    reference = case.run("inproc", 2)
    with case.loader(backend) as ld:
        it = iter(ld)
        head = epoch(it, 2)
        state = ld.state_dict()
        assert (state["epoch"], state["batch"]) == (0, 2)
        epoch(it, 1)  # a third batch, then back to the checkpoint
        ld.load_state_dict(state)
        with pytest.raises(RuntimeError, match=r"stopped after 3 of .*load_state_dict\(\)"):
            next(it)
        assert (ld.state_dict()["epoch"], ld.state_dict()["batch"]) == (0, 2)
        rest = epoch(ld)
        after = epoch(ld)
        assert (ld.state_dict()["epoch"], ld.state_dict()["batch"]) == (2, 0)
    assert_same_batches(head + rest, reference[0], f"{backend}: epoch 0, resumed at batch 2")
    assert_same_batches(after, reference[1], f"{backend}: epoch 1")


@pytest.mark.parametrize("backend", SERVED)
def test_state_dicts_are_identical(data: Path, daemon: DaemonProcess, backend: str) -> None:
    case = Case(data, daemon, order="QUASI_RANDOM", seed=3, indices=SUBSET)
    states = {}
    for b in ("inproc", backend):
        with case.loader(b) as ld:
            epoch(ld, 1)
            states[b] = ld.state_dict()
    assert states[backend] == states["inproc"]


def _branching() -> dict[str, Any]:
    decoder = NDArrayDecoder()
    return {
        "vec": [decoder, ToTensor()],
        "label": [IntDecoder(), ToTensor()],
        "vec16": PipelineSpec(decoder, transforms=[ToTensor(), Convert(torch.float16)]),
    }


#: FFCV's pipeline forms: a missing entry or ``[]`` decodes with the field's default decoder, a
#: list without a decoder gets it prepended, ``None`` skips the field.
FORMS = {
    "missing": lambda: {"vec": [NDArrayDecoder(), ToTensor()]},
    "empty_list": lambda: {"vec": [NDArrayDecoder(), ToTensor()], "label": []},
    "no_decoder": lambda: {"vec": [NDArrayDecoder(), ToTensor()], "label": [ToTensor()]},
    "skipped": lambda: {"vec": None, "label": [IntDecoder(), ToTensor()]},
    "numpy_only": lambda: {"vec": [NDArrayDecoder()], "label": [IntDecoder()]},
    "reversed": lambda: {
        "label": [IntDecoder(), ToTensor()],
        "vec": [NDArrayDecoder(), ToTensor()],
    },
    "second_output_of_a_field": lambda: {
        "vec": [NDArrayDecoder(), ToTensor()],
        "label": [IntDecoder(), ToTensor()],
        "label2": PipelineSpec("label", decoder=IntDecoder(), transforms=[ToTensor(), Squeeze()]),
    },
    "branch_from_an_op": _branching,
}


def _form_params() -> list[Any]:
    out = []
    for b in BACKENDS:
        name = b if isinstance(b, str) else b.values[0]
        marks = [] if isinstance(b, str) else list(b.marks)
        for form in sorted(FORMS):
            out.append(pytest.param(name, form, marks=marks, id=f"{name}-{form}"))
    return out


@pytest.mark.parametrize(("backend", "form"), _form_params())
def test_pipeline_forms(data: Path, daemon: DaemonProcess, backend: str, form: str) -> None:
    if backend == "cuda_ipc" and form == "numpy_only":
        pytest.skip("not applicable: cuda_ipc carries GPU tensors, this form yields numpy arrays")
    runs = {}
    for b in ("inproc", backend):
        with make_loader(
            b, data, FORMS[form](), address=daemon.address, batch_size=5, order="RANDOM", seed=1
        ) as ld:
            runs[b] = epochs(ld, 1)
    assert_same_epochs(runs[backend], runs["inproc"], f"{backend} vs in-process, {form}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_last_sample_ids_name_the_batch(data: Path, daemon: DaemonProcess, backend: str) -> None:
    case = Case(data, daemon, order="QUASI_RANDOM", seed=6, indices=DUPLICATES, drop_last=False)
    with case.loader(backend) as ld:
        for _vec, label in ld:
            want = label.reshape(-1).numpy().astype(np.uint64) - BASE
            np.testing.assert_array_equal(np.asarray(ld.last_sample_ids), want)


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batch_larger_than_the_dataset(
    data: Path, daemon: DaemonProcess, backend: str, drop_last: bool
) -> None:
    case = Case(data, daemon, order="RANDOM", seed=1, batch_size=50, drop_last=drop_last)
    got = case.check(backend, 1)
    assert len(got[0]) == (0 if drop_last else 1)


@pytest.mark.parametrize("order", ["RANDOM", "QUASI_RANDOM"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_distributed_random_without_a_seed_draws_one_order_on_every_rank(
    data: Path, daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch, backend: str, order: str
) -> None:
    """FFCV's rule: distributed RANDOM with ``seed=None`` uses seed 0 on every rank. FFCV has no
    distributed QUASI_RANDOM; ours follows the same rule (with a fresh seed per rank, the ranks
    took their shares of different shuffles: a quarter of the samples were never read)."""
    world = 3
    monkeypatch.setenv("WORLD_SIZE", str(world))
    seen = []
    for rank in range(world):
        monkeypatch.setenv("RANK", str(rank))
        case = Case(data, daemon, order=order, seed=None, distributed=True, drop_last=False)
        seen.append(ids(case.check(backend, 1)[0]))
    assert set().union(*seen) == set(range(N))


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_order_given_by_its_value(data: Path, daemon: DaemonProcess, backend: str) -> None:
    from beton_client import Loader as ClientLoader
    from beton_serve.loader import Loader as InProcessLoader

    kw: dict[str, Any] = {"batch_size": 5, "seed": 3, "order": 2, "drop_last": False}
    ref_kw: dict[str, Any] = {"batch_size": 5, "seed": 3, "order": "RANDOM", "drop_last": False}
    with make_loader("inproc", data, pipes(), **ref_kw) as ref:
        want = epochs(ref, 1)
    if backend == "inproc":
        ld: Any = InProcessLoader(str(data), pipelines=pipes(), num_workers=1, **kw)
    else:
        ld = ClientLoader(str(data), pipelines=pipes(), **serving(daemon.address, backend), **kw)
    with ld:
        got = epochs(ld, 1)
    assert_same_epochs(got, want, f"{backend}, order=2 vs OrderOption.RANDOM")


#: A value of the right type for each fixed attribute (the check is on the name, not the value).
FIXED_VALUES: dict[str, Any] = {
    "batch_size": 7,
    "num_workers": 2,
    "order": "RANDOM",
    "distributed": True,
    "rank": 1,
    "world_size": 2,
    "seed": 99,
    "drop_last": True,
    "batches_ahead": 2,
    "recompile": True,
    "copy": True,
    "indices": [0, 1],
    "custom_fields": {},
}


@pytest.mark.parametrize("backend", BACKENDS)
def test_fixed_attributes_refuse_assignment(
    data: Path, daemon: DaemonProcess, backend: str
) -> None:
    """``loader.indices = subset`` (or ``batch_size``, ``seed``, ...) after construction used to
    be accepted and ignored, so a script trained on every sample; now it raises, on every
    backend, and the Loader goes on with the values it was built with. ``next_epoch`` stays
    writable (FFCV's resume)."""
    from beton_client.frontend import FIXED_ATTRIBUTES

    assert set(FIXED_VALUES) == FIXED_ATTRIBUTES
    mine = np.array(SUBSET, np.int64)
    case = Case(data, daemon, order="SEQUENTIAL", indices=mine, drop_last=False)
    with case.loader(backend) as ld:
        mine[0] = 36  # the caller's array changing later does not change the Loader's ids
        for name, value in FIXED_VALUES.items():
            before = getattr(ld, name)
            with pytest.raises(AttributeError, match=rf"Loader\.{name} is fixed"):
                setattr(ld, name, value)
            assert getattr(ld, name) is before, name
        if isinstance(ld.indices, np.ndarray):
            with pytest.raises(ValueError, match="read-only"):
                ld.indices[0] = 36
        assert [int(i) for i in ld.indices] == SUBSET
        ld.next_epoch = 1
        got = epoch(ld)
    assert ids(got) == SUBSET
    assert_same_batches(
        got,
        Case(data, daemon, order="SEQUENTIAL", indices=SUBSET).run("inproc", 1, drop_last=False)[0],
        f"{backend} vs in-process",
    )
