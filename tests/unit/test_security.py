"""Listen policy, TLS configuration, token checks (server) and channel credentials (client)."""

from __future__ import annotations

import logging
import time
from collections import namedtuple
from pathlib import Path

import grpc
import pytest
from beton_client import _security as client_sec
from beton_serve.errors import ConfigError
from beton_serve.transport import security as sec
from helpers import tls_certs

Details = namedtuple("Details", ["method", "invocation_metadata"])


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1:7777",
        "127.1.2.3:0",
        "localhost:50051",
        "LOCALHOST:1",
        "[::1]:7777",
    ],
)
def test_loopback_addresses_need_nothing(address: str) -> None:
    assert sec.is_loopback_address(address)
    assert sec.check_listen_policy(address, tls=False, token=False, insecure=False) == []


@pytest.mark.parametrize(
    "address", ["unix:/tmp/beton.sock", "unix:///tmp/beton.sock", "unix-abstract:beton"]
)
@pytest.mark.parametrize("protected", [False, True])
def test_unix_sockets_are_refused_as_listen_addresses(address: str, protected: bool) -> None:
    """Every caller on a Unix socket counts as the daemon's own user: only --socket (0600, in a
    private directory) makes that true; an abstract socket admits every local user."""
    assert sec.is_loopback_address(address)
    with pytest.raises(ConfigError, match="--socket PATH"):
        sec.check_listen_policy(address, tls=protected, token=protected, insecure=protected)


@pytest.mark.parametrize(
    "address", ["0.0.0.0:7777", "[::]:7777", "10.0.0.5:7777", "[fe80::1]:1", "h1.example:7777"]
)
def test_non_loopback_without_protection_is_refused(address: str) -> None:
    assert not sec.is_loopback_address(address)
    with pytest.raises(ConfigError, match="--insecure") as info:
        sec.check_listen_policy(address, tls=False, token=False, insecure=False)
    assert "--tls-cert" in str(info.value) and "--token-file" in str(info.value)


def test_non_loopback_with_tls_or_token() -> None:
    assert sec.check_listen_policy("0.0.0.0:1", tls=True, token=False, insecure=False) == []
    assert sec.check_listen_policy("0.0.0.0:1", tls=True, token=True, insecure=False) == []
    (warning,) = sec.check_listen_policy("0.0.0.0:1", tls=False, token=True, insecure=False)
    assert "clear text" in warning


def test_insecure_is_allowed_but_loud(caplog: pytest.LogCaptureFixture) -> None:
    (warning,) = sec.check_listen_policy("0.0.0.0:1", tls=False, token=False, insecure=True)
    assert warning.startswith("INSECURE") and "0.0.0.0:1" in warning
    with caplog.at_level(logging.WARNING, logger="beton_serve.transport.security"):
        sec.enforce_listen_policy("0.0.0.0:1", tls=False, token=False, insecure=True)
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "INSECURE" in caplog.records[0].getMessage()


@pytest.mark.parametrize(
    "address", ["7777", "host:", "host:port", "[::1:7777", "[::1]7777", ":1", "h:70000"]
)
def test_malformed_addresses(address: str) -> None:
    with pytest.raises(ConfigError, match="address"):
        sec.check_listen_policy(address, tls=True, token=True, insecure=True)


def test_tls_config_checks_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--tls-cert"):
        sec.TlsConfig(cert_file=str(tmp_path / "nope.pem"), key_file=str(tmp_path / "nope.key"))
    (tmp_path / "c.pem").write_text("not pem")
    (tmp_path / "k.pem").write_text("not pem")
    cfg = sec.TlsConfig(cert_file=str(tmp_path / "c.pem"), key_file=str(tmp_path / "k.pem"))
    with pytest.raises(ConfigError, match="not PEM"):
        sec.server_credentials(cfg)


@pytest.mark.skipif(not tls_certs.available(), reason="needs the cryptography package or openssl")
def test_credentials_from_generated_certificates(tmp_path: Path) -> None:
    files = tls_certs.make_tls_files(tmp_path)
    tls = sec.TlsConfig(
        cert_file=files.server_cert, key_file=files.server_key, client_ca_file=files.ca_cert
    )
    assert isinstance(sec.server_credentials(tls), grpc.ServerCredentials)
    creds = client_sec.channel_credentials(
        files.ca_cert, cert_file=files.client_cert, key_file=files.client_key
    )
    assert isinstance(creds, grpc.ChannelCredentials)
    with pytest.raises(ValueError, match="both"):
        client_sec.channel_credentials(files.ca_cert, cert_file=files.client_cert)
    with pytest.raises(ValueError, match="cannot read"):
        client_sec.channel_credentials(str(tmp_path / "missing.pem"))


