"""The local cluster's certificate authority, and the identities it signs.

What kubeadm sets up for a cluster, made small: one CA that kube-apiserver trusts for client
certificates (`--client-ca-file`) and that signed its serving certificate, a key pair for
service-account tokens, and a client certificate per identity. Kubernetes reads a client
certificate's Common Name as the user and its Organizations as the groups (Kubernetes docs,
"Authenticating", X509 client certificates), so `system:node:NAME` in `system:nodes` is a
node to the Node authorizer and NodeRestriction, as a real kubelet's certificate is.

ECDSA P-256 throughout: kube-apiserver and client-go accept it, and it is generated in
microseconds, which matters for a test suite that starts many clusters.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=365)
# Names a pod (or kubectl) may use for the API server; the first address of the Service
# range is the `kubernetes` Service's ClusterIP (the API server allocates it).
API_SERVER_NAMES = ("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                    "kubernetes.default.svc.cluster.local")


@dataclasses.dataclass(frozen=True)
class KeyPair:
    cert_pem: bytes
    key_pem: bytes

    def write(self, directory: Path, name: str) -> tuple[Path, Path]:
        directory.mkdir(parents=True, exist_ok=True)
        cert, key = directory / f"{name}.crt", directory / f"{name}.key"
        cert.write_bytes(self.cert_pem)
        key.write_bytes(self.key_pem)
        key.chmod(0o600)
        return cert, key


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(common_name: str, organizations: Sequence[str] = ()) -> x509.Name:
    parts = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organizations]
    return x509.Name([*parts, x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


class Authority:
    """A CA that signs the cluster's serving and client certificates."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        self._key = key
        self.cert = cert

    @classmethod
    def create(cls, common_name: str = "tardigrade-local-ca") -> Authority:
        key = _new_key()
        now = datetime.datetime.now(datetime.UTC)
        name = _name(common_name)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + VALIDITY)
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                             crl_sign=True, content_commitment=False,
                                             key_encipherment=False, data_encipherment=False,
                                             key_agreement=False, encipher_only=False,
                                             decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        return cls(key, cert)

    @classmethod
    def load(cls, directory: Path, name: str = "ca") -> Authority:
        key = serialization.load_pem_private_key((directory / f"{name}.key").read_bytes(), None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        return cls(key, x509.load_pem_x509_certificate((directory / f"{name}.crt").read_bytes()))

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def key_pair(self) -> KeyPair:
        return KeyPair(self.cert_pem, _key_pem(self._key))

    def issue(self, common_name: str, organizations: Sequence[str] = (), *,
              client: bool = True, server: bool = False, dns_names: Sequence[str] = (),
              ip_addresses: Sequence[str] = ()) -> KeyPair:
        key = _new_key()
        now = datetime.datetime.now(datetime.UTC)
        usages = ([ExtendedKeyUsageOID.CLIENT_AUTH] if client else []) + (
            [ExtendedKeyUsageOID.SERVER_AUTH] if server else [])
        builder = (x509.CertificateBuilder().subject_name(_name(common_name, organizations))
                   .issuer_name(self.cert.subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + VALIDITY)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None),
                                  critical=True)
                   .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
        alt_names: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
        alt_names += [x509.IPAddress(ipaddress.ip_address(a)) for a in ip_addresses]
        if alt_names:
            builder = builder.add_extension(x509.SubjectAlternativeName(alt_names),
                                            critical=False)
        return KeyPair(builder.sign(self._key, hashes.SHA256()).public_bytes(
            serialization.Encoding.PEM), _key_pem(key))


def signing_key() -> KeyPair:
    """The service-account token signing key (`--service-account-signing-key-file`); the
    "cert" is its public key, for `--service-account-key-file`."""
    key = _new_key()
    public = key.public_key().public_bytes(serialization.Encoding.PEM,
                                           serialization.PublicFormat.SubjectPublicKeyInfo)
    return KeyPair(public, _key_pem(key))


def serving_names(service_ip: str, addresses: Sequence[str] = ("127.0.0.1",)
                  ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """DNS names and IPs the API server's serving certificate must carry."""
    return API_SERVER_NAMES, (*addresses, service_ip)
