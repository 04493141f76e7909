"""``beton-serve health`` against a real gRPC health server (in-process, loopback, port 0)."""

from __future__ import annotations

import argparse
import socket
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from beton_serve.cli import _health
from beton_serve.errors import ConfigError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc


@pytest.fixture
def health_server() -> Iterator[tuple[str, health.HealthServicer]]:
    servicer = health.HealthServicer()
    pool = futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="test-health")
    server = grpc.server(pool)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(grace=None).wait(5)
        pool.shutdown(wait=True)


def _args(server: str | None, timeout: float = 2.0, service: str = "") -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    _health.register(sub)
    argv = ["health", "--timeout", str(timeout), "--service", service]
    if server is not None:
        argv += ["--server", server]
    return parser.parse_args(argv)


def test_serving_exits_zero(health_server, capsys) -> None:
    target, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert _health.run(_args(target), environ={}) == _health.EXIT_SERVING
    assert capsys.readouterr().out.strip() == f"{target}: SERVING"


def test_not_serving_exits_one(health_server) -> None:
    target, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert _health.run(_args(target), environ={}) == _health.EXIT_NOT_SERVING


def test_unknown_service_exits_one(health_server) -> None:
    target, _ = health_server
    assert _health.check(target, service="no.such.Service", timeout=2) == "SERVICE_UNKNOWN"
    assert _health.run(_args(target, service="no.such.Service"), environ={}) == 1


