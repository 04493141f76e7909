"""SIGTERM or SIGINT while a client's stream is still opening (its plan compiling).

Found by a docs audit (session 50): ``Daemon.open_stream`` checked for a drain only when it
began. A stream whose plan was still compiling when SIGTERM came opened after the drain had
ended every stream, and its client, which never got the ``ShuttingDown`` status that
docs/operations.md promises, retried its whole budget against a daemon that was gone (7 of 12
tries with SIGTERM 2.6-3.3 s after the client started). Now the opening ends with
``ShuttingDown`` as soon as the drain starts, and the client raises ``ServerUnavailable``
naming it at once.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest
from beton_client import Loader, ServeOptions, ServerUnavailable
from helpers.daemon import daemon_factory, short_tmp  # noqa: F401

pytestmark = pytest.mark.timeout(90)

_SLOW_OP = '''
import pathlib
import time

from beton_serve.pipeline import Operation
from beton_serve.pipeline.registry import register_op


@register_op
class SlowToCompile(Operation):
    """An identity op whose code takes {sleep} s to generate (a long compile)."""

    spec_name = "SlowToCompile{tag}"

    def generate_code(self):
        pathlib.Path({marker!r}).touch()
        time.sleep({sleep})

        def same(x, dst):
            return x

        return same

    def declare_state_and_memory(self, previous_state):
        return previous_state, None

    def spec_params(self):
        return {{}}
'''


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_while_a_stream_opens_ends_it_with_shutting_down(
    sig: signal.Signals,
    daemon_factory,  # noqa: F811
    fixtures_dir: Path,
    short_tmp: Path,  # noqa: F811
    restore_op_registry,
) -> None:
    import uuid

    from beton_serve.cli._plugins import load_plugin
    from beton_serve.fields.decoders import IntDecoder

    tag = uuid.uuid4().hex[:8]
    marker = short_tmp / "compiling"
    plugin = short_tmp / "slow_op.py"
    plugin.write_text(_SLOW_OP.format(tag=tag, marker=str(marker), sleep=8))
    op_class = load_plugin(str(plugin)).SlowToCompile
    d = daemon_factory([fixtures_dir / "mixed_fields.beton"], args=["--plugin", str(plugin)])
    outcome: list[BaseException | None] = []

    def open_it() -> None:
        try:
            with Loader(
                "mixed_fields",
                batch_size=4,
                pipelines={"int": [IntDecoder(), op_class()]},
                serve=ServeOptions(server=d.address, spawn=False),
            ) as ld:
                next(iter(ld))
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    client = threading.Thread(target=open_it, daemon=True)
    client.start()
    deadline = time.monotonic() + 30
    while not marker.exists():  # the daemon is compiling the stream's plan
        assert time.monotonic() < deadline, d.log()[-3000:]
        time.sleep(0.05)
    t0 = time.monotonic()
    d.proc.send_signal(sig)
    client.join(20)
    assert not client.is_alive(), f"the client still waits 20 s after the {sig.name}"
    (exc,) = outcome
    assert isinstance(exc, ServerUnavailable), exc
    assert exc.server_error == "ShuttingDown", exc
    # It names the signal: it said "(SIGTERM)" for a Ctrl-C too (non-root audit).
    assert f"the daemon is shutting down ({sig.name})" in str(exc), exc
    assert time.monotonic() - t0 < 5, "ShuttingDown came only after the compile"
    assert d.proc.wait(30) == 0, d.log()[-3000:]
    assert "opened" not in d.log().split("draining", 1)[1]
    assert not d.shm_files(), d.shm_files()