def test_token_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    p = tmp_path / "token"
    p.write_text("  s3cret-token\n")
    p.chmod(0o600)
    assert sec.read_token_file(str(p)) == "s3cret-token"
    p.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="beton_serve.transport.security"):
        assert sec.read_token_file(str(p)) == "s3cret-token"
    assert "chmod 600" in caplog.text
    p.write_text("two words")
    with pytest.raises(ConfigError, match="printable"):
        sec.read_token_file(str(p))
    p.write_text("\n")
    with pytest.raises(ConfigError):
        sec.read_token_file(str(p))
    with pytest.raises(ConfigError, match="cannot read"):
        sec.read_token_file(str(tmp_path / "missing"))


class _Ctx:
    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise RuntimeError((code, details))


def _handler() -> grpc.RpcMethodHandler:
    return grpc.unary_stream_rpc_method_handler(lambda req, ctx: iter([b"ok"]))


@pytest.mark.parametrize(
    ("metadata", "allowed"),
    [
        ((("authorization", "Bearer right-token"),), True),
        ((("authorization", "bearer right-token"),), True),
        ((("x-other", "1"), ("authorization", "Bearer right-token")), True),
        ((), False),
        (None, False),
        ((("authorization", "Bearer wrong-token"),), False),
        ((("authorization", "Bearer right-toke"),), False),
        ((("authorization", "right-token"),), False),
        ((("authorization", "Basic right-token"),), False),
        ((("authorization", "Bearer "),), False),
    ],
)
def test_token_interceptor(metadata: tuple | None, allowed: bool) -> None:
    icpt = sec.BearerTokenInterceptor("right-token")
    real = _handler()
    got = icpt.intercept_service(lambda d: real, Details("/beton.v1.Daemon/Open", metadata))
    if allowed:
        assert got is real
    else:
        assert got is not real and got.response_streaming and not got.request_streaming
        with pytest.raises(RuntimeError) as info:
            got.unary_stream(b"", _Ctx())
        assert info.value.args[0][0] is grpc.StatusCode.UNAUTHENTICATED


def test_health_check_is_exempt_and_unknown_methods_fall_through() -> None:
    icpt = sec.BearerTokenInterceptor("right-token")
    real = _handler()
    assert (
        icpt.intercept_service(lambda d: real, Details("/grpc.health.v1.Health/Check", ())) is real
    )
    assert icpt.intercept_service(lambda d: None, Details("/x.Y/Z", ())) is None
    with pytest.raises(ConfigError):
        sec.BearerTokenInterceptor("has space")
    with pytest.raises(ConfigError):
        sec.AioBearerTokenInterceptor("")


def test_client_token_helpers() -> None:
    assert client_sec.token_metadata("abc") == (("authorization", "Bearer abc"),)
    assert isinstance(client_sec.token_call_credentials("abc"), grpc.CallCredentials)
    with pytest.raises(ValueError):
        client_sec.token_metadata("a b")
    ch = client_sec.secure_or_plain_channel("127.0.0.1:1", token="abc")
    ch.close()


@pytest.mark.skipif(not tls_certs.available(), reason="needs the cryptography package or openssl")
def test_a_key_of_another_certificate_is_named_as_such(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """It was reported as gRPC's "Failed to bind to address"; now the files are checked first,
    and an expired certificate is logged (clients would refuse it with no word from the daemon)."""
    files = tls_certs.make_tls_files(tmp_path)
    wrong = sec.TlsConfig(cert_file=files.server_cert, key_file=files.client_key)
    with pytest.raises(ConfigError, match=r"--tls-key .*not the certificate's"):
        sec.server_credentials(wrong)
    bad_ca = tmp_path / "ca.pem"
    bad_ca.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    with pytest.raises(ConfigError, match="--tls-client-ca: OpenSSL cannot load"):
        sec.check_server_files(
            sec.TlsConfig(
                cert_file=files.server_cert, key_file=files.server_key, client_ca_file=str(bad_ca)
            )
        )
    good = sec.TlsConfig(cert_file=files.server_cert, key_file=files.server_key)
    with caplog.at_level(logging.WARNING, logger=sec.__name__):
        sec.check_server_files(good)
        assert not caplog.records
        sec.check_server_files(good, now=time.time() + 100 * 365 * 86400)
    assert "expired on" in caplog.text and files.server_cert in caplog.text


def test_a_password_protected_key_is_refused_by_name(tmp_path: Path) -> None:
    serialization = pytest.importorskip("cryptography.hazmat.primitives.serialization")
    if not tls_certs.available():
        pytest.skip("needs the cryptography package or openssl")
    files = tls_certs.make_tls_files(tmp_path)
    key = serialization.load_pem_private_key(Path(files.server_key).read_bytes(), password=None)
    enc = tmp_path / "enc.key"
    enc.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    tls = sec.TlsConfig(cert_file=files.server_cert, key_file=str(enc))
    with pytest.raises(ConfigError, match="password-protected"):
        sec.server_credentials(tls)
