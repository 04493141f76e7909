"""Running a fresh Python process on this checkout, for tests that need one (a cold or warm
compile cache, RSS of a clean process, what happens at interpreter exit)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def child_env(**extra: str) -> dict[str, str]:
    """This environment, the checkout's packages first on ``PYTHONPATH``, plus ``extra``."""
    env = dict(os.environ, **extra)
    paths = [str(ROOT / "server"), str(ROOT / "client"), str(ROOT / "proto")]
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    return env


def run_child(
    script: str, *args: str, env: dict[str, str], timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """``python -c script args...``; fails the test (with its stderr) unless it exits 0."""
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stderr[-3000:]}"
    return proc


def run_json(script: str, *args: str, env: dict[str, str], timeout: float = 240) -> Any:
    """:func:`run_child`, then the JSON object on its last line of output."""
    out = run_child(script, *args, env=env, timeout=timeout).stdout
    return json.loads(out.strip().splitlines()[-1])
