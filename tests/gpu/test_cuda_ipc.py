"""CUDA IPC on a real GPU: hand-off between two processes, event sync under load, DLPack into
torch, GPU ops on an IPC'd slab, negotiation/fallback with real facts, and figures.

Marked ``gpu``: skipped without CUDA (tests/conftest.py). The IPC tests also skip, with the
probe's reason, where the environment refuses CUDA IPC (then ``test_negotiation_with_real_facts``
checks that the stream falls back to shm with that reason). ``tests/gpu/run_on_device.sh`` runs
this file on the GPU machine; set ``BETON_GPU_FIGURES`` to a file to collect the figures there.

The producer (the daemon's half) runs in a spawned process: ``helpers.cuda_producer.produce``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

SMALL = (8, 64, 64, 3)  # 98 KB batches for correctness
LOAD = (64, 128, 128, 3)  # 3.1 MB batches for the event-sync stress
BIG = (256, 224, 224, 3)  # 38.5 MB: the ImageNet-sized batch of the throughput figure


def _figure(name: str, value: float, unit: str, **extra: Any) -> None:
    """Print a figure and append it to $BETON_GPU_FIGURES (one JSON object per line)."""
    record = {"figure": name, "value": round(value, 3), "unit": unit, **extra}
    print("FIGURE", json.dumps(record))
    path = os.environ.get("BETON_GPU_FIGURES")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps(record) + "\n")


@pytest.fixture(scope="module")
def cupy():
    return pytest.importorskip("cupy", reason="CuPy is needed for CUDA IPC")


@pytest.fixture(scope="module")
def torch():
    import torch

    return torch


@pytest.fixture(scope="module")
def probe(cupy) -> tuple[bool, str]:
    from beton_serve.transport.cuda_ipc import probe_cuda_ipc

    ok, why = probe_cuda_ipc(0)
    print(f"CUDA IPC probe on device 0: ok={ok} {why}")
    return ok, why


@pytest.fixture
def ipc(probe) -> None:
    ok, why = probe
    if not ok:
        pytest.skip(f"CUDA IPC refused in this environment: {why}")


@contextmanager
def producer(shape, n_batches: int, slots: int, pattern: str) -> Iterator[tuple[Any, dict, int]]:
    """Start the producer process; yield (conn, setup extra, slot_bytes); join it at the end."""
    from helpers.cuda_producer import produce

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=produce, args=(child, shape, n_batches, slots, pattern), name="beton-producer"
    )
    proc.start()
    child.close()
    try:
        if not parent.poll(120):
            raise TimeoutError("the producer did not send its setup within 120 s")
        kind, extra, slot_bytes = parent.recv()
        if kind == "error":
            raise AssertionError(f"producer failed:\n{extra}")
        yield parent, extra, slot_bytes
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=10)
        parent.close()


def _recv(conn) -> tuple:
    if not conn.poll(60):
        raise TimeoutError("no message from the producer within 60 s")
    msg = conn.recv()
    if msg[0] == "error":
        raise AssertionError(f"producer failed:\n{msg[1]}")
    return msg


def _finish(conn, rx) -> None:
    """Close the client side, let the producer close its ring, check it freed everything."""
    rx.close()
    conn.send(("close", None))
    while True:
        msg = _recv(conn)
        if msg[0] == "closed":
            assert msg[1] == [], "the producer's ring kept allocations after close"
            return


def _views(shape):
    from beton_client._transport.cuda_ipc import TensorView

    return [TensorView(shape=tuple(shape), dtype="uint8", offset=0)]


def _receiver(extra, slot_bytes):
    from beton_client._transport.cuda_ipc import CudaIpcReceiver

    return CudaIpcReceiver(extra, slot_bytes=slot_bytes, device=0)


def _expected(torch, shape, k: int):
    n = int(np.prod(shape))
    return ((torch.arange(n, device="cuda:0") + k) % 251).to(torch.uint8).reshape(shape)


def test_handoff_between_processes_dlpack_view(ipc, torch):
    with producer(SMALL, n_batches=6, slots=2, pattern="counter") as (conn, extra, slot_bytes):
        rx = _receiver(extra, slot_bytes)
        for k in range(6):
            kind, idx, slot, _ = _recv(conn)
            assert (kind, idx) == ("batch", k)
            (t,) = rx.tensors(slot, _views(SMALL))
            # DLPack into torch: a uint8 view of the slab on the right device, no copy.
            assert t.device == torch.device("cuda:0") and t.dtype == torch.uint8
            assert tuple(t.shape) == SMALL and t.is_contiguous()
            assert t.data_ptr() == rx._mappings[slot].ptr
            assert torch.equal(t, _expected(torch, SMALL, k))
            del t
            rx.release(slot)
            conn.send(("release", slot))
        assert rx.open_slots() == 2  # each slab opened once, reused after
        assert _recv(conn)[0] == "done"
        _finish(conn, rx)


def test_event_sync_under_load_reads_k_while_producer_writes_k_plus_1(ipc, torch):
    """The client releases each slot right after *queueing* its reads (no CPU sync), so the
    producer's next copy into that slab must be ordered after them by the free event."""
    n_batches, mismatches = 40, None
    with producer(LOAD, n_batches=n_batches, slots=2, pattern="counter") as (conn, extra, sb):
        rx = _receiver(extra, sb)
        mismatches = torch.zeros((), dtype=torch.int64, device="cuda:0")
        for k in range(n_batches):
            kind, idx, slot, _ = _recv(conn)
            assert (kind, idx) == ("batch", k)
            (t,) = rx.tensors(slot, _views(LOAD))
            want = _expected(torch, LOAD, k)
            for _ in range(8):  # slow reads keep the slab busy while the producer races on
                mismatches += (t != want).sum()
            del t
            rx.release(slot)
            conn.send(("release", slot))
        assert _recv(conn)[0] == "done"
        torch.cuda.synchronize()
        assert int(mismatches) == 0
        _finish(conn, rx)


