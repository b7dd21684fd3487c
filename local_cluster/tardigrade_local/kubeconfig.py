"""Kubeconfig files, for kubectl, helm, the `kubernetes` client, kopf and the components."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import yaml


def _b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def write_kubeconfig(path: str | Path, url: str, context: str = "tardigrade-local",
                     namespace: str = "default", user: str | None = None, *,
                     token: str | None = None, ca_pem: bytes | str | None = None,
                     client_cert_pem: bytes | None = None, client_key_pem: bytes | None = None
                     ) -> Path:
    """A kubeconfig for `url` that authenticates with a bearer `token` or a client
    certificate; `ca_pem`: the CA an https server is checked against."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    user = user or context
    cluster: dict[str, Any] = {"server": url}
    if ca_pem is not None:
        cluster["certificate-authority-data"] = _b64(ca_pem)
    credentials: dict[str, str] = {}
    if token is not None:
        credentials["token"] = token
    if client_cert_pem is not None and client_key_pem is not None:
        credentials["client-certificate-data"] = _b64(client_cert_pem)
        credentials["client-key-data"] = _b64(client_key_pem)
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": context, "cluster": cluster}],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": context, "context": {"cluster": context, "user": user,
                                                   "namespace": namespace}}],
        "current-context": context,
        "preferences": {},
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path
