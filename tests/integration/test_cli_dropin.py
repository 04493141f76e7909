# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""Issue 13 §4 and the ``--plugin`` points of §2: the ``beton-serve`` command line as a drop-in.

* Options before, after and between the dataset files; subcommands keep working; ``--version``.
* ``--plugin`` takes a module name or a file path (imported under a unique name, no PYTHONPATH),
  anywhere in the arguments, repeatable; the TOML ``plugins`` key; clear ``ConfigError``s. A
  daemon started with a plugin file serves its op bit for bit like the in-process Loader.
* ``--listen`` adds TCP and keeps the per-user Unix socket: a local ``Loader(path)`` finds the
  daemon there and spawns none. ``--no-socket`` serves TCP only.
* ``beton-serve status`` (exit 0 running, 3 not) and ``beton-serve stop`` (exit 0, also when not
  running), with the default socket and with ``--socket``.
* A client that exits, closing its Loader or not, is not a WARNING in the daemon's log.
* A clean stop (SIGTERM, ``stop``, idle exit of an auto-spawned daemon) leaves nothing in the
  socket directory; a spawned daemon that failed leaves only its log, which says why.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from beton_serve import __version__
from beton_serve.cli import main, parse_args
from beton_serve.cli._plugins import load_plugin, load_plugins, plugin_module_name
from beton_serve.cli._serve import _plugin_specs
from beton_serve.cli.config import load_config
from beton_serve.errors import ConfigError
from beton_serve.fields.decoders import IntDecoder, NDArrayDecoder
from beton_serve.loader import Loader as InProcessLoader
from helpers.daemon import (  # noqa: F401  (fixtures)
    daemon_factory,
    daemons_serving,
    free_port,
    short_tmp,
    wait_for,
    wait_until_serving,
)
from helpers.labelled import write_labelled


@pytest.fixture(autouse=True)
def _registry_restored(restore_op_registry):
    """Every test here may import plugins: the registry is restored after each (conftest)."""
    yield


_LAUNCH = "import sys; from beton_serve.cli import main; sys.exit(main())"
BATCH = 10


# -- argument order ------------------------------------------------------------------------


def test_options_work_before_after_and_between_the_files(capsys: pytest.CaptureFixture) -> None:
    a = parse_args(["--workers", "2", "train.beton"])
    assert (a.command, a.files, a.workers) == ("serve", ["train.beton"], 2)
    a = parse_args(["train.beton", "--workers", "2", "val.beton"])
    assert (a.files, a.workers) == (["train.beton", "val.beton"], 2)
    a = parse_args(["--plugin", "m", "f.beton"])
    assert (a.files, a.plugin) == (["f.beton"], ["m"])
    a = parse_args(["a.beton", "--plugin", "m", "b.beton", "--plugin", "x/ops.py", "--no-share"])
    assert (a.files, a.plugin, a.no_share) == (["a.beton", "b.beton"], ["m", "x/ops.py"], True)
    a = parse_args(["serve", "--listen", "127.0.0.1:1", "a.beton", "--no-socket"])
    assert (a.files, a.listen, a.no_socket) == (["a.beton"], ["127.0.0.1:1"], True)
    # Subcommands keep working, their options in any order too.
    assert parse_args(["inspect", "x.beton", "--json"]).json is True
    a = parse_args(["inspect", "--json", "x.beton"])
    assert (a.command, a.json) == ("inspect", True)
    assert parse_args(["health", "--server", "unix:///x.sock"]).server == "unix:///x.sock"
    assert parse_args(["stats", "--json"]).json is True
    assert parse_args(["status", "--socket", "/x.sock"]).socket == "/x.sock"
    assert parse_args(["stop", "--timeout", "1"]).timeout == 1.0
    a = parse_args(["convert", "imagefolder", "DIR", "OUT.beton", "--jpeg-quality", "80"])
    assert (a.command, a.source, a.dir, a.out, a.jpeg_quality) == (
        "convert",
        "imagefolder",
        "DIR",
        "OUT.beton",
        80,
    )
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"beton-serve {__version__}"
    assert main(["--workers"]) == 2  # a usage error is still one
    assert main([]) == 2


