"""TLS with nats-py (ssl.SSLContext): with and without client certificates, a wrong CA, a
plain client, `verify: true` without a certificate, `handshake_first`, `allow_non_tls`, and
HTTPS monitoring. The CA and certificates are made at run time (cryptography), never
committed."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import socket
import ssl
import urllib.request
from pathlib import Path

import nats
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

STEP = 5.0


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def _cert(subject: str, key, issuer_name, issuer_key, *, ca=False, sans=(), client=False):
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer_name or x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        b = b.add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    if client:
        b = b.add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
    return b.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tls")
    for prefix in ("", "other-"):
        ca_key = _key()
        ca = _cert(f"{prefix}Test CA", ca_key, None, ca_key, ca=True)
        (d / f"{prefix}ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
        ck = _key()
        cc = _cert("alice", ck, ca.subject, ca_key, client=True,
                   sans=[x509.RFC822Name("alice@example.org")])
        (d / f"{prefix}client-cert.pem").write_bytes(cc.public_bytes(serialization.Encoding.PEM))
        _write_key(d / f"{prefix}client-key.pem", ck)
        if prefix == "":
            sk = _key()
            sc = _cert("localhost", sk, ca.subject, ca_key,
                       sans=[x509.DNSName("localhost"),
                             x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
            (d / "server-cert.pem").write_bytes(sc.public_bytes(serialization.Encoding.PEM))
            _write_key(d / "server-key.pem", sk)
    return d


def tls_block(certs: Path, extra: str = "") -> str:
    return (
        f'tls {{ cert_file: "{certs / "server-cert.pem"}", '
        f'key_file: "{certs / "server-key.pem"}" {extra} }}\n'
    )


def verify_extra(certs: Path) -> str:
    return f', ca_file: "{certs / "ca.pem"}", verify: true'


def client_ctx(certs: Path, *, cert: str | None = None, ca: str = "ca.pem") -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(certs / ca))
    if cert is not None:
        ctx.load_cert_chain(str(certs / f"{cert}client-cert.pem"), str(certs / f"{cert}client-key.pem"))
    return ctx


async def _silent(_err):
    pass


async def tls_connect(srv, **opts):
    opts.setdefault("allow_reconnect", False)
    opts.setdefault("max_reconnect_attempts", 0)
    opts.setdefault("connect_timeout", STEP)
    opts.setdefault("error_cb", _silent)
    return await nats.connect(srv.url, **opts)


async def round_trip(nc) -> None:
    sub = await nc.subscribe("tls.test")
    await nc.publish("tls.test", b"secret")
    msg = await sub.next_msg(timeout=STEP)
    assert msg.data == b"secret"


def plain_info(srv) -> tuple[socket.socket, dict]:
    s = socket.create_connection((srv.host, srv.port), timeout=STEP)
    buf = b""
    while b"\r\n" not in buf:
        chunk = s.recv(4096)
        assert chunk, f"closed before INFO: {buf!r}"
        buf += chunk
    line = buf.split(b"\r\n", 1)[0]
    assert line.startswith(b"INFO "), line
    return s, json.loads(line[5:])


async def test_tls_without_client_certificates(server_factory, certs):
    srv = server_factory(tls_block(certs))
    s, info = plain_info(srv)
    s.close()
    assert info["tls_required"] is True
    assert "tls_verify" not in info
    nc = await tls_connect(srv, tls=client_ctx(certs))
    try:
        await round_trip(nc)
    finally:
        await nc.close()


async def test_tls_with_client_certificate(server_factory, certs):
    srv = server_factory(tls_block(certs, verify_extra(certs)))
    s, info = plain_info(srv)
    s.close()
    assert info["tls_required"] is True and info["tls_verify"] is True
    nc = await tls_connect(srv, tls=client_ctx(certs, cert=""))
    try:
        await round_trip(nc)
    finally:
        await nc.close()


async def test_verify_without_a_client_certificate_is_refused(server_factory, certs):
    srv = server_factory(tls_block(certs, verify_extra(certs)))
    with pytest.raises(Exception):
        await tls_connect(srv, tls=client_ctx(certs))


async def test_client_certificate_of_another_ca_is_refused(server_factory, certs):
    srv = server_factory(tls_block(certs, verify_extra(certs)))
    with pytest.raises(Exception):
        await tls_connect(srv, tls=client_ctx(certs, cert="other-"))


async def test_client_trusting_the_wrong_ca_fails(server_factory, certs):
    srv = server_factory(tls_block(certs))
    with pytest.raises(ssl.SSLCertVerificationError):
        await tls_connect(srv, tls=client_ctx(certs, ca="other-ca.pem"))


async def test_plain_client_gets_nothing_after_info(server_factory, certs):
    srv = server_factory(tls_block(certs))
    s, info = plain_info(srv)
    assert info["tls_required"] is True
    s.sendall(b'CONNECT {"verbose":false}\r\nPING\r\n')
    rest = b""
    while True:
        chunk = s.recv(4096)
        if not chunk:
            break
        rest += chunk
    s.close()
    # Neither a PONG nor a TLS alert: the connection just closes.
    assert rest == b""


async def test_handshake_first(server_factory, certs):
    srv = server_factory(tls_block(certs, ", handshake_first: true"))
    # In plain text the server says nothing: it waits for the handshake.
    s = socket.create_connection((srv.host, srv.port), timeout=0.3)
    with pytest.raises(socket.timeout):
        s.recv(1)
    s.close()
    nc = await tls_connect(srv, tls=client_ctx(certs), tls_handshake_first=True)
    try:
        assert nc._server_info["tls_required"] is True
        await round_trip(nc)
    finally:
        await nc.close()


async def test_allow_non_tls(server_factory, certs):
    srv = server_factory(tls_block(certs) + "allow_non_tls: true\n")
    s, info = plain_info(srv)
    s.close()
    assert info.get("tls_available") is True and "tls_required" not in info
    plain = await tls_connect(srv)
    secure = await tls_connect(srv, tls=client_ctx(certs))
    try:
        await round_trip(plain)
        await round_trip(secure)
    finally:
        await plain.close()
        await secure.close()


def _monitor_port(srv, scheme: str) -> int:
    needle = f"Starting {scheme} monitor on"
    loop_until = asyncio.get_event_loop().time() + STEP
    while True:
        for line in srv.log_text(100000).splitlines():
            if needle in line:
                return int(line.rsplit(":", 1)[1])
        assert asyncio.get_event_loop().time() < loop_until, srv.log_text()


async def test_https_monitoring(server_factory, certs):
    srv = server_factory("https_port: -1\n" + tls_block(certs, verify_extra(certs)))
    port = _monitor_port(srv, "https")
    nc = await tls_connect(srv, tls=client_ctx(certs, cert=""))
    try:
        ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        # No client certificate is needed for monitoring, even with `verify: true`.
        loop = asyncio.get_running_loop()
        body = await loop.run_in_executor(
            None,
            lambda: urllib.request.urlopen(f"https://localhost:{port}/connz", context=ctx, timeout=STEP).read(),
        )
        connz = json.loads(body)
        conn = connz["connections"][0]
        assert conn["tls_version"] in ("1.2", "1.3")
        assert conn["tls_cipher_suite"].startswith("TLS_")
    finally:
        await nc.close()
