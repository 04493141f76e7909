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


def test_in_process_loader_imports_the_front_end_without_the_served_client() -> None:
    """``beton_serve.loader`` is the front end over the engine: no grpc, no served Loader."""
    code = (
        "import sys, beton_serve.loader\n"
        "heavy = sorted(m for m in ('grpc', 'torch', 'beton_client._loader') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_both_loaders_are_the_one_front_end() -> None:
    import beton_client
    from beton_client.frontend import EpochIterator, FrontEnd
    from beton_serve.loader import EpochIterator as ServeEpochIterator
    from beton_serve.loader import Loader as InProcessLoader

    assert issubclass(beton_client.Loader, FrontEnd) and issubclass(InProcessLoader, FrontEnd)
    assert ServeEpochIterator is EpochIterator
    # One implementation of each behaviour: neither Loader overrides the front end's.
    for name in ("__iter__", "state_dict", "load_state_dict", "__len__", "close"):
        assert name not in vars(beton_client.Loader) and name not in vars(InProcessLoader), name