# -- plugins -------------------------------------------------------------------------------

_OP = '''
from beton_serve.pipeline import Operation
from beton_serve.pipeline.compiler import Compiler
from beton_serve.pipeline.registry import register_op

RUNS = globals().get("RUNS", 0) + 1


@register_op
class AddOffset(Operation):
    """vec + offset, in place (a Numba-stage op, before ToTensor)."""

    spec_name = "{name}"

    def __init__(self, offset: float = 1000.0) -> None:
        super().__init__()
        self.offset = offset

    def generate_code(self):
        my_range = Compiler.get_iterator()
        off = self.offset

        def add(x, dst):
            for i in my_range(x.shape[0]):
                x[i] += off
            return x

        return add

    def declare_state_and_memory(self, previous_state):
        return previous_state, None

    def spec_params(self):
        return {{"offset": self.offset}}
'''


def _write_op(path: Path, name: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_OP.format(name=name))
    return path


def test_plugin_takes_a_module_name_or_a_file_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from beton_serve.pipeline.registry import registered_ops

    tag = uuid.uuid4().hex[:8]
    # Two files called ops.py in two directories: two modules, no collision, no PYTHONPATH.
    a = _write_op(tmp_path / "a" / "ops.py", f"DropinA{tag}")
    b = _write_op(tmp_path / "b" / "ops.py", f"DropinB{tag}")
    mods = load_plugins([str(a), str(b)])
    assert [m.__name__ for m in mods] == [plugin_module_name(str(a)), plugin_module_name(str(b))]
    assert mods[0].__name__ != mods[1].__name__
    assert {f"DropinA{tag}", f"DropinB{tag}"} <= set(registered_ops())
    assert load_plugin(str(a)) is mods[0] and mods[0].RUNS == 1  # imported once
    # A package directory, whose modules import each other relatively.
    pkg = tmp_path / "pkg"
    _write_op(pkg / "_impl.py", f"DropinPkg{tag}")
    (pkg / "__init__.py").write_text("from ._impl import AddOffset\n")
    assert load_plugin(str(pkg)).AddOffset.spec_name == f"DropinPkg{tag}"
    # A module name, from sys.path.
    _write_op(tmp_path / "mods" / f"dropin_mod_{tag}.py", f"DropinMod{tag}")
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    assert load_plugin(f"dropin_mod_{tag}").AddOffset.spec_name == f"DropinMod{tag}"
    # The TOML key: a relative path is relative to the config file.
    _write_op(tmp_path / "conf" / "my_ops.py", f"DropinToml{tag}")
    (tmp_path / "conf" / "d.toml").write_text('plugins = ["my_ops.py", "json"]\n')
    cfg = load_config(tmp_path / "conf" / "d.toml")
    load_plugins(_plugin_specs(cfg.plugins, str(tmp_path / "conf" / "d.toml")))
    assert f"DropinToml{tag}" in registered_ops()


def test_plugin_errors_are_clear_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file or directory"):
        load_plugin(str(tmp_path / "missing.py"))
    with pytest.raises(ConfigError, match=r"no module named 'no_such_plugin_mod'.*file's path"):
        load_plugin("no_such_plugin_mod")
    with pytest.raises(ConfigError, match="not a module name"):
        load_plugin("two words")
    boom = tmp_path / "boom.py"
    boom.write_text("x = 1\nraise RuntimeError('boom at import')\n")
    with pytest.raises(ConfigError, match=r"raised RuntimeError: boom at import \(.*boom.py:2\)"):
        load_plugin(str(boom))
    bad = tmp_path / "bad.py"
    bad.write_text("def f(:\n")
    with pytest.raises(ConfigError, match=r"SyntaxError.*bad.py:1"):
        load_plugin(str(bad))
    (tmp_path / "d").mkdir()
    with pytest.raises(ConfigError, match=r"without an __init__\.py"):
        load_plugin(str(tmp_path / "d"))
    # The command line reports it as an error, exit status 1, before binding anything.
    assert main(["--plugin", str(tmp_path / "missing.py"), "x.beton", "--no-socket"]) == 1


