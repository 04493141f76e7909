"""Time to first batch of a NEW process (issue 14), side by side with FFCV 1.0.2.

    python benchmarks/bench_startup.py [--n 2000] [--repeats 3] [--batch 256] [--json]
                                       [--ffcv-python ../peers/ffcv-venv/bin/python] [--smoke]
                                       [--baseline-src DIR]

Pipeline: RandomResizedCropRGBImageDecoder((224, 224)), RandomHorizontalFlip, ToTensor,
ToTorchImage + IntDecoder, ToTensor; order RANDOM, ``num_workers=2``; the ImageNetLike dataset of
``synthetic.py`` (built once under benchmarks/_data/, as bench_loader.py does).

Each figure is one new Python process, timed from ``Popen`` until it holds its first batch
(interpreter start, imports, ``Loader()``, first batch); the child also reports its own split
(``import torch``, other imports, ``Loader()``, first batch). Rows:

* ``ffcv``: FFCV 1.0.2 (its own venv; it compiles in every process).
* ``inproc-cold``: our in-process Loader, empty compile cache (a fresh directory per run).
* ``inproc-warm``: the same, the compile cache filled by an earlier process.
* ``client-warm-daemon``: a new ``beton_client.Loader`` of a daemon that already served it.
* ``client-after-restart``: the first client of a daemon restarted with a warm cache.
* ``client-resume``: a client that is running when its daemon restarts (SIGTERM, then a new
  daemon on the same warm cache; the client's ``RetryPolicy(after_shutdown=True)``): seconds from
  the restart, and from the new socket appearing, to the client's next batch made after it.
  Its columns differ from the others': it is printed on its own line, and in ``--json`` it is
  ``client_resume``, beside ``results``.

``after torch`` subtracts the child's ``import torch``: a trainer has imported torch before it
builds a Loader, whichever loader it uses. The median of ``--repeats`` runs is reported.
``--baseline-src DIR`` adds ``inproc-baseline``: the in-process cold start of another checkout
of this project (``git worktree add DIR <commit>``; its ``proto/``, ``server/`` and ``client/``
first on ``PYTHONPATH``, its bytecode compiled as ours is, an empty cache directory per run),
run right after ``inproc-cold`` in the same way, so that "at most 0.5x today's" (issue 14 §2)
is a ratio in one run, not against a figure from another day; ``cold ÷ baseline`` is printed
below the table.
``--smoke`` runs one repeat of each at batch 32 (a quick check that the script works; not a
measurement).

Bytecode. A wheel installed by pip has its ``.pyc`` files compiled at install time, and so do
FFCV, torch and numba here. Our checkout is an editable install, and where ``PYTHONDONTWRITEBYTECODE``
is set (it is on these machines) every new process would compile our ~80 modules from source
again (about 0.15 s of the first batch). So the script first compiles our packages' bytecode once,
as an install would (``compileall``, into the checkout's ``__pycache__`` folders, which git
ignores); ``--source-only`` skips that step and times the editable checkout as it is.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

# The benchmark's pipeline, in every child (the names come from FFCV's or our imports).
_PIPES = """
pipes = {
    "image": [RandomResizedCropRGBImageDecoder((224, 224)), RandomHorizontalFlip(), ToTensor(),
              ToTorchImage()],
    "label": [IntDecoder(), ToTensor()],
}
"""

_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
mode, path, batch, server = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
import torch
t_torch = time.perf_counter()
if mode == "ffcv":
    from ffcv.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import RandomHorizontalFlip, ToTensor, ToTorchImage
    kw = {}
else:
    from beton_serve.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from beton_serve.transforms import RandomHorizontalFlip, ToTensor, ToTorchImage
    if mode == "client":
        from beton_client import Loader, OrderOption
        kw = {"server": server, "spawn": False}
    else:
        from beton_serve.loader import Loader, OrderOption
        kw = {}
t_imp = time.perf_counter()
@PIPES@ld = Loader(path, batch_size=batch, num_workers=2, order=OrderOption.RANDOM, seed=0,
            pipelines=pipes, **kw)
t_ld = time.perf_counter()
it = iter(ld)
img, label = next(it)
t_first = time.perf_counter()
print(json.dumps({"torch": t_torch - t0, "imports": t_imp - t_torch, "loader": t_ld - t_imp,
                  "first": t_first - t_ld, "in_child": t_first - t0}), flush=True)
sys.stdout.close()
import os
os._exit(0)  # the figure is taken; do not time (or hang in) worker shutdown
""".replace("@PIPES@", _PIPES.lstrip("\n"))