def test_dataset_asks_that_datasets_service(health_server, capsys) -> None:
    """``--dataset NAME`` asks the service ``dataset/NAME``: one dataset's health, which a
    daemon serving others says NOT_SERVING once that dataset's file changed."""
    from beton_serve.cli import main

    target, servicer = health_server
    servicer.set("dataset/good", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("dataset/bad", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert main(["health", "--server", target, "--dataset", "good"]) == _health.EXIT_SERVING
    assert capsys.readouterr().out.strip() == f"{target} dataset/good: SERVING"
    assert main(["health", "--server", target, "--dataset", "bad"]) == _health.EXIT_NOT_SERVING
    assert capsys.readouterr().out.strip() == f"{target} dataset/bad: NOT_SERVING"
    assert main(["health", "--server", target, "--dataset", "nope"]) == _health.EXIT_NOT_SERVING
    out = capsys.readouterr()
    assert out.out.strip() == f"{target} dataset/nope: SERVICE_UNKNOWN"
    assert "no dataset 'nope' was served from this daemon's start" in out.err


def test_dataset_and_service_are_exclusive(capsys) -> None:
    from beton_serve.cli import build_parser

    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["health", "--dataset", "a", "--service", "b"])
    assert info.value.code == 2
    assert "not allowed with" in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_the_server_handle_reports_each_dataset_and_drains_them_all() -> None:
    """The daemon's side: ``set_dataset`` reports one dataset; ``set_serving(False)`` (the
    drain) reports every dataset NOT_SERVING too; serving again leaves them as they were."""
    import asyncio

    from beton_serve.rpc import ServerHandle

    async def main() -> None:
        servicer = health.aio.HealthServicer()
        handle = ServerHandle(None, servicer, 0)  # type: ignore[arg-type]

        async def status(service: str) -> str:
            reply = await servicer.Check(health_pb2.HealthCheckRequest(service=service), None)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

        await handle.set_dataset("a", True)
        await handle.set_dataset("b", True)
        await handle.set_serving(True)
        await handle.set_dataset("b", False)
        assert [await status(s) for s in ("", "dataset/a", "dataset/b")] == [
            "SERVING",
            "SERVING",
            "NOT_SERVING",
        ]
        assert handle.dataset_serving("a") is True
        assert handle.dataset_serving("b") is False
        assert handle.dataset_serving("c") is None
        await handle.set_serving(False)
        assert [await status(s) for s in ("", "dataset/a", "dataset/b")] == ["NOT_SERVING"] * 3

    asyncio.run(main())


def test_address_from_environment(health_server) -> None:
    target, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert _health.run(_args(None), environ={"BETON_SERVE_ADDRESS": target}) == 0


def test_nothing_listening_exits_two() -> None:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert _health.run(_args(f"127.0.0.1:{port}", timeout=0.5), environ={}) == 2


def test_default_address_is_the_per_user_socket(tmp_path) -> None:
    from beton_wire.address import default_socket_path, unix_target

    environ = {"XDG_RUNTIME_DIR": str(tmp_path)}
    expected = unix_target(default_socket_path(environ))
    assert _health.resolve_target(None, environ) == expected
    assert expected.startswith(f"unix://{tmp_path}/")
    # Nothing listens there: unreachable, exit 2.
    assert _health.run(_args(None, timeout=0.5), environ=environ) == _health.EXIT_UNREACHABLE


def test_empty_server_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--server"):
        _health.resolve_target("  ", {})


@pytest.mark.parametrize(
    ("explicit", "environ", "where"),
    [
        ("localhost:7700,localhost:7701", {}, "--server"),
        (None, {"BETON_SERVE_ADDRESS": "a:1, b:2"}, "BETON_SERVE_ADDRESS"),
    ],
)
def test_a_comma_joined_address_is_a_config_error(
    explicit: str | None, environ: dict[str, str], where: str
) -> None:
    """health and stats ask one daemon; gRPC would look the whole string up as a host name and
    report it unreachable after the timeout."""
    with pytest.raises(ConfigError, match=f"{where}.*one of") as info:
        _health.resolve_target(explicit, environ)
    assert "commas" in str(info.value)


@pytest.mark.parametrize("target", ["ipv4:127.0.0.1:1,127.0.0.1:2", "unix:///tmp/a,b.sock"])
def test_grpc_address_lists_and_socket_paths_keep_their_commas(target: str) -> None:
    assert _health.resolve_target(target, {}) == target


@pytest.mark.parametrize("target", ["localhost:99999", "127.0.0.1:0", "[::1]:70000"])
def test_a_port_outside_1_to_65535_is_a_config_error(target: str) -> None:
    """gRPC took ``localhost:99999`` and reported it as no daemon answering, after the
    timeout."""
    with pytest.raises(ConfigError, match=r"--server: port \d+ of .* is not a TCP port"):
        _health.resolve_target(target, {})


@pytest.mark.parametrize(
    "target", ["localhost:65535", "[::1]:1", "::1", "dns:///h:99999", "unix:///tmp/a:99999"]
)
def test_ports_in_range_and_other_target_forms_pass(target: str) -> None:
    assert _health.resolve_target(target, {}) == target


@pytest.mark.parametrize("timeout", ["-1", "0", "nan"])
@pytest.mark.parametrize("command", ["status", "stop"])
def test_status_and_stop_refuse_a_timeout_that_is_not_positive(
    command: str, timeout: str, capsys: pytest.CaptureFixture
) -> None:
    from beton_serve.cli import build_parser

    with pytest.raises(SystemExit) as info:
        build_parser().parse_args([command, "--timeout", timeout])
    assert info.value.code == 2
    assert "finite number of seconds > 0" in capsys.readouterr().err


def test_registered_in_the_cli(health_server) -> None:
    from beton_serve.cli import build_parser, main

    target, servicer = health_server
    args = build_parser().parse_args(["health", "--server", target])
    assert args.func is _health.run
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert main(["health", "--server", target, "--timeout", "2"]) == 0


def test_tls_listener(tmp_path, capsys) -> None:
    """A TLS-only daemon answers with --tls-ca; without it (or with the wrong CA) it does not."""
    from helpers.tls_certs import available, make_tls_files

    if not available():
        pytest.skip("neither the cryptography package nor openssl is available")
    tls = make_tls_files(tmp_path)
    with open(tls.server_key, "rb") as k, open(tls.server_cert, "rb") as c:
        creds = grpc.ssl_server_credentials([(k.read(), c.read())])
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    pool = futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="test-health-tls")
    server = grpc.server(pool)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    try:
        target = f"127.0.0.1:{port}"
        good = _args(target)
        good.tls_ca = tls.ca_cert
        assert _health.run(good, environ={}) == _health.EXIT_SERVING
        wrong = _args(target, timeout=0.5)
        wrong.tls_ca = tls.other_ca_cert
        capsys.readouterr()
        assert _health.run(wrong, environ={}) == _health.EXIT_UNREACHABLE
        # Something listens there: said, with the likely reason (it read as "nothing answered").
        assert "the TLS handshake may have failed" in capsys.readouterr().err
        plain = _args(target, timeout=0.5)
        assert _health.run(plain, environ={}) == _health.EXIT_UNREACHABLE
        assert "if it serves TLS (--tls-cert)" in capsys.readouterr().err
    finally:
        server.stop(grace=None).wait(5)
        pool.shutdown(wait=True)


