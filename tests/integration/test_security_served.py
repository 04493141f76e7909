# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""The daemon's security flags through real daemons: token, TLS, mutual TLS, listen policy.

Decision under test: a configured token is required on every address, the Unix socket included.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from beton_client import Loader
from beton_client.errors import AuthError, ServerUnavailable
from helpers import tls_certs
from helpers.daemon import daemon_factory, free_port, short_tmp  # noqa: F401

pytestmark = pytest.mark.slow

TOKEN = "s3cret-token_for-tests"
needs_certs = pytest.mark.skipif(
    not tls_certs.available(), reason="needs the cryptography package or the openssl command"
)


def _token_file(d: Path, token: str = TOKEN) -> str:
    p = d / "token"
    p.write_text(token + "\n")
    os.chmod(p, 0o600)
    return str(p)


def _one_epoch(ld: Loader) -> int:
    n = 0
    for b in ld:
        n += len(b[0])
        assert ld.last_sample_ids.dtype == np.uint64
    return n


def test_token_required_and_refused_over_tcp(
    daemon_factory, short_tmp: Path, fixtures_dir: Path, monkeypatch
) -> None:
    port = free_port()
    d = daemon_factory(
        [fixtures_dir / "mixed_fields.beton"],
        args=["--listen", f"127.0.0.1:{port}", "--token-file", _token_file(short_tmp)],
    )
    target = f"127.0.0.1:{port}"
    monkeypatch.delenv("BETON_SERVE_TOKEN", raising=False)
    for token in (None, "wrong-token"):
        with pytest.raises(AuthError):
            Loader("mixed_fields", 16, server=target, token=token, transport="grpc")
    with Loader("mixed_fields", 16, server=target, token=TOKEN, drop_last=False) as ld:
        assert ld.chosen_transport in ("shm", "grpc")
        assert _one_epoch(ld) > 0
    with Loader("mixed_fields", 16, server=target, token=TOKEN, transport="grpc") as ld:
        assert ld.chosen_transport == "grpc"
        assert _one_epoch(ld) > 0
    monkeypatch.setenv("BETON_SERVE_TOKEN", TOKEN)  # read by the Loader's constructor
    with Loader("mixed_fields", 16, server=target, transport="grpc") as ld:
        assert _one_epoch(ld) > 0
    monkeypatch.delenv("BETON_SERVE_TOKEN")
    # the Unix socket requires the token too
    with pytest.raises(AuthError):
        Loader("mixed_fields", 16, server=d.address)
    with Loader("mixed_fields", 16, server=d.address, token=TOKEN) as ld:
        assert ld.chosen_transport == "shm"
        assert _one_epoch(ld) > 0


@needs_certs
def test_tls_and_mutual_tls_handshakes(daemon_factory, short_tmp: Path, fixtures_dir: Path) -> None:
    files = tls_certs.make_tls_files(short_tmp / "certs")
    port = free_port()
    daemon_factory(
        [fixtures_dir / "mixed_fields.beton"],
        socket=str(short_tmp / "tls.sock"),
        args=[
            "--listen",
            f"127.0.0.1:{port}",
            "--tls-cert",
            files.server_cert,
            "--tls-key",
            files.server_key,
        ],
    )
    target = f"127.0.0.1:{port}"
    with Loader("mixed_fields", 16, server=target, tls_ca=files.ca_cert, transport="grpc") as ld:
        assert _one_epoch(ld) > 0
    with pytest.raises(ServerUnavailable):  # a CA that did not sign the daemon's certificate
        Loader("mixed_fields", 16, server=target, tls_ca=files.other_ca_cert, transport="grpc")
    # No TLS at all: the daemon closes the plain-text connection, and the error says why.
    with pytest.raises(ServerUnavailable, match=r"serves TLS .*tls_ca="):
        Loader("mixed_fields", 16, server=target, transport="grpc")

    mport = free_port()
    daemon_factory(
        [fixtures_dir / "mixed_fields.beton"],
        socket=str(short_tmp / "mtls.sock"),
        args=[
            "--listen",
            f"127.0.0.1:{mport}",
            "--tls-cert",
            files.server_cert,
            "--tls-key",
            files.server_key,
            "--tls-client-ca",
            files.ca_cert,
        ],
    )
    mtarget = f"127.0.0.1:{mport}"
    with Loader(
        "mixed_fields",
        16,
        server=mtarget,
        tls_ca=files.ca_cert,
        tls_cert=files.client_cert,
        tls_key=files.client_key,
        transport="grpc",
    ) as ld:
        assert _one_epoch(ld) > 0
    # No client certificate: it looked like no daemon at all ("Socket closed"); now it says why.
    with pytest.raises(ServerUnavailable, match=r"requires client certificates .*tls_cert="):
        Loader("mixed_fields", 16, server=mtarget, tls_ca=files.ca_cert, transport="grpc")