def test_negotiation_with_real_facts(cupy, torch, probe):
    """The stream falls back to shm with the probe's reason when IPC is refused, and picks
    cuda_ipc when it works; a GPU the daemon cannot see and a missing CuPy fall back too."""
    import dataclasses

    from beton_client._transport.identity import gather_facts
    from beton_serve.errors import TransportError
    from beton_serve.transport.negotiate import (
        ClientOffer,
        CudaDevice,
        DaemonFacts,
        HostIdentity,
        Reason,
        negotiate,
    )

    facts = gather_facts("cuda:0")
    assert facts.has_cuda and facts.has_cupy and facts.cuda_devices
    offer = ClientOffer.from_dict(facts.to_dict())
    rt = cupy.cuda.runtime
    me = HostIdentity.from_dict(facts.to_dict()["identity"])
    daemon = DaemonFacts(
        identity=me,
        has_cupy=True,
        cuda_devices=tuple(
            CudaDevice(index=i, uuid=rt.getDeviceProperties(i)["uuid"])
            for i in range(rt.getDeviceCount())
        ),
        ipc_probe=lambda index: probe,
    )
    result = negotiate(offer, daemon)
    ok, why = probe
    if ok:
        assert (result.transport, result.device_index, result.rejected) == ("cuda_ipc", 0, ())
    else:
        assert result.transport == "shm"
        assert result.rejected[0].code is Reason.IPC_REFUSED and why in result.rejected[0].message
    print("negotiation:", result.summary())
    other_gpu = dataclasses.replace(daemon, cuda_devices=(CudaDevice(index=0, uuid=b"\1" * 16),))
    assert negotiate(offer, other_gpu).rejected[0].code is Reason.DEVICE_NOT_VISIBLE
    no_cupy = dataclasses.replace(offer, has_cupy=False)
    assert negotiate(no_cupy, daemon).transport == "shm"
    with pytest.raises(TransportError, match="client_no_cupy"):
        negotiate(dataclasses.replace(no_cupy, transport="cuda_ipc"), daemon)