@pytest.mark.slow
def test_a_plugin_file_serves_its_op_bit_for_bit(daemon_factory, short_tmp: Path) -> None:
    from beton_client import Loader as ServedLoader

    tag = uuid.uuid4().hex[:8]
    op_file = _write_op(short_tmp / "plug" / "ops.py", f"DropinServed{tag}")
    data = write_labelled(short_tmp / "data" / "rows.beton", 40, 0)
    # The plugin after the file, no PYTHONPATH.
    d = daemon_factory([data], args=["--plugin", str(op_file)])
    add_offset = load_plugin(str(op_file)).AddOffset
    pipes = {"vec": [NDArrayDecoder(), add_offset(250.0)], "label": [IntDecoder()]}
    want = [
        tuple(np.array(x, copy=True) for x in b)
        for b in InProcessLoader(str(data), BATCH, pipelines=pipes)
    ]
    with ServedLoader(str(data), BATCH, pipelines=pipes, server=d.address, spawn=False) as ld:
        got = [tuple(np.array(x, copy=True) for x in b) for b in ld]
    assert len(got) == len(want) == 4
    for (gv, gy), (wv, wy) in zip(got, want, strict=True):
        np.testing.assert_array_equal(gv, wv)
        np.testing.assert_array_equal(gy.reshape(-1), wy.reshape(-1))
    assert float(got[0][0][0, 0]) == 250.0  # the op ran: sample 0's vec is 0 + 250
    assert f"plugin {op_file}: imported as {plugin_module_name(str(op_file))}" in d.log()


# -- the per-user daemon: --listen, status, stop, clean files ------------------------------


