"""The writer's concurrent pod patches get a connection each (kube.load_client_config)."""

from __future__ import annotations

from pathlib import Path

import kubernetes
import pytest
from tardigrade_operator.apply import kube

KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:6443"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


def test_the_client_pool_holds_every_concurrent_patch(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "kubeconfig"
    path.write_text(KUBECONFIG)
    # The client reads KUBECONFIG once, at import.
    monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    before = kubernetes.client.Configuration.get_default_copy()
    try:
        kube.load_client_config()
        config = kubernetes.client.Configuration.get_default_copy()
        assert config.host == "https://127.0.0.1:6443"
        assert config.connection_pool_maxsize >= kube.PATCH_CONCURRENCY
    finally:
        kubernetes.client.Configuration.set_default(before)