# A client that is running when its daemon restarts: it holds two batches, waits for "go" (sent
# when the daemon has been stopped), then reads on and prints the monotonic time of each batch
# (time.perf_counter is CLOCK_MONOTONIC, the parent's clock too). after_shutdown=True: the
# daemon is stopped with SIGTERM, as an operator restarting it would.
_RESUME = r"""
import json, sys, time
path, batch, server = sys.argv[1], int(sys.argv[2]), sys.argv[3]
import torch
from beton_client import Loader, OrderOption, RetryPolicy, ServeOptions
from beton_serve.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
from beton_serve.transforms import RandomHorizontalFlip, ToTensor, ToTorchImage
@PIPES@policy = RetryPolicy(budget_s=30.0, initial_s=0.02, max_s=0.1, after_shutdown=True)
ld = Loader(path, batch_size=batch, order=OrderOption.RANDOM, seed=0, pipelines=pipes,
            serve=ServeOptions(server=server, spawn=False, reconnect=policy))
it = iter(ld)
next(it); next(it)
print("READY", flush=True)
sys.stdin.readline()
stamps = [time.perf_counter() for _ in it]
print(json.dumps({"stamps": stamps}), flush=True)
sys.stdout.close()
import os
os._exit(0)
""".replace("@PIPES@", _PIPES.lstrip("\n"))