def _env(runtime: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BETON_SERVE_")}
    env["XDG_RUNTIME_DIR"] = str(runtime)
    return env


def _launch(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as f:
        return subprocess.Popen(
            [sys.executable, "-c", _LAUNCH, *args],
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )


def _stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return int(proc.returncode)


def _rows(loader) -> list[tuple[np.ndarray, ...]]:
    return [tuple(np.array(x, copy=True).reshape(len(b[0]), -1) for x in b) for b in loader]


@pytest.mark.slow
def test_listen_keeps_the_per_user_socket_then_status_and_stop(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from beton_client import Loader as ServedLoader
    from beton_wire.address import default_socket_path

    runtime = short_tmp / "run"
    runtime.mkdir(mode=0o700)
    env = _env(runtime)
    sock = default_socket_path(env)
    data = write_labelled(short_tmp / "rows.beton", 30, 100)
    port = free_port()
    log = short_tmp / "daemon.log"
    # Options first, the file last: `beton-serve --workers 2 --listen ... FILE`.
    proc = _launch(["--workers", "2", "--listen", f"127.0.0.1:{port}", str(data)], env, log)
    try:
        wait_until_serving("unix://" + sock, proc, 30)
        wait_until_serving(f"127.0.0.1:{port}", proc, 10)
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
        for k in [k for k in os.environ if k.startswith("BETON_SERVE_")]:
            monkeypatch.delenv(k)
        assert main(["status", "--json"]) == 0
        st = json.loads(capsys.readouterr().out)
        assert st["running"] and st["pid"] == proc.pid and st["address"] == "unix://" + sock
        assert st["datasets"] == ["rows"] and st["streams"] == 0 and st["uptime_s"] > 0

        pipes = {"vec": [NDArrayDecoder()], "label": [IntDecoder()]}
        want = _rows(InProcessLoader(str(data), BATCH, pipelines=pipes))
        with ServedLoader(str(data), BATCH, pipelines=pipes) as ld:  # finds the default socket
            local = _rows(ld)
        with ServedLoader("rows", BATCH, pipelines=pipes, server=f"127.0.0.1:{port}") as ld:
            remote = _rows(ld)
        for got in (local, remote):
            assert len(got) == len(want) == 3
            for g, w in zip(got, want, strict=True):
                for gx, wx in zip(g, w, strict=True):
                    np.testing.assert_array_equal(gx, wx)
        assert daemons_serving(sock) == []  # the Loader spawned no second daemon
        assert main(["status"]) == 0
        out = capsys.readouterr().out
        assert f"running: pid {proc.pid}" in out and "2 since start" in out

        assert main(["stop"]) == 0
        assert f"stopped: pid {proc.pid}" in capsys.readouterr().out
        assert proc.wait(10) == 0
        assert os.listdir(os.path.dirname(sock)) == []  # no socket, no .lock left
        assert main(["status"]) == 3
        assert main(["stop"]) == 0
        assert "not running" in capsys.readouterr().out
    finally:
        _stop(proc)
    assert "level=error" not in log.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_stop_signal_during_startup_stops_cleanly(short_tmp: Path, sig: str) -> None:
    """A SIGTERM/SIGINT before the event loop's handlers (here: while a plugin is imported)
    stops the daemon cleanly: exit 0, no socket and no lock file left (it was 143 and a lock
    file)."""
    runtime = short_tmp / "run"
    runtime.mkdir(mode=0o700)
    env = _env(runtime)
    data = write_labelled(short_tmp / "rows.beton", 20, 0)
    plug = short_tmp / "kill_self.py"
    plug.write_text(f"import os, signal\nos.kill(os.getpid(), signal.{sig})\n")
    log = short_tmp / "daemon.log"
    proc = _launch(["--plugin", str(plug), str(data)], env, log)
    try:
        assert proc.wait(60) == 0, log.read_text()
    finally:
        _stop(proc)
    text = log.read_text()
    assert f"{sig} during start-up (before opening the datasets): stopping" in text, text
    assert os.listdir(runtime / "beton-serve") == []  # no socket, no .lock
    assert "Traceback" not in text


@pytest.mark.slow
def test_a_sighup_during_startup_reloads_once_serving(short_tmp: Path) -> None:
    """A SIGHUP before the loop's handlers does not end the daemon (its default action): the
    config is reloaded once serving, so an edit made meanwhile is not missed."""
    runtime = short_tmp / "run"
    runtime.mkdir(mode=0o700)
    env = _env(runtime)
    data = write_labelled(short_tmp / "rows.beton", 20, 0)
    conf = short_tmp / "d.toml"
    conf.write_text("bad_sample_budget = 3\n")
    # The plugin edits the config, then signals: the reload must read the edit.
    plug = short_tmp / "hup_self.py"
    plug.write_text(
        "import os, signal\n"
        f"open({str(conf)!r}, 'w').write('bad_sample_budget = 7\\n')\n"
        "os.kill(os.getpid(), signal.SIGHUP)\n"
    )
    log = short_tmp / "daemon.log"
    proc = _launch(["--config", str(conf), "--plugin", str(plug), str(data)], env, log)
    try:
        from beton_wire.address import default_socket_path

        wait_until_serving("unix://" + default_socket_path(env), proc, 60)
        wait_for(lambda: "config reloaded" in log.read_text(), 20)
        assert proc.poll() is None
    finally:
        assert _stop(proc) == 0
    text = log.read_text()
    assert "SIGHUP during start-up: reloading the config now" in text
    assert "changed=bad_sample_budget=7" in text, text


@pytest.mark.slow
def test_reload_subcommand_makes_the_daemon_reread_its_config(
    short_tmp: Path, capsys: pytest.CaptureFixture
) -> None:
    """``beton-serve reload`` sends SIGHUP to the per-user daemon (it was read as "serve a file
    called reload"); exit 3 when none runs."""
    runtime = short_tmp / "run"
    runtime.mkdir(mode=0o700)
    env = _env(runtime)
    from beton_wire.address import default_socket_path

    sock = default_socket_path(env)
    data = write_labelled(short_tmp / "rows.beton", 20, 0)
    conf = short_tmp / "d.toml"
    conf.write_text("bad_sample_budget = 3\n")
    log = short_tmp / "daemon.log"
    proc = _launch(["--config", str(conf), str(data)], env, log)
    try:
        wait_until_serving("unix://" + sock, proc, 60)
        conf.write_text("bad_sample_budget = 9\n")
        assert main(["reload", "--socket", sock]) == 0
        assert f"reload requested: pid {proc.pid}" in capsys.readouterr().out
        wait_for(lambda: "config reloaded" in log.read_text(), 20)
        assert "changed=bad_sample_budget=9" in log.read_text()
        # An invalid file is refused here, before any signal (it said "reload requested").
        conf.write_text("bad_sample_budget = 9\nbad_sample_budget = 10\n")
        assert main(["reload", "--socket", sock]) == 1
        assert "its config file is invalid, so it keeps its current config" in (
            capsys.readouterr().err
        )
        assert proc.poll() is None
    finally:
        assert _stop(proc) == 0
    plain = _launch([str(data)], env, log)  # no --config: nothing to reload
    try:
        wait_until_serving("unix://" + sock, plain, 60)
        assert main(["reload", "--socket", sock]) == 1
        assert "it runs without --config" in capsys.readouterr().err
    finally:
        assert _stop(plain) == 0
    assert main(["reload", "--socket", sock]) == 3
    assert "not running" in capsys.readouterr().err


@pytest.mark.slow
def test_no_socket_serves_tcp_only_and_a_taken_default_socket_is_a_warning(
    short_tmp: Path,
) -> None:
    runtime = short_tmp / "run"
    runtime.mkdir(mode=0o700)
    env = _env(runtime)
    data = write_labelled(short_tmp / "rows.beton", 20, 0)
    holder = _launch([str(data), "--workers", "1"], env, short_tmp / "holder.log")
    procs = [holder]
    try:
        from beton_wire.address import default_socket_path

        sock = default_socket_path(env)
        wait_until_serving("unix://" + sock, holder, 30)
        p1, p2 = free_port(), free_port()
        tcp_only = _launch(
            [str(data), "--no-socket", "--listen", f"127.0.0.1:{p1}", "--workers", "1"],
            env,
            short_tmp / "tcp.log",
        )
        # The default socket is taken by `holder`: a --listen daemon warns and serves TCP.
        second = _launch(
            ["--listen", f"127.0.0.1:{p2}", str(data), "--workers", "1"], env, short_tmp / "2.log"
        )
        procs += [tcp_only, second]
        wait_until_serving(f"127.0.0.1:{p1}", tcp_only, 30)
        wait_until_serving(f"127.0.0.1:{p2}", second, 30)
        lock_pid = int(Path(sock + ".lock").read_text().split()[0])
        assert lock_pid == holder.pid
        assert _stop(second) == 0 and _stop(tcp_only) == 0
        assert "not serving the Unix socket" in (short_tmp / "2.log").read_text()
        assert "not serving the Unix socket" not in (short_tmp / "tcp.log").read_text()
        assert _stop(holder) == 0
        assert os.listdir(os.path.dirname(sock)) == []
    finally:
        for p in procs:
            _stop(p)
    # --no-socket without an address is refused before anything starts.
    assert main([str(data), "--no-socket"]) == 1


@pytest.mark.slow
def test_status_and_stop_with_socket_and_sigterm_leave_no_files(
    daemon_factory, short_tmp: Path, capsys: pytest.CaptureFixture
) -> None:
    data = write_labelled(short_tmp / "rows.beton", 20, 0)
    d = daemon_factory([data])
    assert main(["status", "--socket", d.socket, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert (st["pid"], st["datasets"], st["streams"]) == (d.pid, ["rows"], 0)
    # --socket-owner, as for health and stats: a socket that is not that uid's is not asked
    # (the daemon is still found running by its lock); naming our own uid asks it.
    other = ["--socket-owner", str(os.getuid() + 1)]
    assert main(["status", "--socket", d.socket, "--json", *other]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["running"] and st["pid"] == d.pid and "datasets" not in st
    assert "refusing to connect" in st["stats_error"]
    assert main(["status", "--socket", d.socket, *other]) == 0
    assert "stats unavailable: refusing to connect" in capsys.readouterr().out
    assert main(["status", "--socket", d.socket, "--socket-owner", str(os.getuid())]) == 0
    assert "datasets  rows" in capsys.readouterr().out
    assert main(["stop", "--socket", d.socket]) == 0
    assert d.proc.wait(10) == 0
    left = [n for n in os.listdir(short_tmp) if n.startswith("d.sock")]
    assert left == []
    assert main(["status", "--socket", d.socket]) == 3
    assert "not running" in capsys.readouterr().out
    # SIGTERM does the same; and a socket path in a fresh directory works as well.
    d2 = daemon_factory([data], socket=str(short_tmp / "sub" / "e.sock"))
    assert d2.stop(signal.SIGTERM) == 0
    assert os.listdir(short_tmp / "sub") == []


# -- client exits are not warnings ---------------------------------------------------------

_CLIENT = """
import os, sys
from beton_client import Loader
from beton_serve.fields.decoders import IntDecoder, NDArrayDecoder
pipes = {"vec": [NDArrayDecoder()], "label": [IntDecoder()]}
loaders = [Loader("rows", 10, pipelines=pipes, server=sys.argv[1], transport=t, spawn=False)
           for t in ("shm", "grpc")]
for ld in loaders:
    for i, _ in enumerate(ld):
        if i == 2:
            break
if sys.argv[2] == "exit":
    os._exit(0)        # the process ends without closing anything
loaders[0].close()     # closed by the client mid-epoch; the grpc one is left to the exit
"""


@pytest.mark.slow
def test_a_client_exit_is_not_logged_as_a_warning(daemon_factory, short_tmp: Path) -> None:
    data = write_labelled(short_tmp / "rows.beton", 300, 0)
    d = daemon_factory([data])
    clients = [  # at once: each pays for importing torch and its first batch
        subprocess.Popen(
            [sys.executable, "-c", _CLIENT, d.address, how],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for how in ("exit", "close")
    ]
    for c in clients:
        _, err = c.communicate(timeout=60)
        assert c.returncode == 0, err.decode()[-2000:]
    wait_for(lambda: not d.stats().streams, 10)
    assert d.stop() == 0
    text = d.log()
    assert text.count("opened: dataset=rows") == 4 and text.count("closed after") == 4, text
    assert "level=warning" not in text and "level=error" not in text, text


# -- auto-spawn leaves no files ------------------------------------------------------------


@pytest.mark.slow
def test_an_auto_spawned_daemon_leaves_no_files_after_its_idle_exit(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import beton_client._loader as client_loader
    from beton_client import Loader as ServedLoader

    data = write_labelled(short_tmp / "rows.beton", 20, 0)
    sock_dir = short_tmp / "s"
    sock = str(sock_dir / "auto.sock")
    monkeypatch.setattr(client_loader, "SPAWN_IDLE_TIMEOUT_S", 3.0)
    pipes = {"vec": [NDArrayDecoder()], "label": [IntDecoder()]}
    try:
        with ServedLoader(str(data), BATCH, pipelines=pipes, server="unix://" + sock) as ld:
            assert sum(len(b[1]) for b in ld) == 20
        # The spawner removed its .spawn.lock; the daemon still serves (its socket, lock, log).
        assert set(os.listdir(sock_dir)) <= {"auto.sock", "auto.sock.lock", "auto.sock.log"}
        wait_for(lambda: not daemons_serving(sock), 20, step=0.1)  # idle exit after 3 s
        assert os.listdir(sock_dir) == []
    finally:
        for pid in daemons_serving(sock):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_spawned_daemon_that_fails_keeps_only_its_log(short_tmp: Path) -> None:
    from beton_client._spawn import ensure_daemon
    from beton_client.errors import FormatError

    bad = short_tmp / "bad.beton"
    bad.write_bytes(b"not a beton file at all" * 10)
    sock = str(short_tmp / "s" / "f.sock")
    t0 = time.monotonic()
    # A damaged file is the in-process Loader's FormatError, whether or not a daemon ran.
    with pytest.raises(FormatError, match=r"exited with status 65 \(its log: .*f.sock.log\)"):
        ensure_daemon(sock, str(bad), idle_timeout=1.0, wait=30)
    assert time.monotonic() - t0 < 30
    assert os.listdir(short_tmp / "s") == ["f.sock.log"]
    assert "bad.beton" in (short_tmp / "s" / "f.sock.log").read_text()


_HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, f"{os.getpid()}\\n".encode())
print("held", flush=True)
time.sleep(float(sys.argv[2]))   # then exits without serving, as a daemon that was stopping
"""


@pytest.mark.slow
def test_a_spawn_that_loses_to_a_stopping_daemon_spawns_again_then_stop_cleans_up(
    short_tmp: Path, capsys: pytest.CaptureFixture
) -> None:
    from beton_client._spawn import ensure_daemon

    data = write_labelled(short_tmp / "rows.beton", 20, 0)
    sock_dir = short_tmp / "s"
    sock_dir.mkdir(mode=0o700)
    sock = str(sock_dir / "r.sock")
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, sock + ".lock", "4"], stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        ensure_daemon(sock, str(data), idle_timeout=30.0, wait=40)  # 75 first, then spawned again
        assert holder.wait(10) == 0
        pids = daemons_serving(sock)
        assert len(pids) == 1
        assert "already serves" in Path(sock + ".log").read_text()  # the first one's exit
        assert main(["stop", "--socket", sock]) == 0
        assert f"stopped: pid {pids[0]}" in capsys.readouterr().out
        assert os.listdir(sock_dir) == []  # socket, .lock, .spawn.lock and the log: all gone
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)
        for pid in daemons_serving(sock):
            os.kill(pid, signal.SIGKILL)


def test_cache_subcommand_is_wired_when_its_module_exists(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import types

    import beton_serve.cli as cli

    seen: dict[str, list[str]] = {}
    fake = types.ModuleType("beton_serve_test_fake_cache")
    fake.main = lambda argv: seen.setdefault("argv", list(argv)) and 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setattr(cli, "CACHE_MODULE", fake.__name__)
    assert cli.main(["cache", "info", "--json"]) == 0
    assert seen["argv"] == ["info", "--json"]
    monkeypatch.setattr(cli, "CACHE_MODULE", "beton_serve_no_such_cache_module")
    assert "cache" not in cli._subparsers(cli.build_parser())


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to pin to one")
def test_a_daemon_spawned_by_a_pinned_trainer_is_not_pinned(
    short_tmp: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank pinned to one core (taskset, torchrun, numactl) spawned a daemon pinned to that
    core: every later trainer shared a one-worker pool. It also kept the trainer's working
    directory (an unmount of the job's directory failed while the daemon lived): its cwd is
    ``/`` now, and the relative paths the trainer gave still name the right files."""
    from beton_client._spawn import ensure_daemon

    write_labelled(short_tmp / "rows.beton", 20, 0)
    monkeypatch.chdir(short_tmp)
    sock = str(short_tmp / "s" / "p.sock")
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})  # this thread (the spawner) is the pinned rank
    try:
        ensure_daemon("s/p.sock", "rows.beton", idle_timeout=30.0, wait=40)
    finally:
        os.sched_setaffinity(0, allowed)
    try:
        (pid,) = daemons_serving(sock)
        assert os.sched_getaffinity(pid) == allowed
        assert os.readlink(f"/proc/{pid}/cwd") == "/"
        capsys.readouterr()
        assert main(["status", "--socket", sock, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["workers"] == len(allowed)
    finally:
        main(["stop", "--socket", sock])
