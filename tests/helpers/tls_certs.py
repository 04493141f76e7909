"""Throw-away TLS material for tests: a CA, a server certificate for localhost/127.0.0.1, and a client
certificate, written as PEM files. Uses the ``cryptography`` package when installed, else the
``openssl`` command; ``available()`` says whether either exists (tests skip otherwise)."""

from __future__ import annotations

import datetime
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TlsFiles:
    ca_cert: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca_cert: str  # a CA that signed nothing here: trusting it must fail the handshake


def _have_cryptography() -> bool:
    try:
        import cryptography  # noqa: F401
    except ImportError:
        return False
    return True


def available() -> bool:
    return _have_cryptography() or shutil.which("openssl") is not None


def make_tls_files(d: Path) -> TlsFiles:
    """Write the PEM files under ``d`` and return their paths."""
    d.mkdir(parents=True, exist_ok=True)
    if _have_cryptography():
        _with_cryptography(d)
    else:
        _with_openssl(d)
    return TlsFiles(
        *(str(d / n) for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")),
        other_ca_cert=str(d / "other_ca.pem"),
    )


def _with_cryptography(d: Path) -> None:
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def key() -> ec.EllipticCurvePrivateKey:
        return ec.generate_private_key(ec.SECP256R1())

    def write_key(k: ec.EllipticCurvePrivateKey, path: Path) -> None:
        path.write_bytes(
            k.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )

    def ca(cn: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        k = key()
        cert = (
            x509.CertificateBuilder()
            .subject_name(name(cn))
            .issuer_name(name(cn))
            .public_key(k.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(k, hashes.SHA256())
        )
        return cert, k

    def leaf(cn: str, ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, server: bool):
        k = key()
        b = (
            x509.CertificateBuilder()
            .subject_name(name(cn))
            .issuer_name(ca_cert.subject)
            .public_key(k.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
        )
        if server:
            b = b.add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.DNSName("localhost"),
                        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    ]
                ),
                critical=False,
            )
        return b.sign(ca_key, hashes.SHA256()), k

    pem = serialization.Encoding.PEM
    ca_cert, ca_key = ca("beton test CA")
    (d / "ca.pem").write_bytes(ca_cert.public_bytes(pem))
    other, _ = ca("beton other CA")
    (d / "other_ca.pem").write_bytes(other.public_bytes(pem))
    for stem, server in (("server", True), ("client", False)):
        cert, k = leaf(f"beton test {stem}", ca_cert, ca_key, server)
        (d / f"{stem}.pem").write_bytes(cert.public_bytes(pem))
        write_key(k, d / f"{stem}.key")


def _with_openssl(d: Path) -> None:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)

    for ca in ("ca", "other_ca"):
        run(
            "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-days", "1", "-subj", f"/CN=beton {ca}",
            "-keyout", str(d / f"{ca}.key"), "-out", str(d / f"{ca}.pem"),
        )  # fmt: skip
    for stem, ext in (
        ("server", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        (d / f"{stem}.ext").write_text(ext + "\n")
        run(
            "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-subj", f"/CN=beton test {stem}", "-keyout", str(d / f"{stem}.key"),
            "-out", str(d / f"{stem}.csr"),
        )  # fmt: skip
        run(
            "x509", "-req", "-in", str(d / f"{stem}.csr"), "-CA", str(d / "ca.pem"),
            "-CAkey", str(d / "ca.key"), "-CAcreateserial", "-days", "1",
            "-extfile", str(d / f"{stem}.ext"), "-out", str(d / f"{stem}.pem"),
        )  # fmt: skip
