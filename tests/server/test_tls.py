"""TLS with client certificates: --ssl-ca-certs and --ssl-cert-reqs reach hypercorn and are enforced.

A CA, a server certificate (for 127.0.0.1) and client certificates are made in the test with the
`cryptography` package; the server is the real one on a tiny random model.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
from pathlib import Path

import httpx
import pytest
from tests.server.real_tiny_server import build_tiny_chat_model, serving
from tests.server.server_harness import quiet_args

from aserve.server.args import parse_args

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: E402


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _issue(subject: str, key, issuer_name, issuer_key, *, ca: bool = False, server: bool = False):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )
    else:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
        )
    return builder.sign(issuer_key, hashes.SHA256())


def _write(folder: Path, stem: str, cert, key) -> tuple[str, str]:
    cert_path, key_path = folder / f"{stem}.crt", folder / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return str(cert_path), str(key_path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """CA, server and client certificate files; `stranger` is a client signed by another CA."""
    folder = tmp_path_factory.mktemp("pki")
    files = {}
    ca_key, other_ca_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _issue("test CA", ca_key, _name("test CA"), ca_key, ca=True)
    files["ca"] = _write(folder, "ca", ca, ca_key)
    for stem, issuer_name, issuer_key, server in (
        ("server", ca.subject, ca_key, True),
        ("client", ca.subject, ca_key, False),
        ("stranger", _name("other CA"), other_ca_key, False),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        files[stem] = _write(folder, stem, _issue(stem, key, issuer_name, issuer_key, server=server), key)
    return files


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))


def _client_context(pki, client: str | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=pki["ca"][0])
    if client is not None:
        context.load_cert_chain(*pki[client])
    return context


def _get_health(port: int, context: ssl.SSLContext) -> int:
    with httpx.Client(verify=context, timeout=30) as http:
        return http.get(f"https://127.0.0.1:{port}/health").status_code


def _tls12_handshake(port: int, context: ssl.SSLContext) -> str:
    """A bare TLS 1.2 handshake (where the server checks the client certificate inside the handshake,
    unlike TLS 1.3); returns the negotiated version or raises ssl.SSLError."""
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            return str(tls.version())


def _server_args(pki, cert_reqs: int):
    cert, key = pki["server"]
    return quiet_args(ssl_certfile=cert, ssl_keyfile=key, ssl_ca_certs=pki["ca"][0], ssl_cert_reqs=cert_reqs)


def test_required_client_certificate_is_enforced(pki, model):
    with serving(model, _server_args(pki, ssl.CERT_REQUIRED)) as (_engine, address):
        assert _get_health(address.port, _client_context(pki, "client")) == 200
        assert _tls12_handshake(address.port, _client_context(pki, "client")) == "TLSv1.2"
        for client in (None, "stranger"):  # no certificate; one from another CA
            with pytest.raises(ssl.SSLError):
                _tls12_handshake(address.port, _client_context(pki, client))
            with pytest.raises(httpx.TransportError):  # TLS 1.3: the server hangs up after the handshake
                _get_health(address.port, _client_context(pki, client))


def test_optional_client_certificate_is_verified_when_sent(pki, model):
    with serving(model, _server_args(pki, ssl.CERT_OPTIONAL)) as (_engine, address):
        assert _get_health(address.port, _client_context(pki, None)) == 200
        assert _get_health(address.port, _client_context(pki, "client")) == 200
        with pytest.raises(ssl.SSLError):
            _tls12_handshake(address.port, _client_context(pki, "stranger"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ssl-cert-reqs", "2"], "--ssl-cert-reqs 2 needs --ssl-ca-certs"),
        (["--ssl-ca-certs", "ca.pem"], "add --ssl-cert-reqs 1 (optional) or 2 (required)"),
        (["--ssl-cert-reqs", "3"], "invalid choice"),
    ],
)
def test_client_certificate_flags_are_checked(argv, message, capsys):
    tls = ["--ssl-certfile", "s.crt", "--ssl-keyfile", "s.key"]
    with pytest.raises(SystemExit):
        parse_args(tls + argv, environ={})
    assert message in capsys.readouterr().err


def test_client_certificate_flags_parse():
    tls = ["--ssl-certfile", "s.crt", "--ssl-keyfile", "s.key"]
    _, server = parse_args(tls + ["--ssl-ca-certs", "ca.pem", "--ssl-cert-reqs", "2"], environ={})
    assert (server.ssl_ca_certs, server.ssl_cert_reqs) == ("ca.pem", ssl.CERT_REQUIRED)
