"""Where the daemon's engine workers spend their time serving the CIFAR-like stream: py-spy.

    python benchmarks/profile_served_daemon.py [--seconds 8] [--rate 2000] [--under NAME]

Starts a daemon (2 workers) over ``bench_loader.py``'s CIFAR-like file, reads
``bench_served.py``'s pipeline (raw 32x32 + flip, batch 512, RANDOM) from one shm client for
``--seconds``, and samples the daemon with ``py-spy record --threads --nonblocking`` (py-spy
must be installed: ``pip install py-spy``; it needs ptrace permission on the daemon). Prints the
share of the workers' samples in each function (inclusive), then, under ``--under`` (default
``NoticePump._on_done``, the publish-and-refill path), the share of each project line that was
the innermost one (issue 15 §3; RESULTS, session 36). Samples include time waiting for the GIL.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))


def report(raw: Path, under: str, top: int = 30) -> None:
    """Print inclusive shares per function and innermost-line shares under ``under``."""
    total = 0
    incl: collections.Counter[str] = collections.Counter()
    lines: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if len(frames) < 2 or "worker" not in frames[0] or not count.isdigit():
            continue  # another thread's, or a line py-spy wrote that is not a sample
        n = int(count)
        total += n
        names = [re.sub(r" \(.*?\)$", "", f) for f in frames[1:]]
        for name in set(names):
            incl[name] += n
        if under in names:
            for f in reversed(frames[1 + names.index(under) :]):
                if "beton_" in f:
                    lines[f] += n
                    break
    if not total:
        print("no worker samples (is py-spy allowed to trace the daemon?)")
        return
    print(f"worker samples: {total}")
    for name, n in incl.most_common(top):
        print(f"{100 * n / total:6.1f}%  {name}")
    print(f"--- innermost project line under {under}")
    for name, n in lines.most_common(top):
        print(f"{100 * n / total:6.2f}%  {name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rate", type=int, default=2000)
    ap.add_argument("--under", default="NoticePump._on_done")
    args = ap.parse_args()

    from bench_loader import build, pipelines
    from beton_client import Loader, OrderOption, ServeOptions
    from helpers.daemon import start_daemon

    path = build("cifar", 50000)
    with tempfile.TemporaryDirectory(prefix="bs-", dir="/tmp") as tmp:
        raw = Path(tmp) / "daemon.raw"
        d = start_daemon([path], Path(tmp), args=["--workers", "2"])
        try:
            ld = Loader(
                str(path),
                batch_size=512,
                order=OrderOption.RANDOM,
                seed=0,
                pipelines=pipelines("cifar"),
                serve=ServeOptions(server=d.address),
            )
            with ld:
                for _ in ld:  # warm-up epoch
                    pass
                cmd = ["py-spy", "record", "-p", str(d.pid), "-r", str(args.rate)]
                cmd += ["-d", str(int(args.seconds)), "-f", "raw", "-o", str(raw)]
                cmd += ["--threads", "--nonblocking"]
                spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                try:
                    t0 = time.monotonic()
                    while time.monotonic() - t0 < args.seconds + 1.5:
                        for _ in ld:
                            pass
                    _, err = spy.communicate(timeout=60)
                finally:
                    if spy.poll() is None:
                        spy.kill()
                        spy.wait()
            if spy.returncode != 0 or not raw.exists():
                print(f"py-spy failed ({spy.returncode}): {err.decode(errors='replace')[-500:]}")
                return
            report(raw, args.under)
        finally:
            d.stop()


if __name__ == "__main__":
    main()
