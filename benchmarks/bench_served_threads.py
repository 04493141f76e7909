"""Where served CIFAR-like batches cost more CPU than in-process ones: per thread, per batch.

    python benchmarks/bench_served_threads.py [--cifar-n 50000] [--epochs 10] [--rounds 2]
                                              [--calls]

The same loaders as ``bench_served.py`` part 1 (CIFAR-like raw 32x32 + flip, batch 512, RANDOM,
2 workers in process and in the daemon, ``--workers`` to change), taking turns in blocks of ``--epochs`` epochs after an
untimed one. Around each block it reads every thread's counters from ``/proc/PID/task``, of
this process and of the daemon, and prints per batch: CPU (user + system, ms), user CPU (ms),
voluntary and involuntary context switches, minor page faults. Threads of this process are
named after their Python names; the daemon's main thread (the event loop) is ``main``, the
others ``t1``, ``t2``, ... by CPU used.

``--calls`` also times two calls on the thread that makes them (``time.thread_time_ns``, CPU,
not wall): ``Plan.run`` (the decode and augmentation of one batch or slice, in both processes)
and the daemon's ``NoticePump._on_done`` (publish a finished batch, collect released slots,
submit the next), per call. The daemon is instrumented through a ``sitecustomize`` module put
first on its ``PYTHONPATH`` (it replaces any other ``sitecustomize``); each wrapper adds ~1 us.
``--more module:Class.method,...`` times more calls the same way (nested ones overlap), e.g.
``--more beton_serve.daemon._stream:Stream.finish,beton_serve.daemon._stream:Stream.submit``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

CLK = os.sysconf("SC_CLK_TCK")

#: Installed as the daemon's ``sitecustomize`` with ``--calls``: times the calls named in
#: ``CALLS`` and writes the totals to ``$BS_CALLS_OUT/<pid>.json`` on SIGUSR2.
_INSTRUMENT = textwrap.dedent(
    """
    import json, os, signal, threading, time
    CALLS = [("beton_serve.pipeline._plan", "Plan", "run"),
             ("beton_serve.daemon._pump", "NoticePump", "_on_done")]
    for spec in filter(None, os.environ.get("BS_CALLS_MORE", "").split(",")):
        module, _, qual = spec.partition(":")
        CALLS.append((module, *qual.split(".", 1)))
    TOTALS = {}

    def wrap(module, cls_name, name):
        import importlib
        cls = getattr(importlib.import_module(module), cls_name)
        fn = getattr(cls, name)
        key = cls_name + "." + name
        row = TOTALS.setdefault(key, [0, 0])

        def timed(*args, **kwargs):
            t0 = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                row[0] += time.thread_time_ns() - t0
                row[1] += 1

        setattr(cls, name, timed)

    def dump(*_):
        out = os.path.join(os.environ["BS_CALLS_OUT"], f"{os.getpid()}.json")
        with open(out + ".tmp", "w") as fh:
            json.dump(TOTALS, fh)
        os.replace(out + ".tmp", out)

    if os.environ.get("BS_CALLS_OUT"):
        for spec in CALLS:
            try:
                wrap(*spec)
            except Exception:
                pass
        signal.signal(signal.SIGUSR2, dump)
    """
)


def threads(pid: int) -> dict[int, tuple[float, float, int, int, int]]:
    """``{tid: (cpu s, user s, voluntary switches, involuntary switches, minor faults)}``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[-1].split()
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        vol = int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])
        invol = int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
        user, system = int(stat[11]) / CLK, int(stat[12]) / CLK
        out[int(tid)] = (user + system, user, vol, invol, int(stat[7]))
    return out


def per_batch(before: dict, after: dict, batches: int, names: dict[int, str]) -> dict[str, list]:
    """The counters' growth per batch, by thread name, busiest first; idle threads left out."""
    rows = {}
    for tid, now in after.items():
        was = before.get(tid, (0.0, 0.0, 0, 0, 0))
        d = [b - a for a, b in zip(was, now, strict=True)]
        if any(d):
            rows[tid] = [round(1000 * d[0] / batches, 3), round(1000 * d[1] / batches, 3)] + [
                round(x / batches, 2) for x in d[2:]
            ]
    ordered = sorted(rows.items(), key=lambda kv: -kv[1][0])
    return {names.get(tid, f"t{k + 1}"): row for k, (tid, row) in enumerate(ordered)}