def test_tls_options_are_checked(tmp_path) -> None:
    with pytest.raises(ConfigError, match="both"):
        _health.tls_credentials(None, str(tmp_path / "c.pem"), None)
    with pytest.raises(ConfigError, match="--tls-ca"):
        _health.tls_credentials(str(tmp_path / "missing.pem"), None, None)
    assert _health.tls_credentials(None, None, None) is None


def _serving_on(path) -> tuple[grpc.Server, futures.ThreadPoolExecutor, health.HealthServicer]:
    """A started gRPC health server answering SERVING on the Unix socket ``path``."""
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    pool = futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="test-health")
    server = grpc.server(pool)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix:{path}")
    server.start()
    return server, pool, servicer


@pytest.fixture
def unix_health_server(tmp_path) -> Iterator[tuple[str, health.HealthServicer, object]]:
    d = tmp_path / "sockdir"
    d.mkdir(mode=0o700)
    path = d / "h.sock"
    server, pool, servicer = _serving_on(path)
    try:
        yield f"unix://{path}", servicer, d
    finally:
        server.stop(grace=None).wait(5)
        pool.shutdown(wait=True)


def test_unix_socket_of_this_user_is_checked(unix_health_server) -> None:
    import os

    target, _, _ = unix_health_server
    assert _health.check(target, timeout=2) == "SERVING"
    # a socket another user owns (as seen with --socket-owner naming someone else)
    other = os.getuid() + 1
    with pytest.raises(ConfigError, match="--socket-owner"):
        _health.check(target, timeout=2, socket_owner=other)
    assert _health.check(target, timeout=2, socket_owner=os.getuid()) == "SERVING"


def test_health_and_stats_refuse_a_socket_in_a_directory_others_may_write(
    unix_health_server, capsys
) -> None:
    """Another local user could have planted it: nothing, not even a token, is sent. ``health``
    exits 2 (nothing asked), never 1, which a probe reads as "answered, draining"."""
    from beton_serve.cli._stats import fetch_stats

    target, _, d = unix_health_server
    d.chmod(0o777)
    try:
        with pytest.raises(ConfigError, match="refusing to connect"):
            _health.check(target, timeout=2)
        assert _health.run(_args(target), environ={}) == _health.EXIT_UNREACHABLE
        out = capsys.readouterr()
        assert out.out == ""
        assert out.err.startswith(f"error: refusing to connect to {target}")
        with pytest.raises(ConfigError, match="refusing to connect"):
            fetch_stats(target, timeout=2, token="secret")
    finally:
        d.chmod(0o700)


def test_a_wrong_option_exits_two_not_one(tmp_path, capsys) -> None:
    """Exit 1 means "the daemon answered, not SERVING"; an option that stops the check before
    anything is asked must not read as that."""
    args = _args("localhost:1,localhost:2")
    assert _health.run(args, environ={}) == _health.EXIT_UNREACHABLE
    assert "commas" in capsys.readouterr().err
    args = _args("localhost:1")
    args.tls_ca = str(tmp_path / "missing.pem")
    assert _health.run(args, environ={}) == _health.EXIT_UNREACHABLE
    assert "--tls-ca" in capsys.readouterr().err


def _plant_later(d, mode: int, delay: float = 0.4):
    """After ``delay`` s, make directory ``d`` (``mode``) and a gRPC health server's socket in
    it: what another user could do while a command waits for a daemon to come up."""
    import threading

    box: dict[str, object] = {}

    def plant() -> None:
        import time

        time.sleep(delay)
        d.mkdir()
        d.chmod(mode)
        box["server"], box["pool"], _ = _serving_on(d / "h.sock")

    t = threading.Thread(target=plant)
    t.start()

    def stop() -> None:
        t.join(10)
        if "server" in box:
            box["server"].stop(grace=None).wait(5)  # type: ignore[attr-defined]
            box["pool"].shutdown(wait=True)  # type: ignore[attr-defined]

    return stop


