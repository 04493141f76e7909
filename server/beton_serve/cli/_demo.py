"""``beton-serve demo``: one daemon, two trainers sharing it, their throughput and data stall.

What it does, in order:

1. writes a sample dataset into a temporary directory: ``--samples`` generated RGB images
   (smooth gradients, a sinusoidal texture, a few flat shapes and noise, made with numpy from a
   fixed seed; nothing is downloaded) stored as JPEG in an ``RGBImageField`` named ``image``,
   and a label in an ``IntField`` named ``label``;
2. starts ``beton-serve serve`` on that file, on a private Unix socket in the same directory,
   and waits until its gRPC health service answers ``SERVING``;
3. starts ``--trainers`` trainer processes (:mod:`beton_serve.cli._demo_trainer`, a user program
   that only talks to the daemon through ``beton_client``) with the same pipeline and different
   seeds: the daemon compiles the pipeline once, and serves two streams (two orders) from its
   one worker pool;
4. prints each trainer's images/s and its data-stall time (the wall time it spent waiting inside
   ``next(loader)``), over the whole loop and after the first batch (which waits for the
   pipeline to compile), and the total;
5. stops the daemon with SIGTERM (it drains and frees its shared memory), checks that none of its
   ``/dev/shm/beton-<pid>-*`` segments is left, and removes the directory (unless ``--keep``).

``--write-only PATH`` only writes the sample dataset to ``PATH`` (e.g. for docker-compose.yml
or the examples) and exits.

Exit status 0 when every step succeeded. Every child process is waited for (SIGTERM, then
SIGKILL after a timeout) whatever happens, including Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from beton_wire.address import socket_path_problem
from beton_wire.limits import usable_cpus

from beton_serve.errors import BetonError

if TYPE_CHECKING:  # numpy is imported when the demo runs, not by the CLI's --help
    import numpy as np
    from numpy.typing import NDArray

__all__ = ["SampleImages", "register", "run", "synth_image", "write_sample_dataset"]

_SHM = Path("/dev/shm")
_STOP_TIMEOUT_S = 20.0


class DemoError(BetonError):
    """A step of the demo failed; the message says which and shows the child's output."""


# -- the sample dataset -------------------------------------------------------------------------


def synth_image(seed: Sequence[int], height: int, width: int) -> NDArray[np.uint8]:
    """A deterministic, photo-like test image.

    Args:
        seed: anything ``numpy.random.default_rng`` accepts; the image is a pure function of it.
        height, width: the size in pixels.

    Returns:
        ``(height, width, 3)`` uint8, HWC, RGB.
    """
    import numpy as np

    rng = np.random.default_rng(list(seed))
    y = np.linspace(-0.5, 0.5, height)[:, None]
    x = np.linspace(-0.5, 0.5, width)[None, :]
    img = np.empty((height, width, 3), np.float32)
    for c in range(3):
        gx, gy = rng.uniform(-110, 110, size=2)
        img[..., c] = rng.uniform(50, 205) + gx * x + gy * y
    fx, fy = rng.uniform(0.5, 5.0, size=2)
    img += (18.0 * np.sin(2 * np.pi * (fx * x + fy * y) + rng.uniform(0, 2 * np.pi)))[..., None]
    for _ in range(int(rng.integers(1, 4))):
        cy, cx = rng.uniform(-0.5, 0.5, size=2)
        r = rng.uniform(0.08, 0.35)
        inside = (y - cy) ** 2 + (x - cx) ** 2 <= r * r
        img[inside] = rng.uniform(0, 255, size=3)
    img += rng.normal(0.0, 3.0, size=img.shape)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


class SampleImages:
    """An indexed dataset of ``(image, label)`` for ``DatasetWriter.from_indexed_dataset``.

    Sample ``i`` is ``synth_image((seed, i), size, size)`` and the label ``i % classes``.
    """

    def __init__(self, n: int, size: int, classes: int = 10, seed: int = 2024) -> None:
        if n < 1 or size < 8 or classes < 1:
            raise DemoError(f"need n >= 1, size >= 8, classes >= 1; got {n}, {size}, {classes}")
        self.n, self.size, self.classes, self.seed = n, size, classes, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[NDArray[np.uint8], int]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return synth_image((self.seed, i), self.size, self.size), i % self.classes