def calls(pid: int, out_dir: Path) -> dict[str, list[int]]:
    """The daemon's call totals (``--calls``), asked for with SIGUSR2."""
    path = out_dir / f"{pid}.json"
    path.unlink(missing_ok=True)
    os.kill(pid, signal.SIGUSR2)
    for _ in range(300):
        if path.exists():
            return json.loads(path.read_text())  # type: ignore[no-any-return]
        time.sleep(0.01)
    return {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cifar-n", type=int, default=50000)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--calls", action="store_true")
    ap.add_argument("--more", default="", help="more calls to time: module:Class.method,...")
    args = ap.parse_args()

    from bench_loader import build, pipelines
    from beton_client import Loader as ServedLoader
    from beton_client import OrderOption as ServedOrder
    from beton_client import ServeOptions
    from beton_serve.loader import Loader as LocalLoader
    from beton_serve.loader import OrderOption as LocalOrder
    from helpers.daemon import start_daemon

    path = build("cifar", args.cifar_n)
    with tempfile.TemporaryDirectory(prefix="bs-", dir="/tmp") as tmp:
        tmpdir = Path(tmp)
        local_calls: dict[str, list[int]] = {}
        if args.calls:
            site = tmpdir / "site"
            site.mkdir()
            (site / "sitecustomize.py").write_text(_INSTRUMENT)
            os.environ["BS_CALLS_OUT"] = str(tmpdir)
            os.environ["BS_CALLS_MORE"] = args.more
            os.environ["PYTHONPATH"] = os.pathsep.join(
                [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
            )
            namespace: dict = {}
            exec(compile(_INSTRUMENT, "instrument", "exec"), namespace)  # this process too
            local_calls = namespace["TOTALS"]
        d = start_daemon([path], tmpdir, args=["--workers", str(args.workers)])
        try:
            local = LocalLoader(
                str(path),
                batch_size=512,
                order=LocalOrder.RANDOM,
                seed=0,
                pipelines=pipelines("cifar"),
                num_workers=args.workers,
            )
            served = ServedLoader(
                str(path),
                batch_size=512,
                order=ServedOrder.RANDOM,
                seed=0,
                pipelines=pipelines("cifar"),
                serve=ServeOptions(server=d.address),
            )
            batches = len(local) * args.epochs
            for rnd in range(args.rounds):
                for kind, ld in (("in_process", local), ("served", served)):
                    for _ in ld:  # untimed: the workers and the look-ahead settle
                        pass
                    time.sleep(0.3)
                    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id}
                    own0, dmn0 = threads(os.getpid()), threads(d.pid)
                    c_own0 = json.loads(json.dumps(local_calls))
                    c_dmn0 = calls(d.pid, tmpdir) if args.calls else {}
                    t0 = time.perf_counter()
                    for _ in range(args.epochs):
                        for _ in ld:
                            pass
                    wall = time.perf_counter() - t0
                    own1, dmn1 = threads(os.getpid()), threads(d.pid)
                    c_own1 = json.loads(json.dumps(local_calls))
                    c_dmn1 = calls(d.pid, tmpdir) if args.calls else {}
                    report = {
                        "round": rnd,
                        "loader": kind,
                        "img_s": round(args.cifar_n * args.epochs / wall),
                        "columns": ["cpu_ms", "user_ms", "vcs", "ivcs", "minflt"],
                        "this_process": per_batch(own0, own1, batches, names),
                    }
                    if kind == "served":
                        report["daemon"] = per_batch(dmn0, dmn1, batches, {d.pid: "main"})
                    if args.calls:
                        report["calls_us"] = {
                            where: {
                                k: round((v[0] - c0.get(k, [0, 0])[0]) / 1000 / n, 1)
                                for k, v in c1.items()
                                if (n := v[1] - c0.get(k, [0, 0])[1]) > 0
                            }
                            for where, c0, c1 in (
                                ("this_process", c_own0, c_own1),
                                ("daemon", c_dmn0, c_dmn1),
                            )
                        }
                        report["calls_per_batch"] = {
                            where: {
                                k: round((v[1] - c0.get(k, [0, 0])[1]) / batches, 2)
                                for k, v in c1.items()
                                if v[1] > c0.get(k, [0, 0])[1]
                            }
                            for where, c0, c1 in (
                                ("this_process", c_own0, c_own1),
                                ("daemon", c_dmn0, c_dmn1),
                            )
                        }
                    print(json.dumps(report), flush=True)
                    time.sleep(0.3)
            local.close()
            served.close()
        finally:
            d.stop(signal.SIGTERM)


if __name__ == "__main__":
    main()
