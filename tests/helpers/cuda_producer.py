"""The daemon's half of the GPU hand-off tests, run in a spawned process.

:func:`produce` owns a real :class:`~beton_serve.transport.cuda_ipc.CudaIpcRing` and talks to the
test process (the client) over a ``multiprocessing`` pipe, as the daemon's control stream would:

* producer -> client: ``("setup", extra, slot_bytes)``, then ``("batch", k, slot, t_publish)``
  for each batch, then ``("done", None)``; or ``("error", traceback)``;
* client -> producer: ``("release", slot)``; ``("close", None)`` once the client dropped its
  tensors and closed its receiver. The producer then closes the ring and answers
  ``("closed", leaked)`` where ``leaked`` is the list of still-allocated pointers (empty).

Image bytes of batch ``k`` are ``(i + k) % 251`` for flat index ``i`` when ``pattern`` is
``"counter"``; with ``"fixed"`` the staging buffers are written once (throughput runs) and only the
first 8 bytes carry ``k``; with ``"random"`` they are seeded uniform bytes (ops test).
"""

from __future__ import annotations

import time
import traceback
from typing import Any


def produce(conn: Any, shape: tuple[int, ...], n_batches: int, slots: int, pattern: str) -> None:
    import numpy as np
    from beton_serve.transport.cuda_ipc import CudaIpcRing
    from beton_wire.slots import slot_layout

    ring = None
    try:
        layout = slot_layout([("image", shape[1:], "uint8")], batch_size=shape[0])
        ring = CudaIpcRing(layout, slots, device_index=0)
        conn.send(("setup", dict(ring.setup().extra), layout.slot_bytes))
        n = int(np.prod(shape))
        base = (np.arange(n, dtype=np.int64) % 251).astype(np.int16)
        if pattern == "fixed":
            for s in range(slots):
                ring.host_views(s)[0].reshape(-1)[:] = base.astype(np.uint8)
        for k in range(n_batches):
            slot = ring.acquire()
            while slot is None:
                kind, value = conn.recv()
                if kind == "release":
                    ring.release(value)
                slot = ring.acquire()
            flat = ring.host_views(slot)[0].reshape(-1)
            if pattern == "counter":
                np.remainder(base + (k % 251), 251, out=flat, casting="unsafe")
            elif pattern == "random":
                flat[:] = np.random.default_rng(k).integers(0, 256, n, dtype=np.uint8)
            else:
                flat[:8] = np.frombuffer(np.int64(k).tobytes(), np.uint8)
            ring.publish(slot, shape[0])
            conn.send(("batch", k, slot, time.perf_counter()))
            while conn.poll():
                kind, value = conn.recv()
                if kind == "release":
                    ring.release(value)
        conn.send(("done", None))
        while True:
            kind, value = conn.recv()
            if kind == "close":
                break
            if kind == "release":
                ring.release(value)
        res = ring._res
        ring.close()
        conn.send(("closed", list(res.slabs) + list(res.staging) + list(res.events)))
    except Exception:
        if ring is not None:
            ring.close()
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()