def write_sample_dataset(path: str | os.PathLike[str], n: int = 2048, size: int = 64) -> Path:
    """Write the demo dataset (``image``: JPEG q90, ``label``: int) to ``path``; returns it."""
    from beton_serve.fields import IntField, RGBImageField
    from beton_serve.writer import DatasetWriter

    out = Path(path)
    writer = DatasetWriter(
        out,
        {"image": RGBImageField(write_mode="jpg", jpeg_quality=90), "label": IntField()},
        num_workers=min(2, usable_cpus()),
        progress=False,
    )
    writer.from_indexed_dataset(SampleImages(n, size))
    return out


# -- processes ----------------------------------------------------------------------------------


def _stop(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM) -> int:
    """Signal ``proc`` and wait for it; SIGKILL after a timeout. Returns its exit status."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        try:
            proc.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            sys.stderr.write(f"demo: process {proc.pid} ignored signal {sig}; killing it\n")
            proc.kill()
            proc.wait(timeout=_STOP_TIMEOUT_S)
    return int(proc.returncode)


@contextlib.contextmanager
def _children() -> Iterator[list[subprocess.Popen[Any]]]:
    """Every process appended to the list is stopped and reaped on exit, last started first."""
    procs: list[subprocess.Popen[Any]] = []
    try:
        yield procs
    finally:
        for proc in reversed(procs):
            _stop(proc)


def _python_cli(*argv: str) -> list[str]:
    """The command line that runs ``beton-serve ARGV`` with this interpreter."""
    return [
        sys.executable,
        "-P",  # the working directory is not on sys.path
        "-c",
        "from beton_serve.cli import main; raise SystemExit(main())",
        *argv,
    ]


def _tail(path: Path, limit: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return ""


def _wait_serving(target: str, daemon: subprocess.Popen[Any], log: Path, timeout: float) -> None:
    from beton_serve.cli._health import check

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            raise DemoError(f"the daemon exited with status {daemon.returncode}:\n{_tail(log)}")
        if check(target, timeout=1.0) == "SERVING":
            return
    raise DemoError(f"the daemon did not answer within {timeout:.0f} s:\n{_tail(log)}")


def _segments_of(pid: int) -> list[str]:
    if not _SHM.is_dir():
        return []
    return sorted(p.name for p in _SHM.glob(f"beton-{pid}-*"))


# -- the command --------------------------------------------------------------------------------


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``demo`` subcommand."""
    p = subparsers.add_parser(
        "demo",
        help="write a sample dataset, start a daemon, run two trainers that share it",
        description=(__doc__ or "").split("\n\n", 1)[0],
    )
    p.add_argument("--samples", type=int, default=2048, help="images in the sample dataset")
    p.add_argument("--size", type=int, default=64, help="image side in pixels")
    p.add_argument("--trainers", type=int, default=2, help="trainer processes")
    p.add_argument("--epochs", type=int, default=2, help="epochs per trainer")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=0, help="daemon worker threads (0: cores)")
    p.add_argument("--keep", metavar="DIR", default=None, help="work in DIR and keep it")
    p.add_argument("--write-only", metavar="PATH", default=None, help="only write the dataset")
    p.add_argument("--timeout", type=float, default=120.0, help="give up after this many s")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit status."""
    if args.write_only:
        t0 = time.perf_counter()
        path = write_sample_dataset(args.write_only, args.samples, args.size)
        sys.stdout.write(
            f"wrote {args.samples} samples to {path} "
            f"({path.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - t0:.1f} s\n"
        )
        return 0
    if args.trainers < 1 or args.epochs < 1 or args.batch_size < 1:
        raise DemoError("--trainers, --epochs and --batch-size must be at least 1")
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
        return _run_in(Path(args.keep), args)
    with tempfile.TemporaryDirectory(prefix="beton-serve-demo-") as tmp:
        return _run_in(Path(tmp), args)


def _run_in(work: Path, args: argparse.Namespace) -> int:
    out = sys.stdout
    t0 = time.perf_counter()
    dataset = write_sample_dataset(work / "demo.beton", args.samples, args.size)
    out.write(
        f"[1/4] wrote {args.samples} generated {args.size}x{args.size} JPEG images to {dataset} "
        f"({dataset.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - t0:.1f} s\n"
    )
    sock = work / "beton.sock"
    if socket_path_problem(str(sock)) is None:
        return _serve_and_train(work, dataset, sock, args, t0)
    # A long $TMPDIR (or --keep DIR) makes the socket's path longer than the kernel takes:
    # the socket goes to a short private directory of its own instead.
    sock_dir = Path(tempfile.mkdtemp(prefix="bs-demo-", dir="/tmp"))  # mode 0700
    try:
        return _serve_and_train(work, dataset, sock_dir / "beton.sock", args, t0)
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


def _serve_and_train(
    work: Path, dataset: Path, sock: Path, args: argparse.Namespace, t0: float
) -> int:
    """Steps 2 to 4: the daemon on ``sock``, the trainers, the clean stop."""
    out = sys.stdout
    target = f"unix://{sock}"
    daemon_log = work / "daemon.log"
    env = dict(os.environ)
    env.pop("BETON_SERVE_ADDRESS", None)
    with _children() as procs, daemon_log.open("wb") as dlog:
        daemon = subprocess.Popen(
            _python_cli(
                "serve",
                str(dataset),
                "--socket",
                str(sock),
                "--workers",
                str(args.workers),
                "--log-level",
                "warning",
            ),
            stdin=subprocess.DEVNULL,
            stdout=dlog,
            stderr=subprocess.STDOUT,
            env=env,
        )
        procs.append(daemon)
        t1 = time.perf_counter()
        _wait_serving(target, daemon, daemon_log, timeout=args.timeout)
        out.write(
            f"[2/4] daemon pid {daemon.pid} serving on {target} "
            f"(ready in {time.perf_counter() - t1:.1f} s)\n"
        )
        results = _run_trainers(procs, work, target, dataset, args, env)
        out.write(f"[3/4] {len(results)} trainers shared one daemon:\n")
        total_images = 0
        wall = 0.0
        for r in results:
            total_images += r["images"]
            wall = max(wall, r["wall_s"])
            out.write(_trainer_line(r))
        out.write(
            f"  total: {total_images} images, {total_images / max(wall, 1e-9):.0f} images/s "
            "from one decode pool\n"
        )
        status = _stop(daemon)
        procs.remove(daemon)
    left = _segments_of(daemon.pid)
    if status != 0 or left:
        raise DemoError(
            f"the daemon stopped with status {status}; segments left: {left or 'none'}\n"
            f"{_tail(daemon_log)}"
        )
    out.write(
        f"[4/4] daemon stopped cleanly (SIGTERM, exit 0, no shared memory left); "
        f"total {time.perf_counter() - t0:.1f} s\n"
    )
    return 0


def _trainer_line(r: dict[str, Any]) -> str:
    """Two lines: the whole loop, then the loop after the first batch (compile excluded)."""
    wall, stall, first = r["wall_s"], r["stall_s"], r["first_batch_s"]
    share = 100.0 * stall / wall if wall > 0 else 0.0
    text = (
        f"  trainer {r['trainer']}: {r['images']} images in {wall:.2f} s = "
        f"{r['images'] / max(wall, 1e-9):.0f} images/s; data stall {stall:.2f} s "
        f"({share:.0f} % of its time); pipeline {r['pipeline']}\n"
    )
    rest_wall, rest_stall = wall - first, stall - first
    per_batch = r["images"] / max(r["batches"], 1)
    if r["batches"] > 1 and rest_wall > 0:
        text += (
            f"    first batch after {first:.2f} s (the daemon compiles the pipeline on first use;"
            f" the loader opened in {r['open_s']:.2f} s); after it: "
            f"{(r['images'] - per_batch) / rest_wall:.0f} images/s, data stall "
            f"{100.0 * rest_stall / rest_wall:.0f} %\n"
        )
    return text


def _run_trainers(
    procs: list[subprocess.Popen[Any]],
    work: Path,
    target: str,
    dataset: Path,
    args: argparse.Namespace,
    env: dict[str, str],
) -> list[dict[str, Any]]:
    started = []
    for i in range(args.trainers):
        log = work / f"trainer-{i}.log"
        with log.open("wb") as f:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-P",  # the working directory is not on sys.path
                    "-m",
                    "beton_serve.cli._demo_trainer",
                    str(dataset),
                    "--server",
                    target,
                    "--trainer",
                    str(i),
                    "--epochs",
                    str(args.epochs),
                    "--batch-size",
                    str(args.batch_size),
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=f,
                env=env,
            )
        procs.append(proc)
        started.append((proc, log))
    results = []
    deadline = time.monotonic() + args.timeout
    for proc, log in started:
        try:
            stdout, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise DemoError(f"trainer {proc.pid} did not finish in time:\n{_tail(log)}") from None
        if proc.returncode != 0:
            raise DemoError(f"a trainer exited with status {proc.returncode}:\n{_tail(log)}")
        lines = [ln for ln in stdout.decode().splitlines() if ln.startswith("{")]
        if not lines:
            raise DemoError(f"a trainer printed no result:\n{_tail(log)}")
        results.append(json.loads(lines[-1]))
    return sorted(results, key=lambda r: r["trainer"])
