"""``beton-serve bench DATASET``: a dataset and pipeline, measured in process and served.

Two runs of the same pipeline, order, seed and batch size over ``--epochs`` epochs:

* **in-process**: ``beton_serve.loader.Loader`` in this process (FFCV's model: the training
  process decodes), with ``--workers`` worker threads;
* **served**: a ``beton-serve serve`` daemon (started here on a private socket with ``--workers``
  threads, or the one at ``--server``) and a separate client process that iterates a
  ``beton_client.Loader`` (:mod:`beton_serve.cli._bench_client`), as a trainer would.

For each run it reports images/s over the epochs after the first (the first includes compiling
the pipeline and warming the page cache; its time is shown separately), the time of the first
epoch, and CPU seconds per batch: of the process that runs the Loader (the trainer's own cost)
and, for served runs started here, of the daemon. The served/in-process throughput ratio closes
the table. A progress bar follows the batches of both runs; ``--json`` prints the results as one
JSON object on stdout instead of the table.

Pipelines (``--pipeline``), applied to every RGB image field; other fields use their default
decoder:

=========  ===========================================================================
``decode``  ``SimpleRGBImageDecoder`` when all images have one size, else
            ``CenterCropRGBImageDecoder((res, res), 224/256)``
``rrc``     ``RandomResizedCropRGBImageDecoder((res, res))``, ``RandomHorizontalFlip``
``cifar``   ``SimpleRGBImageDecoder``, ``RandomHorizontalFlip``, ``RandomTranslate(2)``,
            ``Cutout(4)`` (constant-size images)
=========  ===========================================================================

Numbers on a shared or small machine are noisy: compare ratios measured in one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from beton_serve.errors import BetonError, ConfigError

__all__ = ["PIPELINES", "RunResult", "build_pipelines", "register", "run"]

PIPELINES = ("decode", "rrc", "cifar")
_STOP_TIMEOUT_S = 20.0


class BenchError(BetonError):
    """A benchmark run failed; the message says which and shows the child's output."""


def build_pipelines(reader: Any, preset: str, res: int) -> dict[str, list[Any]]:
    """The ``preset`` pipeline for every field of ``reader`` (see the module docstring).

    Outputs are numpy arrays (no ``ToTensor``), so both runs measure the data path only.

    Raises:
        ConfigError: unknown preset, or ``cifar``/``decode`` on images of several sizes where
            a constant size is needed.
    """
    from beton_serve.fields import RGBImageField
    from beton_serve.fields.decoders import (
        CenterCropRGBImageDecoder,
        RandomResizedCropRGBImageDecoder,
        SimpleRGBImageDecoder,
    )
    from beton_serve.transforms import Cutout, RandomHorizontalFlip, RandomTranslate

    if preset not in PIPELINES:
        raise ConfigError(f"unknown pipeline {preset!r}: use one of {', '.join(PIPELINES)}")
    pipelines: dict[str, list[Any]] = {}
    for name in reader.field_names:
        handler = reader.handlers[name]
        if not isinstance(handler, RGBImageField):
            pipelines[name] = [handler.get_decoder_class()()]
            continue
        meta = reader.field_metadata(name)
        constant = len(meta) > 0 and bool(
            (meta["width"] == meta["width"][0]).all()
            and (meta["height"] == meta["height"][0]).all()
        )
        if preset == "rrc":
            pipelines[name] = [RandomResizedCropRGBImageDecoder((res, res)), RandomHorizontalFlip()]
        elif preset == "decode":
            pipelines[name] = [
                SimpleRGBImageDecoder()
                if constant
                else CenterCropRGBImageDecoder((res, res), 224 / 256)
            ]
        else:
            if not constant:
                raise ConfigError(
                    f"--pipeline cifar needs images of one size, but field {name!r} has several; "
                    "use --pipeline rrc or decode"
                )
            pipelines[name] = [
                SimpleRGBImageDecoder(),
                RandomHorizontalFlip(),
                RandomTranslate(padding=2),
                Cutout(4),
            ]
    return pipelines


class RunResult(dict):  # type: ignore[type-arg]
    """One run's figures (a dict, so it serialises as is).

    Keys: ``mode``, ``epochs``, ``batches_per_epoch``, ``images``, ``first_epoch_s``,
    ``steady_images_per_s`` (over epochs 2..N; over all epochs when there is only one),
    ``images_per_s`` (all epochs), ``loader_cpu_s_per_batch`` and, for a daemon started here,
    ``daemon_cpu_s``.
    """


