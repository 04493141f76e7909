# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""Issue 11 §5: a file truncated under its mapping fails its own streams, never the process.

Reading a mapped page past a truncated file's new end raises SIGBUS, which used to kill the
daemon (every dataset's streams, segments left behind) in 4 of 5 tries with 512-px images. The
guard (``beton_serve.format._guard``) turns those reads into zeros that the batch's check reports
as ``FormatError`` (``DataError`` in the client).

* In process, deterministically: a file truncated after the Loader opened it (no size check runs
  in process, so every read past the end faults) raises ``FormatError`` and the process lives.
* A foreign SIGBUS (a mapping nobody guards) still kills, as before: the guard only chains.
* Served, under load: the file is truncated while 512-px batches are being decoded, 5 times;
  each time only that dataset's stream fails, with ``DataError``, and the daemon keeps serving
  the other dataset and frees every segment.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from beton_client import DataError
from beton_client import Loader as ServedLoader
from beton_serve.errors import FormatError
from beton_serve.fields import IntField, RGBImageField
from beton_serve.fields.decoders import IntDecoder, SimpleRGBImageDecoder
from beton_serve.loader import Loader as InProcessLoader
from beton_serve.transforms import ToTensor
from beton_serve.writer import DatasetWriter
from helpers.daemon import daemon_factory, short_tmp  # noqa: F401

SIDE = 512


class _Big:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        img = np.full((SIDE, SIDE, 3), i % 251, np.uint8)
        img[:: 7 + i % 5] = 255 - i % 251  # some texture, so that JPEGs differ
        return img, i


def _write(path: Path, n: int, mode: str) -> Path:
    DatasetWriter(
        str(path), {"image": RGBImageField(write_mode=mode, jpeg_quality=95), "label": IntField()}
    ).from_indexed_dataset(_Big(n))
    return path


def _pipes(tensor: bool) -> dict[str, list[object]]:
    tail = [ToTensor()] if tensor else []
    return {"image": [SimpleRGBImageDecoder(), *tail], "label": [IntDecoder(), *tail]}


def test_in_process_truncation_is_a_format_error_and_the_process_lives(tmp_path: Path) -> None:
    path = _write(tmp_path / "raw.beton", 24, "raw")
    loader = InProcessLoader(str(path), 8, pipelines=_pipes(False), num_workers=2)
    first = next(iter(loader))
    assert int(np.asarray(first[1]).reshape(-1)[0]) == 0
    os.truncate(path, 4096 * 3)  # inside the header's page: every sample is past the end
    with pytest.raises(FormatError, match="shrank while it was mapped"):
        for _ in loader:
            pass
    # It stays failed: the zero pages are not the file.
    with pytest.raises(FormatError, match="shrank"):
        for _ in loader:
            pass


def test_a_fault_on_an_unguarded_mapping_still_kills(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import mmap, os, numpy as np
        from beton_serve.format import BetonReader
        from beton_serve.fields import IntField
        from beton_serve.writer import DatasetWriter
        class D:
            def __len__(self): return 4
            def __getitem__(self, i): return (i,)
        DatasetWriter({str(tmp_path / "x.beton")!r}, {{"label": IntField()}}).from_indexed_dataset(D())
        r = BetonReader({str(tmp_path / "x.beton")!r})  # installs the guard
        p = {str(tmp_path / "foreign.bin")!r}
        with open(p, "wb") as f:
            f.write(b"x" * (1 << 20))
        f = open(p, "rb")
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        os.truncate(p, 0)
        print(m[1 << 19])  # SIGBUS, not ours
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -7, (proc.returncode, proc.stderr.decode()[-2000:])  # SIGBUS


def test_importing_the_handler_out_of_turn_is_an_import_error_not_an_abort() -> None:
    """The handler links to two symbols the guard registers first; imported on its own (as a
    documentation tool importing every module would), it used to abort the process with
    "LLVM ERROR: Symbol not found". It must raise ImportError, and the guard must still work
    afterwards in the same process."""
    script = textwrap.dedent(
        """
        import mmap
        try:
            import beton_serve.format._guard_handler
        except ImportError as exc:
            print("ImportError", "import beton_serve.format instead" in str(exc))
        from beton_serve.format import _guard
        m = mmap.mmap(-1, mmap.PAGESIZE)
        print("guarded", _guard._the_guard() is not None, _guard._FAILED)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr.decode()[-2000:])
    assert proc.stdout.decode().split("\n")[:2] == ["ImportError True", "guarded True None"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_truncating_a_served_file_mid_decode_fails_only_its_streams(
    daemon_factory, short_tmp: Path
) -> None:
    master = _write(short_tmp / "master.beton", 160, "jpg")  # 10 batches; 3 fit the ring
    other = _write(short_tmp / "other.beton", 8, "raw")
    for attempt in range(5):
        victim = short_tmp / f"victim{attempt}.beton"
        victim.write_bytes(master.read_bytes())
        d = daemon_factory([victim, other])
        ld = ServedLoader(
            str(victim), 16, pipelines=_pipes(True), server=d.address, spawn=False, batches_ahead=2
        )
        try:
            it = iter(ld)
            next(it)
            # Mid-decode: the daemon is decoding the next batches of 16 512-px JPEGs right now.
            time.sleep(0.01 * attempt)
            os.truncate(victim, victim.stat().st_size // 3)
            with pytest.raises(DataError, match="shrank"):
                for _ in it:
                    pass
        finally:
            ld.close()
        assert d.proc.poll() is None, d.log()[-3000:]
        # The other dataset still serves, with the right contents.
        ok = ServedLoader(str(other), 4, pipelines=_pipes(True), server=d.address, spawn=False)
        try:
            labels = np.concatenate([np.asarray(y).reshape(-1) for _, y in ok])
            assert labels.tolist() == list(range(8))
        finally:
            ok.close()
        assert d.stop() == 0
        assert not d.shm_files(), d.shm_files()


@pytest.mark.timeout(30)
def test_a_mappings_finalizer_never_waits_for_the_guards_lock() -> None:
    """A mapping's finalizer frees its row (``Region.close``). The garbage collector may run it
    inside ``_Guard.add``'s locked section on the same thread, and that lock is not reentrant:
    freeing a row must not take it."""
    import threading

    from beton_serve.format import _guard

    g = _guard._the_guard()
    if g is None:
        pytest.skip(f"no SIGBUS guard here: {_guard._FAILED}")
    row = g.add(0x1000, 0x2000)
    assert row is not None
    region = _guard.Region(g, row)
    freed = threading.Event()

    def collector_inside_add() -> None:
        with g.lock:  # as if the collector ran the finalizer here
            region.close()
            freed.set()

    threading.Thread(target=collector_inside_add, daemon=True).start()
    assert freed.wait(5), "Region.close blocked on the guard's own lock"
    assert list(g.table[row]) == [0, 0, 0, 0]
    again = g.add(0x3000, 0x4000)  # the lock was released: the table still works
    assert again is not None
    g.remove(again)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_health_says_not_serving_once_every_dataset_is_refused(
    daemon_factory, fixtures_dir: Path, short_tmp: Path
) -> None:
    """A served file written to makes its dataset refused until a restart; with every dataset
    refused, ``beton-serve health`` still said SERVING, so no health check restarted the daemon.
    Now the daemon looks at its files every 2 s and says NOT_SERVING."""
    import shutil

    from beton_serve.cli import main
    from beton_serve.cli._health import EXIT_NOT_SERVING, EXIT_SERVING

    data = short_tmp / "z.beton"
    shutil.copy(fixtures_dir / "mixed_fields.beton", data)
    d = daemon_factory([data])
    target = "unix://" + d.socket
    assert main(["health", "--server", target, "--timeout", "5"]) == EXIT_SERVING
    os.utime(data, ns=(time.time_ns(), time.time_ns() + 10**9))  # `touch`: written to
    deadline = time.monotonic() + 20
    while main(["health", "--server", target, "--timeout", "5"]) != EXIT_NOT_SERVING:
        assert time.monotonic() < deadline, "still SERVING 20 s after its only file changed"
        time.sleep(0.5)
    assert "every dataset served from the start is refused" in d.log()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_refused_dataset_shows_in_status_stats_and_metrics(
    daemon_factory, fixtures_dir: Path, short_tmp: Path, capsys: pytest.CaptureFixture
) -> None:
    """With one dataset of two refused (its file written to), the daemon rightly stays SERVING,
    and nothing said which dataset was gone: ``status`` listed it like the other. Now
    ``status`` names it and why, the Stats reply carries the reason, and
    ``beton_dataset_refused`` is 1 for it and 0 for the other."""
    import json
    import re
    import shutil
    import urllib.request

    from beton_serve.cli import main
    from beton_serve.cli._health import EXIT_NOT_SERVING, EXIT_SERVING

    good, bad = short_tmp / "good.beton", short_tmp / "bad.beton"
    for p in (good, bad):
        shutil.copy(fixtures_dir / "mixed_fields.beton", p)
    d = daemon_factory([good, bad], args=["--workers", "1", "--metrics-port", "0"])
    sock = d.socket
    capsys.readouterr()
    assert main(["status", "--socket", sock, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["refused"] == {}
    os.utime(bad, ns=(time.time_ns(), time.time_ns() + 10**9))  # `touch`: written to
    deadline = time.monotonic() + 20
    while True:
        assert main(["status", "--socket", sock, "--json"]) == 0
        refused = json.loads(capsys.readouterr().out)["refused"]
        if refused:
            break
        assert time.monotonic() < deadline, "not refused 20 s after its file changed"
        time.sleep(0.5)
    assert list(refused) == ["bad"]
    assert str(bad) in refused["bad"] and "was written to" in refused["bad"]
    assert main(["status", "--socket", sock]) == 0
    out = capsys.readouterr().out
    assert "REFUSED   bad until a restart:" in out and "good" not in out.split("REFUSED")[1]
    assert main(["health", "--server", "unix://" + sock, "--timeout", "5"]) == EXIT_SERVING
    # Each dataset's own health service (checked every 2 s, as the files are).
    deadline = time.monotonic() + 20
    while main(["health", "--server", "unix://" + sock, "--dataset", "bad"]) != EXIT_NOT_SERVING:
        assert time.monotonic() < deadline, "dataset/bad still SERVING 20 s after it was refused"
        time.sleep(0.5)
    assert main(["health", "--server", "unix://" + sock, "--dataset", "good"]) == EXIT_SERVING
    assert "health dataset/bad NOT_SERVING" in d.log()
    url = re.search(r'metrics url=([^\s"]+)', d.log())
    assert url, d.log()
    with urllib.request.urlopen(url.group(1), timeout=10) as resp:
        text = resp.read().decode()
    assert 'beton_dataset_refused{dataset="bad"} 1.0' in text
    assert 'beton_dataset_refused{dataset="good"} 0.0' in text
