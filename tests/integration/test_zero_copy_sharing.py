# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""Zero-copy sharing (issue 6): identical shm streams read one group buffer in place.

Clients on the notice channel get shared batches as references into a sharing arena
(``/dev/shm/beton-<pid>-share-<n>``) instead of a copy in their own slot. A batch a client
still holds must never be overwritten, however far the others run ahead; every arena is unlinked
once its streams are gone; and a client without the notice channel still gets copies.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from beton_client import Loader, OrderOption
from beton_serve.fields.decoders import CenterCropRGBImageDecoder, IntDecoder
from beton_serve.transforms import ToTensor
from helpers.daemon import daemon_factory, short_tmp, wait_for  # noqa: F401

pytestmark = pytest.mark.slow

N_SAMPLES = 64  # images_smart.beton


def _loader(address: str, batch: int = 4) -> Loader:
    return Loader(
        "images_smart",
        batch_size=batch,
        order=OrderOption.RANDOM,
        seed=3,
        pipelines={
            "image": [CenterCropRGBImageDecoder((24, 24), 0.8), ToTensor()],
            "label": [IntDecoder(), ToTensor()],
        },
        server=address,
        spawn=False,
    )


def _shared_mappings(ld: Loader) -> int:
    """Batches this client read by reference from a sharing arena."""
    assert ld._stream is not None
    return int(ld._stream.receiver.shared_batches)


