"""Control plane: grpc.aio on uvloop against grpc's threaded server, under many concurrent streams.

    python benchmarks/bench_control_plane.py [--streams 1,16,64] [--messages 300]

Each stream is one ``Batches`` bidirectional call over a Unix socket, driven like the daemon's:
the client sends a ``Release`` and the server answers with a ``BatchReady`` (two tensor
descriptors and 256 sample ids, the size of a real one). The server runs in a subprocess (the
mode under test); the client is the same grpc.aio program for both. Reported: round trips per
second over all streams, and the median round-trip latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from beton_wire.v1 import beton_pb2 as pb
from beton_wire.v1 import beton_pb2_grpc as pb_grpc


def _ready(i: int) -> pb.ServerMessage:
    return pb.ServerMessage(
        batch=pb.BatchReady(
            epoch=0,
            batch_index=i,
            slot=i % 5,
            length=256,
            tensors=[
                pb.TensorDesc(
                    name="image", shape=[256, 224, 224, 3], dtype=1, offset=0, nbytes=38535168
                ),
                pb.TensorDesc(name="label", shape=[256, 1], dtype=8, offset=38535168, nbytes=2048),
            ],
            sample_ids=bytes(8 * 256),
        )
    )


class AioServicer(pb_grpc.BetonServeServicer):
    async def Batches(self, request_iterator, context):
        i = 0
        async for _msg in request_iterator:
            yield _ready(i)
            i += 1


class SyncServicer(pb_grpc.BetonServeServicer):
    def Batches(self, request_iterator, context):
        for i, _msg in enumerate(request_iterator):
            yield _ready(i)


def serve(mode: str, sock: str, threads: int) -> None:
    if mode == "threads":
        server = grpc.server(ThreadPoolExecutor(max_workers=threads))
        pb_grpc.add_BetonServeServicer_to_server(SyncServicer(), server)
        server.add_insecure_port("unix:" + sock)
        server.start()
        print("READY", flush=True)
        sys.stdin.readline()
        server.stop(0)
        return

    async def main() -> None:
        server = grpc.aio.server()
        pb_grpc.add_BetonServeServicer_to_server(AioServicer(), server)
        server.add_insecure_port("unix:" + sock)
        await server.start()
        print("READY", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        await server.stop(0)

    import uvloop

    uvloop.run(main())


async def drive(sock: str, streams: int, messages: int) -> tuple[float, float]:
    async with grpc.aio.insecure_channel("unix:" + sock) as ch:
        stub = pb_grpc.BetonServeStub(ch)
        lat: list[float] = []

        async def one() -> None:
            call = stub.Batches()
            for i in range(messages):
                t = time.perf_counter()
                await call.write(pb.ClientMessage(release=pb.Release(slot=i % 5, batch_index=i)))
                await call.read()
                lat.append(time.perf_counter() - t)
            await call.done_writing()

        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(streams)))
        wall = time.perf_counter() - t0
    return streams * messages / wall, statistics.median(lat) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", default="1,16,64")
    ap.add_argument("--messages", type=int, default=300)
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--sock", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=128, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.sock, args.threads)
        return
    results = {}
    for mode in ("aio_uvloop", "threads"):
        for n in (int(s) for s in args.streams.split(",")):
            with tempfile.TemporaryDirectory(prefix="bs-", dir="/tmp") as tmp:
                sock = os.path.join(tmp, "cp.sock")
                server_mode = "aio" if mode == "aio_uvloop" else "threads"
                proc = subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--serve",
                        server_mode,
                        "--sock",
                        sock,
                        "--threads",
                        str(max(16, 2 * n)),
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                try:
                    assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
                    rate, p50 = asyncio.run(drive(sock, n, args.messages))
                finally:
                    assert proc.stdin is not None
                    proc.stdin.write("\n")
                    proc.stdin.flush()
                    proc.wait(30)
            results[f"{mode}/{n}"] = {"round_trips_per_s": round(rate), "p50_us": round(p50)}
            print(mode, n, results[f"{mode}/{n}"], flush=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