def test_throughput_and_handoff_latency(ipc, torch):
    """Figures: GB/s and images/s through H2D + IPC with 38.5 MB batches, the client's CPU cost
    of a hand-off (target < 100 us after warm-up), and publish-to-data-on-GPU latency."""
    n_batches, warmup = 60, 10
    receive_us, ready_us = [], []
    with producer(BIG, n_batches=n_batches, slots=3, pattern="fixed") as (conn, extra, sb):
        rx = _receiver(extra, sb)
        checks = []
        t_start = None
        for k in range(n_batches):
            kind, idx, slot, t_publish = _recv(conn)
            assert (kind, idx) == ("batch", k)
            if k == warmup:
                torch.cuda.synchronize()
                t_start = time.perf_counter()
            t0 = time.perf_counter()
            (t,) = rx.tensors(slot, _views(BIG))
            t1 = time.perf_counter()
            checks.append(t.view(-1)[:8].clone())  # the batch number, stamped by the producer
            if k >= warmup:
                receive_us.append((t1 - t0) * 1e6)
                if k % 10 == 0:  # a few synchronised samples: publish -> bytes on the GPU
                    torch.cuda.current_stream().synchronize()
                    ready_us.append((time.perf_counter() - t_publish) * 1e6)
            del t
            rx.release(slot)
            conn.send(("release", slot))
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t_start
        stamps = [int(np.frombuffer(c.cpu().numpy().tobytes(), np.int64)[0]) for c in checks]
        assert stamps == list(range(n_batches))
        assert _recv(conn)[0] == "done"
        _finish(conn, rx)
    measured = n_batches - warmup
    nbytes = int(np.prod(BIG)) * measured
    _figure("cuda_ipc_throughput", nbytes / elapsed / 1e9, "GB/s", batch=list(BIG))
    _figure("cuda_ipc_images_per_s", BIG[0] * measured / elapsed, "images/s", batch=list(BIG))
    _figure("cuda_ipc_receive_cpu_median", statistics.median(receive_us), "us")
    _figure("cuda_ipc_receive_cpu_p99", sorted(receive_us)[int(0.99 * len(receive_us))], "us")
    _figure("cuda_ipc_publish_to_gpu_median", statistics.median(ready_us), "us")
    assert statistics.median(receive_us) < 1000  # generous bound; the figure is the target


def test_imagenet_recipe_fp16_channels_last_from_one_ipc_slab(ipc, torch):
    """ToDevice -> ToTorchImage(channels_last) -> NormalizeImage(mean*255, std*255, float16)."""
    mean = np.array([0.485, 0.456, 0.406]) * 255
    std = np.array([0.229, 0.224, 0.225]) * 255
    with producer(SMALL, n_batches=1, slots=1, pattern="random") as (conn, extra, slot_bytes):
        rx = _receiver(extra, slot_bytes)
        _, _, slot, _ = _recv(conn)
        (t,) = rx.tensors(slot, _views(SMALL))
        ptr = t.data_ptr()
        img = _to_torch_image(t)
        assert img.data_ptr() == ptr  # the layout change is a view of the slab: no copy
        out = _normalize(torch, img, mean, std)
        assert out.dtype == torch.float16 and out.device.type == "cuda"
        assert tuple(out.shape) == (SMALL[0], 3, SMALL[1], SMALL[2])
        assert out.is_contiguous(memory_format=torch.channels_last)
        host = np.random.default_rng(0).integers(0, 256, int(np.prod(SMALL)), dtype=np.uint8)
        ref = ((host.reshape(SMALL).astype(np.float32) - mean) / std).astype(np.float16)
        np.testing.assert_allclose(
            out.permute(0, 2, 3, 1).cpu().numpy().astype(np.float32),
            ref.astype(np.float32),
            rtol=0,
            atol=2e-3,
        )
        del t, img, out
        rx.release(slot)
        conn.send(("release", slot))
        assert _recv(conn)[0] == "done"
        _finish(conn, rx)


def _client_op(name: str, *args: Any, **kwargs: Any) -> Any:
    """The client's torch implementation of an FFCV op (``beton_client._ops``), if it exists."""
    try:
        from beton_client import _ops  # the client engineer's torch ops
    except ImportError:
        return None
    cls = getattr(_ops, name, None)
    return None if cls is None else cls(*args, **kwargs)


def _to_torch_image(t):
    """ToTorchImage(channels_last=True): the client's op if it exists, else its definition."""
    op = _client_op("ToTorchImage", channels_last=True)
    if op is None:
        print("beton_client._ops.ToTorchImage not found: using its definition")
        return t.permute(0, 3, 1, 2)
    return op(t)


def _normalize(torch, img, mean, std):
    """NormalizeImage(mean, std, float16) on the GPU: the client's op if it exists."""
    op = _client_op("NormalizeImage", mean, std, np.float16)
    if op is None:
        print("beton_client._ops.NormalizeImage not found: using its definition")
        m = torch.tensor(mean, dtype=torch.float32, device=img.device).view(1, 3, 1, 1)
        s = torch.tensor(std, dtype=torch.float32, device=img.device).view(1, 3, 1, 1)
        return ((img.float() - m) / s).half()
    return op(img)