def test_a_socket_directory_made_while_waiting_is_checked_before_anything_is_sent(
    tmp_path,
) -> None:
    """The directory was missing when the command started: gRPC's own wait (``wait_for_ready``)
    used to connect to whatever appeared there later, and stats sent the token to it."""
    from beton_serve.cli._stats import fetch_stats

    planted = tmp_path / "planted"
    stop = _plant_later(planted, 0o777)  # a directory others may write: anyone's socket
    try:
        with pytest.raises(ConfigError, match="refusing to connect"):
            _health.check(f"unix://{planted / 'h.sock'}", timeout=5)
    finally:
        stop()
    planted2 = tmp_path / "planted2"
    stop = _plant_later(planted2, 0o777)
    try:
        with pytest.raises(ConfigError, match="refusing to connect"):
            fetch_stats(f"unix://{planted2 / 'h.sock'}", timeout=5, token="secret")
    finally:
        stop()
    # The user's own daemon coming up while the command waits is still found ...
    own = tmp_path / "own"
    stop = _plant_later(own, 0o700)
    try:
        assert _health.check(f"unix://{own / 'h.sock'}", timeout=10) == "SERVING"
    finally:
        stop()
    # ... and nothing coming is UNREACHABLE after the timeout.
    assert _health.check(f"unix://{tmp_path / 'none' / 'h.sock'}", timeout=0.3) == "UNREACHABLE"


def test_a_path_that_cannot_be_looked_at_is_a_typed_refusal(monkeypatch, tmp_path) -> None:
    """A directory above the socket that this user may not search: ``lstat`` raises
    ``PermissionError``, which used to escape untyped (a traceback from ``health``)."""
    import os

    from beton_client import UntrustedSocketError
    from beton_client._security import check_unix_target

    real = os.lstat

    def lstat(path, *a, **k):
        if str(path).startswith(str(tmp_path / "locked")):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(os, "lstat", lstat)
    target = f"unix://{tmp_path / 'locked' / 'd' / 'h.sock'}"
    with pytest.raises(ConfigError, match="cannot be looked at"):
        _health.check(target, timeout=1)
    with pytest.raises(UntrustedSocketError, match="cannot be looked at"):
        check_unix_target(target)


def test_the_loader_does_not_connect_to_a_missing_socket(tmp_path) -> None:
    """Connecting anyway would reach whatever appears there before gRPC connects."""
    from beton_client import Loader, ServeOptions, ServerUnavailable

    sock = tmp_path / "absent" / "beton.sock"
    with pytest.raises(ServerUnavailable, match="there is no socket at"):
        Loader(
            "anything", 4, serve=ServeOptions(server=f"unix://{sock}", spawn=False, reconnect=False)
        )
    assert not sock.parent.exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["health", "--timeout", "inf"],  # reported a live daemon as unreachable
        ["health", "--timeout", "-1"],
        ["health", "--timeout", "nan"],
        ["stats", "--timeout", "inf"],
        ["stats", "--count", "-1"],  # never stopped
    ],
)
def test_absurd_timeouts_and_counts_are_usage_errors(argv: list[str], capsys) -> None:
    from beton_serve.cli import main

    assert main(argv) == 2
    assert "must be" in capsys.readouterr().err


def test_status_stop_reload_say_when_they_ignore_a_tcp_address(
    tmp_path, capsys: pytest.CaptureFixture
) -> None:
    """``BETON_SERVE_ADDRESS=127.0.0.1:7700 beton-serve stop`` acted on the per-user socket
    without a word."""
    from beton_serve.cli._daemonctl import resolve_socket_path

    env = {"BETON_SERVE_ADDRESS": "127.0.0.1:7700", "XDG_RUNTIME_DIR": str(tmp_path)}
    path = resolve_socket_path(None, env)
    assert path == str(tmp_path / "beton-serve" / "beton.sock")
    assert "BETON_SERVE_ADDRESS=127.0.0.1:7700 is not a unix: address" in capsys.readouterr().err
    env["BETON_SERVE_ADDRESS"] = "unix:///x/y.sock"
    assert resolve_socket_path(None, env) == "/x/y.sock"
    assert capsys.readouterr().err == ""