def _serve_refused(fixtures_dir: Path, short_tmp: Path, listen: str) -> str:
    """Run ``beton-serve ... --listen LISTEN``, which must refuse to start; its output."""
    cmd = [
        sys.executable,
        "-c",
        "import sys; from beton_serve.cli import main; sys.exit(main())",
        "serve",
        str(fixtures_dir / "mixed_fields.beton"),
        "--socket",
        str(short_tmp / "refused.sock"),
        "--listen",
        listen,
    ]
    done = subprocess.run(cmd, capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode != 0
    return (done.stdout + done.stderr).decode()


def test_non_loopback_listen_needs_protection_or_insecure(
    daemon_factory, short_tmp: Path, fixtures_dir: Path
) -> None:
    port = free_port()
    err = _serve_refused(fixtures_dir, short_tmp, f"0.0.0.0:{port}")
    assert "--insecure" in err and "0.0.0.0" in err
    d = daemon_factory(
        [fixtures_dir / "mixed_fields.beton"],
        socket=str(short_tmp / "insecure.sock"),
        args=["--listen", f"0.0.0.0:{port}", "--insecure"],
    )
    assert "INSECURE" in d.log()
    with Loader("mixed_fields", 16, server=f"127.0.0.1:{port}", transport="grpc") as ld:
        assert _one_epoch(ld) > 0


@pytest.mark.parametrize("address", ["unix-abstract:beton-test", "unix:{tmp}/other.sock"])
def test_a_unix_listen_address_is_refused(
    short_tmp: Path, fixtures_dir: Path, address: str
) -> None:
    """Every caller on a Unix socket counts as the daemon's user; an abstract socket (no
    permissions) or one made by --listen (the umask's mode) would admit other local users."""
    address = address.format(tmp=short_tmp)
    err = _serve_refused(fixtures_dir, short_tmp, address)
    assert "--socket PATH" in err and address in err
    assert not (short_tmp / "other.sock").exists()


def test_stats_cli_sends_the_token(daemon_factory, fixtures_dir: Path, short_tmp: Path) -> None:
    token_file = _token_file(short_tmp)
    d = daemon_factory([fixtures_dir / "mixed_fields.beton"], args=["--token-file", token_file])
    cmd = [
        sys.executable,
        "-c",
        "import sys; from beton_serve.cli import main; sys.exit(main())",
        "stats",
        "--json",
        "--server",
        d.address,
        "--timeout",
        "10",
    ]
    env = {k: v for k, v in os.environ.items() if k != "BETON_SERVE_TOKEN"}
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr
    ok = subprocess.run(
        [*cmd, "--token-file", token_file], capture_output=True, text=True, timeout=60, env=env
    )
    assert ok.returncode == 0, ok.stderr
    assert '"pid"' in ok.stdout
    by_env = subprocess.run(
        cmd, capture_output=True, text=True, timeout=60, env={**env, "BETON_SERVE_TOKEN": TOKEN}
    )
    assert by_env.returncode == 0, by_env.stderr
