"""The serving certificate of the API server's TLS port: self-signed, made with `openssl`.

kubeadm gives kube-apiserver a certificate for its service IP, host names and addresses,
signed by the cluster CA that every kubeconfig and service-account mount carries as `ca.crt`.
Here the certificate is its own CA (one self-signed certificate for 127.0.0.1 and
localhost); clients trust it through `certificate-authority-data`. Made once per `pki_dir`.
"""

from __future__ import annotations

import shutil
import ssl
import subprocess
from pathlib import Path

CERT_FILE = "apiserver.crt"
KEY_FILE = "apiserver.key"


def ensure_serving_cert(pki_dir: Path) -> tuple[Path, Path]:
    """(certificate, key) in `pki_dir`, created if missing."""
    cert, key = pki_dir / CERT_FILE, pki_dir / KEY_FILE
    if cert.exists() and key.exists():
        return cert, key
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("the API server's TLS port needs the `openssl` command to make its "
                           "certificate: install openssl (Debian/Ubuntu: apt-get install "
                           "openssl), or run the server without secure_port")
    pki_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "3650", "-subj", "/CN=kube-apiserver",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc",
         "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,digitalSignature,keyCertSign",
         "-addext", "extendedKeyUsage=serverAuth",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60)
    key.chmod(0o600)
    return cert, key


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(cert), str(key))
    return context