def _summarise(
    mode: str, epoch_times: list[float], epoch_images: list[int], batches: int, cpu_s: float
) -> RunResult:
    steady_t = sum(epoch_times[1:]) if len(epoch_times) > 1 else sum(epoch_times)
    steady_n = sum(epoch_images[1:]) if len(epoch_images) > 1 else sum(epoch_images)
    total_t, total_n = sum(epoch_times), sum(epoch_images)
    return RunResult(
        mode=mode,
        epochs=len(epoch_times),
        batches_per_epoch=batches,
        images=total_n,
        first_epoch_s=round(epoch_times[0], 4),
        steady_images_per_s=round(steady_n / steady_t, 1) if steady_t > 0 else 0.0,
        images_per_s=round(total_n / total_t, 1) if total_t > 0 else 0.0,
        loader_cpu_s_per_batch=round(cpu_s / max(1, batches * len(epoch_times)), 6),
    )


def run_in_process(path: str, args: argparse.Namespace, on_batch: Callable[[], None]) -> RunResult:
    """Iterate ``beton_serve.loader.Loader`` here; ``on_batch`` is called after every batch."""
    from beton_serve.engine import OrderOption
    from beton_serve.format import BetonReader
    from beton_serve.loader import Loader

    with BetonReader(path) as reader:
        pipelines = build_pipelines(reader, args.pipeline, args.res)
    loader = Loader(
        path,
        batch_size=args.batch_size,
        num_workers=args.workers,
        order=OrderOption[args.order],
        seed=args.seed,
        pipelines=pipelines,
        drop_last=False,
    )
    times: list[float] = []
    counts: list[int] = []
    cpu0 = time.process_time()
    for _ in range(args.epochs):
        t0 = time.perf_counter()
        n = 0
        for batch in loader:
            n += len(batch[0])
            on_batch()
        times.append(time.perf_counter() - t0)
        counts.append(n)
    cpu = time.process_time() - cpu0
    close = getattr(loader, "close", None)
    if close is not None:
        close()
    return _summarise("in-process", times, counts, len(loader), cpu)


