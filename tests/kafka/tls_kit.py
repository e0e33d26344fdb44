"""Certificates for the secured broker's tests, made with ``cryptography``: nothing checked in,
nothing that expires between runs.

A ``CertificateAuthority`` signs a server certificate for 127.0.0.1 and localhost; the broker's
keystore is its unencrypted PKCS#8 key followed by the certificate chain, in one PEM file, as
Kafka's ``ssl.keystore.type=PEM`` reads it. Clients get the CA's certificate as ``ssl_cafile``.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALID = datetime.timedelta(days=2)


@dataclass(frozen=True)
class CertificateAuthority:
    """A self-signed CA: its key signs, its certificate (``cert_pem``) is what clients trust."""

    name: str
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @classmethod
    def make(cls, name: str) -> CertificateAuthority:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = _name(name)
        cert = (
            _builder(subject, subject, key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_key_usage(signs_certificates=True), critical=True)
            .sign(key, hashes.SHA256())
        )
        return cls(name, key, cert)

    def write_cert(self, path: Path) -> Path:
        """The CA's certificate as PEM, a client's ``ssl_cafile``."""
        path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        return path

    def write_server_keystore(self, path: Path) -> Path:
        """A new key and a certificate for 127.0.0.1 and localhost signed by this CA, as one
        PEM file: the key (unencrypted PKCS#8), then the server's and the CA's certificates."""
        key = ec.generate_private_key(ec.SECP256R1())
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        cert = (
            _builder(_name("hmakv test broker"), self.cert.subject, key.public_key())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(signs_certificates=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        private_key = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        chain = [c.public_bytes(serialization.Encoding.PEM) for c in (cert, self.cert)]
        path.write_bytes(private_key + b"".join(chain))
        return path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    """Valid from an hour ago (a clock slightly behind still accepts it) for two days."""
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + _VALID)
    )


def _key_usage(*, signs_certificates: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=signs_certificates,
        crl_sign=signs_certificates,
        encipher_only=False,
        decipher_only=False,
    )