def _resume(daemon: _Daemon, path: Path, batch: int, server: str, env: dict) -> dict:
    """One restart under a running client: seconds from the restart (the new daemon's
    ``Popen``) and from its socket appearing to the client's next batch made after it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _RESUME, str(path), str(batch), server],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd="/tmp",
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        if proc.stdout.readline().strip() != "READY":
            raise RuntimeError(f"resume child failed: {proc.communicate(timeout=30)[1][-2000:]}")
        daemon.stop()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        time.sleep(0.3)  # the client drains what it holds and starts retrying
        t_restart = time.perf_counter()
        start_s = daemon.start()
        t_ready = t_restart + start_s
        stamps = json.loads(proc.stdout.readline())["stamps"]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
    after = [t for t in stamps if t > t_restart]
    if not after:
        raise RuntimeError("the client got no batch after the restart")
    return {
        "from_restart": after[0] - t_restart,
        "from_socket": after[0] - t_ready,
        "daemon_start": start_s,
        "before_restart": len(stamps) - len(after),
    }


def _child(python: str, mode: str, path: Path, batch: int, server: str, env: dict) -> dict:
    t = time.perf_counter()
    proc = subprocess.Popen(
        [python, "-c", _CHILD, mode, str(path), str(batch), server],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd="/tmp",  # nothing of the checkout shadows the installed packages
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    wall = time.perf_counter() - t
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    if not line:
        raise RuntimeError(f"{mode} child failed (rc {proc.returncode}): {err[-2000:]}")
    out = json.loads(line)
    out["wall"] = wall
    return out


class _Daemon:
    def __init__(self, path: Path, sock: Path, env: dict) -> None:
        self.path, self.sock, self.env = path, sock, env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        if self.sock.exists():
            self.sock.unlink()
        t = time.perf_counter()
        self.proc = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "beton-serve"),
                "serve",
                str(self.path),
                *("--socket", str(self.sock), "--workers", "2"),
            ],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd="/tmp",
        )
        while not self.sock.exists():
            if self.proc.poll() is not None or time.perf_counter() - t > 60:
                raise RuntimeError("the daemon did not start")
            time.sleep(0.02)
        return time.perf_counter() - t

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None


def compile_bytecode() -> list[str]:
    """Compile the bytecode of our installed packages once, as ``pip install`` does for a wheel.

    Returns the folders compiled. The children read the ``.pyc`` files even where
    ``PYTHONDONTWRITEBYTECODE`` stops them from writing any.
    """
    import compileall
    import importlib.util

    done = []
    for name in ("beton_serve", "beton_client", "beton_wire"):
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        for folder in spec.submodule_search_locations:
            compileall.compile_dir(folder, quiet=1)
            done.append(folder)
    return done


def _baseline(src: Path, path: Path, args: argparse.Namespace, env: dict, work: Path) -> dict:
    """``inproc-cold`` for the checkout at ``src`` (see the module docstring)."""
    import compileall

    src = src.resolve()
    folders = [src / "proto", src / "server", src / "client"]
    for folder in folders:
        if folder.is_dir():
            compileall.compile_dir(str(folder), quiet=1)
    pythonpath = os.pathsep.join(str(f) for f in folders if f.is_dir())
    runs = []
    for i in range(args.repeats):
        run_env = dict(env, PYTHONPATH=pythonpath, BETON_SERVE_CACHE_DIR=str(work / f"base-{i}"))
        runs.append(_child(sys.executable, "inproc", path, args.batch, "", run_env))
    out = _summary(runs)
    out["src"] = str(src)
    return out


def _summary(runs: list[dict]) -> dict:
    keys = ("wall", "torch", "imports", "loader", "first")
    med = {k: round(statistics.median(r[k] for r in runs), 3) for k in keys}
    med["after_torch"] = round(statistics.median(r["wall"] - r["torch"] for r in runs), 3)
    med["runs"] = [round(r["wall"], 3) for r in runs]
    return med


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=2000, help="ImageNetLike samples")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--ffcv-python", default=str(ROOT.parent / "peers" / "ffcv-venv" / "bin" / "python")
    )
    ap.add_argument("--skip-ffcv", action="store_true")
    ap.add_argument(
        "--baseline-src",
        type=Path,
        help="another checkout of this project: its in-process cold start, side by side",
    )
    ap.add_argument("--smoke", action="store_true", help="one repeat, batch 32: checks the script")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument(
        "--source-only",
        action="store_true",
        help="do not compile our packages' bytecode first (time the editable checkout as is)",
    )
    args = ap.parse_args()
    if args.baseline_src is not None and not (args.baseline_src / "server/beton_serve").is_dir():
        ap.error(f"--baseline-src {args.baseline_src}: no server/beton_serve there")
    if args.smoke:
        args.repeats, args.batch = 1, 32
    from bench_loader import build

    path = build("imagenet", args.n)
    bytecode = [] if args.source_only else compile_bytecode()
    work = Path(tempfile.mkdtemp(prefix="bs-startup-", dir="/tmp"))
    os.chmod(work, 0o700)
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("BETON_SERVE_")}
    results: dict[str, dict] = {}
    resume: dict = {}  # the client-resume row (its own columns), reported apart
    daemon = None
    try:
        if not args.skip_ffcv and Path(args.ffcv_python).exists():
            runs = [
                _child(args.ffcv_python, "ffcv", path, args.batch, "", base_env)
                for _ in range(args.repeats)
            ]
            results["ffcv"] = _summary(runs)
        cold = []
        for i in range(args.repeats):
            env = dict(base_env, BETON_SERVE_CACHE_DIR=str(work / f"cold-{i}"))
            cold.append(_child(sys.executable, "inproc", path, args.batch, "", env))
        results["inproc-cold"] = _summary(cold)
        if args.baseline_src is not None:
            results["inproc-baseline"] = _baseline(args.baseline_src, path, args, base_env, work)
        env = dict(base_env, BETON_SERVE_CACHE_DIR=str(work / "cold-0"))
        results["inproc-warm"] = _summary(
            [
                _child(sys.executable, "inproc", path, args.batch, "", env)
                for _ in range(args.repeats)
            ]
        )
        sock = work / "d" / "s.sock"
        sock.parent.mkdir(mode=0o700)
        server = f"unix://{sock}"
        daemon = _Daemon(path, sock, env)
        daemon.start()
        _child(sys.executable, "client", path, args.batch, server, base_env)  # the daemon plans
        results["client-warm-daemon"] = _summary(
            [
                _child(sys.executable, "client", path, args.batch, server, base_env)
                for _ in range(args.repeats)
            ]
        )
        restarted = []
        starts = []
        for _ in range(args.repeats):
            daemon.stop()
            starts.append(daemon.start())
            restarted.append(_child(sys.executable, "client", path, args.batch, server, base_env))
        results["client-after-restart"] = _summary(restarted)
        results["client-after-restart"]["daemon_start_s"] = round(statistics.median(starts), 3)
        resumes = [_resume(daemon, path, args.batch, server, base_env) for _ in range(args.repeats)]
        resume = {
            k: round(statistics.median(r[k] for r in resumes), 3)
            for k in ("from_restart", "from_socket", "daemon_start")
        }
        resume["runs"] = [round(r["from_restart"], 3) for r in resumes]
        resume["batches_before_restart"] = [r["before_restart"] for r in resumes]
    finally:
        if daemon is not None:
            daemon.stop()
        shutil.rmtree(work, ignore_errors=True)
    if "ffcv" in results:
        ref = results["ffcv"]["wall"]
        for r in results.values():
            r["x_ffcv"] = round(r["wall"] / ref, 3)
    report = {
        "dataset": path.name,
        "batch": args.batch,
        "repeats": args.repeats,
        "smoke": args.smoke,
        "bytecode_compiled": bytecode,
        "results": results,
        "client_resume": resume,
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(
        f"time to first batch, new process, {path.name}, batch {args.batch}, 2 workers, "
        f"median of {args.repeats}"
    )
    print(
        f"{'setup':<22}{'total s':>9}{'after torch':>13}{'torch':>7}{'imports':>9}"
        f"{'Loader()':>10}{'1st batch':>11}{'x FFCV':>8}"
    )
    for name, r in results.items():
        x = f"{r['x_ffcv']:.3f}" if "x_ffcv" in r else "-"
        print(
            f"{name:<22}{r['wall']:>9.2f}{r['after_torch']:>13.2f}{r['torch']:>7.2f}"
            f"{r['imports']:>9.2f}{r['loader']:>10.2f}{r['first']:>11.2f}{x:>8}"
        )
    if "inproc-baseline" in results:
        base = results["inproc-baseline"]
        print(
            f"cold ÷ baseline ({base['src']}): {results['inproc-cold']['wall'] / base['wall']:.3f}"
        )
    if resume:
        print(
            f"a running client, its daemon restarted (SIGTERM, then a new daemon, warm cache): "
            f"next batch {resume['from_restart']:.2f} s after the restart, "
            f"{resume['from_socket']:.2f} s after the new socket appeared (daemon start "
            f"{resume['daemon_start']:.2f} s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
