"""The README's two Quick start commands work, verbatim, in a fresh virtual environment.

What "verbatim" means here: the two fenced ``bash`` blocks of the README's "Quick start" section
are read from README.md at test time and run unchanged with ``bash -c``, in a temporary copy of
the repository (the tracked and untracked-but-not-ignored files, as a fresh clone plus local
edits would have; no ``.venv``, no build outputs). Each command creates its own ``.venv`` there,
so each starts from nothing but the system's Python 3.11, as on a fresh machine. The environment
is the machine's, minus anything that points at this test run's own virtual environment
(``VIRTUAL_ENV``, its ``bin`` on ``PATH``, ``PYTHONPATH``). ``pip`` needs PyPI (or the machine's
configured package index), which CI and developer machines have.

Avoiding recursion in the test command: the README's test command is ``... && python -m pytest``,
the whole suite, which contains this test. It is run unchanged, with ``PYTEST_ADDOPTS`` set to
``-k test_guard -p no:cacheprovider`` in its environment. pytest reads that variable as if
the options were on its command line, so the command text is still exactly the README's, pytest
still *collects* every test module (a fresh environment that cannot import one fails
collection, and so this test), but it runs only the resource-guard tests, not this test and not
the rest of the suite, which CI runs directly anyway. The alternative, a marker or an env var
that the README command itself would have to mention, would change the command users copy.

Both commands take minutes (mostly ``pip install``), hence ``slow`` and a long timeout.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def quick_start_commands(readme: str) -> list[str]:
    """The fenced ``bash`` blocks of the "Quick start" section, in order."""
    m = re.search(r"^## Quick start\n(.*?)(?=^## )", readme, flags=re.S | re.M)
    if m is None:
        raise AssertionError("README.md has no '## Quick start' section")
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", m.group(1), flags=re.S)]


def test_readme_has_two_quick_start_commands() -> None:
    commands = quick_start_commands(README.read_text())
    assert len(commands) == 2
    demo, tests = commands
    assert "\n" not in demo and "\n" not in tests  # one line each, copy-pasteable
    assert demo.startswith("python3 -m venv .venv") and demo.endswith("beton-serve demo")
    assert tests.startswith("python3 -m venv .venv") and tests.endswith("python -m pytest")


def _repo_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    return [f for f in out.decode().split("\0") if f and (ROOT / f).is_file()]


def _copy_repo(dest: Path) -> None:
    for rel in _repo_files():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target)


def _fresh_env() -> dict[str, str]:
    env = dict(os.environ)
    for key in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTEST_ADDOPTS", "BETON_SERVE_ADDRESS"):
        env.pop(key, None)
    own_bin = str(Path(sys.prefix) / "bin")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != own_bin)
    return env


def _run(command: str, cwd: Path, env: dict[str, str], timeout: float) -> str:
    """Run ``command`` with bash; returns its stdout (stderr is shown only on failure)."""
    proc = subprocess.run(
        ["bash", "-c", command],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, (
        f"`{command}` exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
    return proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_readme_commands_run_verbatim_in_a_fresh_venv(tmp_path: Path) -> None:
    if shutil.which("python3", path=_fresh_env()["PATH"]) is None:
        pytest.skip("no python3 on PATH outside this virtual environment")
    demo, tests = quick_start_commands(README.read_text())
    repo = tmp_path / "beton-serve"
    _copy_repo(repo)
    assert not (repo / ".venv").exists()

    out = _run(demo, repo, _fresh_env(), timeout=700)
    # The demo reports both trainers' throughput and data-stall time, and cleans up.
    assert re.search(r"trainer 0\b.*images/s", out), out[-3000:]
    assert re.search(r"trainer 1\b.*images/s", out), out[-3000:]
    assert "stall" in out
    pid = re.search(r"daemon pid (\d+) serving", out)
    assert pid is not None, out[-3000:]
    assert not list(Path("/dev/shm").glob(f"beton-{pid.group(1)}-*")), "shared memory left behind"

    shutil.rmtree(repo / ".venv")  # the test command starts from nothing too
    env = _fresh_env()
    env["PYTEST_ADDOPTS"] = "-k test_guard -p no:cacheprovider"
    out = _run(tests, repo, env, timeout=700)
    # pytest's closing line, e.g. "3 passed, 412 deselected in 9.81s": some ran, none failed.
    summary = [ln for ln in out.splitlines() if re.search(r"\b\d+ passed\b", ln)]
    assert summary, out[-3000:]
    assert not re.search(r"\b(failed|error|errors)\b", summary[-1]), out[-3000:]