def test_shared_batches_are_read_in_place_and_a_held_one_never_changes(
    daemon_factory, fixtures_dir
) -> None:
    d = daemon_factory([fixtures_dir / "images_smart.beton"], args=["--share-retain", "16"])
    holder, *others = [_loader(d.address) for _ in range(3)]
    try:
        # All three streams are open before anyone reads: every batch is a group batch.
        held_it = iter(holder)
        held = next(held_it)  # a view into a group buffer, kept without cloning
        snapshot = [t.clone() for t in held]
        held_ids = holder.last_sample_ids.copy()
        errors: list[BaseException] = []
        got: list[list[np.ndarray]] = [[] for _ in others]

        def run(i: int) -> None:
            try:
                for _ in range(3):  # far past the holder: it is detached meanwhile
                    for b in others[i]:
                        got[i].append(others[i].last_sample_ids.copy())
                        assert len(b[0]) == 4
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,), name=f"beton-test-{i}") for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert _shared_mappings(holder), "the holder's batch did not come by reference"
        assert all(_shared_mappings(ld) for ld in others)
        for t, s in zip(held, snapshot, strict=True):
            assert torch.equal(t, s)  # the group never reused the buffer the holder still reads
        # The holder carries on, exact, on its own: the rest of its first epoch.
        rest = [holder.last_sample_ids.copy() for _ in held_it]
        ids = np.concatenate([held_ids, *rest])
        assert sorted(ids.tolist()) == list(range(N_SAMPLES))
        assert np.array_equal(np.concatenate(got[0][: N_SAMPLES // 4]), ids)
    finally:
        for ld in (holder, *others):
            ld.close()
    wait_for(lambda: not d.stats().streams, 5.0)
    wait_for(lambda: not [s for s in d.segments() if "-share-" in s], 5.0)  # every arena unlinked
    decoded = {x.name: x.samples_decoded for x in d.stats().datasets}["images_smart"]
    assert decoded < 3 * 3 * N_SAMPLES  # shared, not decoded once per client


def test_zero_copy_and_copying_clients_get_identical_batches(
    daemon_factory, fixtures_dir, monkeypatch
) -> None:
    d = daemon_factory([fixtures_dir / "images_smart.beton"], args=["--share-retain", "16"])
    fast = _loader(d.address, batch=8)
    monkeypatch.setattr("beton_client._stream._connect_notices", lambda *a: None)
    slow = _loader(d.address, batch=8)  # no notice channel: shared batches are copied
    try:
        assert slow._stream is not None and slow._stream.notice is None
        a, b = [], []
        for _ in range(2):
            for x, y in zip(fast, slow, strict=True):
                a.append((fast.last_sample_ids.copy(), x[0].clone(), x[1].clone()))
                b.append((slow.last_sample_ids.copy(), y[0].clone(), y[1].clone()))
        assert _shared_mappings(fast) and not _shared_mappings(slow)
        for (i1, x1, l1), (i2, x2, l2) in zip(a, b, strict=True):
            assert np.array_equal(i1, i2) and torch.equal(x1, x2) and torch.equal(l1, l2)
    finally:
        fast.close()
        slow.close()
    decoded = {x.name: x.samples_decoded for x in d.stats().datasets}["images_smart"]
    assert decoded == 2 * N_SAMPLES  # 1x: the copying client shared the decodes too


_HOLDER = """
import sys, time
from beton_client import Loader, OrderOption
from beton_serve.fields.decoders import CenterCropRGBImageDecoder, IntDecoder
from beton_serve.transforms import ToTensor
ld = Loader("images_smart", batch_size=4, order=OrderOption.RANDOM, seed=3,
            pipelines={"image": [CenterCropRGBImageDecoder((24, 24), 0.8), ToTensor()],
                       "label": [IntDecoder(), ToTensor()]},
            server=sys.argv[1], spawn=False)
it = iter(ld)
held = [next(it), next(it)]
print("HOLDING", flush=True)
time.sleep(120)
"""


def test_a_killed_member_frees_what_it_held_and_the_others_carry_on(
    daemon_factory, fixtures_dir
) -> None:
    import signal
    import subprocess
    import sys

    d = daemon_factory([fixtures_dir / "images_smart.beton"], args=["--share-retain", "16"])
    others = [_loader(d.address) for _ in range(2)]
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, d.address], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"HOLDING"
        got: list[list[np.ndarray]] = [[] for _ in others]
        its = [iter(ld) for ld in others]
        for _ in range(3):  # the others read on, sharing with the holder's batches
            for i, it in enumerate(its):
                next(it)
                got[i].append(others[i].last_sample_ids.copy())
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        wait_for(lambda: not any(s.client_pid == proc.pid for s in d.stats().streams), 3.0)
        for i, it in enumerate(its):  # the rest of the epoch, then one more
            for _ in it:
                got[i].append(others[i].last_sample_ids.copy())
            for _ in others[i]:
                got[i].append(others[i].last_sample_ids.copy())
        per_epoch = N_SAMPLES // 4
        for g in got:
            assert len(g) == 2 * per_epoch
            for e in range(2):
                ids = np.concatenate(g[e * per_epoch : (e + 1) * per_epoch])
                assert sorted(ids.tolist()) == list(range(N_SAMPLES))
        assert all(np.array_equal(a, b) for a, b in zip(got[0], got[1], strict=True))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for ld in others:
            ld.close()
    wait_for(lambda: not d.stats().streams, 5.0)
    try:  # (15 s: one CI run of session 26 saw 5 s pass with the arena still there)
        wait_for(lambda: not [s for s in d.segments() if "-share-" in s], 15.0)
    except AssertionError:
        st = d.stats()
        raise AssertionError(
            f"share arenas left after every stream closed: {d.segments()}; ring_bytes "
            f"{st.ring_bytes}, groups {list(st.decode_groups)}\n{d.log()[-4000:]}"
        ) from None


def test_a_job_that_modifies_its_batch_in_place_never_changes_the_others(
    daemon_factory, fixtures_dir
) -> None:
    d = daemon_factory([fixtures_dir / "images_smart.beton"], args=["--share-retain", "16"])
    vandal, peer = _loader(d.address), _loader(d.address)
    try:
        for _ in range(2):
            for a, b in zip(vandal, peer, strict=True):  # lockstep: the same group batch
                kept = a[0].clone()
                a[0].fill_(7)  # in place, on the view of the shared batch
                a[1].fill_(-1)
                assert torch.equal(b[0], kept)  # the peer reads the batch as decoded
                assert not torch.equal(b[1], torch.full_like(b[1], -1))
        assert _shared_mappings(vandal) > 0 and _shared_mappings(peer) > 0
    finally:
        vandal.close()
        peer.close()
