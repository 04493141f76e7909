"""``import beton_client`` stays light: no numba, cv2 or torch (checked in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys


def test_import_beton_client_does_not_import_heavy_modules() -> None:
    code = (
        "import sys, beton_client\n"
        "from beton_client import Loader, OrderOption, SpecError, ServerUnavailable, TransportError\n"
        "heavy = sorted(m for m in ('numba', 'cv2', 'torch', 'beton_serve') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_public_api() -> None:
    import beton_client

    assert {"Loader", "OrderOption", "SpecError", "ServerUnavailable", "TransportError"} <= set(
        beton_client.__all__
    )
    assert [o.name for o in beton_client.OrderOption] == ["SEQUENTIAL", "RANDOM", "QUASI_RANDOM"]
    assert issubclass(beton_client.SpecError, ValueError)
    assert issubclass(beton_client.ServerUnavailable, ConnectionError)
