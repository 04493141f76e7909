"""SIGINT (Ctrl-C) to a serving daemon: its clients' ``ServerUnavailable`` names SIGINT.

Found by an audit: the ``ShuttingDown`` text was fixed to "(SIGTERM)", whatever the signal.
The stream is caught while it opens (its plan compiling), as in ``test_drain_open``, so that the
drain's error is what the client gets.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest
from beton_client import Loader, ServeOptions, ServerUnavailable
from helpers.daemon import daemon_factory, short_tmp  # noqa: F401

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]

_SLOW_OP = """
import pathlib
import time

from beton_serve.pipeline import Operation
from beton_serve.pipeline.registry import register_op


@register_op
class SlowToCompile(Operation):
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
"""


def test_sigint_names_sigint_to_the_client(
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
    plugin.write_text(_SLOW_OP.format(tag=tag, marker=str(marker), sleep=3))
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
    d.proc.send_signal(signal.SIGINT)
    client.join(20)
    assert not client.is_alive(), "the client still waits 20 s after the SIGINT"
    (exc,) = outcome
    assert isinstance(exc, ServerUnavailable), exc
    assert "the daemon is shutting down (SIGINT)" in str(exc), exc
    assert "SIGTERM" not in str(exc), exc
    assert d.proc.wait(30) == 0, d.log()[-3000:]
    assert not d.shm_files(), d.shm_files()