def _proc_cpu_s(pid: int) -> float:
    """utime + stime of a live process, in seconds (0.0 when it cannot be read)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _stop(proc: subprocess.Popen[Any]) -> int:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=_STOP_TIMEOUT_S)
    return int(proc.returncode)


@contextlib.contextmanager
def _daemon(path: str, workers: int, workdir: Path) -> Iterator[tuple[str, subprocess.Popen[Any]]]:
    from beton_serve.cli._health import check

    sock = workdir / "bench.sock"
    target = f"unix://{sock}"
    log = workdir / "daemon.log"
    with log.open("wb") as f:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-P",  # the working directory is not on sys.path
                "-c",
                "from beton_serve.cli import main; raise SystemExit(main())",
                "serve",
                path,
                "--socket",
                str(sock),
                "--workers",
                str(workers),
                "--log-level",
                "warning",
            ],
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while check(target, timeout=1.0) != "SERVING":
            if proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"the daemon did not start:\n{log.read_text()[-3000:]}")
        yield target, proc
    finally:
        status = _stop(proc)
        if status != 0:
            sys.stderr.write(f"bench: the daemon exited with status {status}\n")


def run_served(
    path: str, args: argparse.Namespace, workdir: Path, on_batch: Callable[[], None]
) -> RunResult:
    """Run the client process against a daemon (started here unless ``--server``)."""
    started = contextlib.nullcontext((args.server, None)) if args.server else None
    ctx = started if started is not None else _daemon(path, args.workers, workdir)
    with ctx as (target, daemon):
        cpu0 = _proc_cpu_s(daemon.pid) if daemon is not None else 0.0
        argv = [
            sys.executable,
            "-P",  # the working directory is not on sys.path
            "-m",
            "beton_serve.cli._bench_client",
            path,
            "--server",
            target,
            "--pipeline",
            args.pipeline,
            "--res",
            str(args.res),
            "--batch-size",
            str(args.batch_size),
            "--epochs",
            str(args.epochs),
            "--order",
            args.order,
            "--seed",
            str(args.seed),
        ]
        err = workdir / "client.log"
        result: dict[str, Any] | None = None
        with err.open("wb") as ferr:
            client = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=ferr
            )
            try:
                assert client.stdout is not None  # for mypy: stdout=PIPE
                for line in client.stdout:
                    if line.startswith(b"."):
                        on_batch()
                    elif line.startswith(b"{"):
                        result = json.loads(line)
            finally:
                status = _stop(client)
        if status != 0 or result is None:
            raise BenchError(f"the client exited with status {status}:\n{err.read_text()[-3000:]}")
        out = _summarise(
            "served",
            result["epoch_times"],
            result["epoch_images"],
            result["batches_per_epoch"],
            result["cpu_s"],
        )
        out["transport"] = result.get("transport")
        if daemon is not None:
            out["daemon_cpu_s"] = round(_proc_cpu_s(daemon.pid) - cpu0, 3)
            out["daemon_pid"] = daemon.pid
        return out


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand."""
    p = subparsers.add_parser(
        "bench",
        help="measure a dataset and pipeline in process and served",
        description=(__doc__ or "").split("\n\n", 1)[0],
    )
    p.add_argument("dataset", metavar="DATASET.beton")
    p.add_argument("--pipeline", choices=PIPELINES, default="decode")
    p.add_argument("--res", type=int, default=224, help="output size of crop decoders")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=2, help="the first one is reported apart")
    p.add_argument("--workers", type=int, default=0, help="worker threads (0: cores)")
    p.add_argument("--order", choices=("SEQUENTIAL", "RANDOM", "QUASI_RANDOM"), default="RANDOM")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server", default=None, help="use this daemon instead of starting one")
    p.add_argument(
        "--mode", choices=("both", "in-process", "served"), default="both", help="what to run"
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(func=run)
    return p


def _render(results: list[RunResult], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"{args.dataset}: pipeline {args.pipeline}, batch {args.batch_size}, "
        f"{args.epochs} epochs, order {args.order}"
    )
    for col in ("run", "images/s", "1st epoch s", "loader CPU ms/batch", "daemon CPU s"):
        table.add_column(col, justify="right" if col != "run" else "left")
    for r in results:
        name = r["mode"] + (f" ({r['transport']})" if r.get("transport") else "")
        table.add_row(
            name,
            f"{r['steady_images_per_s']:.0f}",
            f"{r['first_epoch_s']:.2f}",
            f"{1000 * r['loader_cpu_s_per_batch']:.2f}",
            f"{r['daemon_cpu_s']:.2f}" if "daemon_cpu_s" in r else "-",
        )
    console = Console()
    console.print(table)
    if len(results) == 2 and results[0]["steady_images_per_s"] > 0:
        ratio = results[1]["steady_images_per_s"] / results[0]["steady_images_per_s"]
        console.print(f"served / in-process throughput: {ratio:.2f}")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; returns the exit status."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from beton_serve.format import BetonReader

    if args.epochs < 1 or args.batch_size < 1:
        raise ConfigError("--epochs and --batch-size must be at least 1")
    path = os.path.abspath(args.dataset)
    with BetonReader(path) as reader:  # validates the file and the pipeline up front
        build_pipelines(reader, args.pipeline, args.res)
        n = reader.num_samples
    per_epoch = -(-n // args.batch_size)
    modes = ["in-process", "served"] if args.mode == "both" else [args.mode]
    results: list[RunResult] = []
    progress = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        transient=args.json,
        disable=args.json,
        redirect_stdout=False,
    )
    with progress, tempfile.TemporaryDirectory(prefix="beton-serve-bench-") as tmp:
        for mode in modes:
            task = progress.add_task(mode, total=per_epoch * args.epochs)

            def tick(task: Any = task) -> None:
                progress.advance(task)

            if mode == "in-process":
                results.append(run_in_process(path, args, tick))
            else:
                results.append(run_served(path, args, Path(tmp), tick))
    if args.json:
        payload: dict[str, Any] = {
            "dataset": path,
            "samples": n,
            "pipeline": args.pipeline,
            "batch_size": args.batch_size,
            "epochs": args.epochs,
            "order": args.order,
            "results": results,
        }
        if len(results) == 2 and results[0]["steady_images_per_s"] > 0:
            payload["served_over_in_process"] = round(
                results[1]["steady_images_per_s"] / results[0]["steady_images_per_s"], 4
            )
        sys.stdout.write(json.dumps(payload) + "\n")
    else:
        _render(results, args)
    return 0
