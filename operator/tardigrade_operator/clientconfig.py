"""Which cluster and namespace a command-line call means, resolved the way kubectl does.

kubectl (client-go `clientcmd`, `DeferredLoadingClientConfig`) reads the kubeconfig named by
--kubeconfig, else $KUBECONFIG, else ~/.kube/config, and uses the chosen context's namespace
when -n is not given. Only when no kubeconfig exists does it fall back to the in-cluster
service account, whose namespace is $POD_NAMESPACE or the service account's namespace file
(`inClusterClientConfig.Namespace`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import kubernetes

from tardigrade_operator.apidecode import BoundedApiClient

DEFAULT_KUBECONFIG = Path("~/.kube/config")
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class ClientConfigError(Exception):
    """The kubeconfig or context cannot be used; the message says what to pass instead."""


@dataclasses.dataclass(frozen=True)
class Target:
    client: kubernetes.client.ApiClient
    namespace: str


def resolve(kubeconfig: str | None = None, context: str | None = None) -> Target:
    """An API client and the default namespace for --kubeconfig/--context (None: kubectl's)."""
    if kubeconfig is not None and not Path(kubeconfig).is_file():
        raise ClientConfigError(f"--kubeconfig {kubeconfig}: no such file")
    path = kubeconfig or os.environ.get("KUBECONFIG") or (
        str(DEFAULT_KUBECONFIG.expanduser()) if DEFAULT_KUBECONFIG.expanduser().exists() else None)
    if path is None:
        if context is not None:
            raise ClientConfigError(f"--context {context}: no kubeconfig ($KUBECONFIG, "
                                    "~/.kube/config) to find it in; pass --kubeconfig PATH")
        return _in_cluster()
    try:
        contexts, active = kubernetes.config.list_kube_config_contexts(config_file=path)
    except (kubernetes.config.ConfigException, FileNotFoundError) as err:
        raise ClientConfigError(f"cannot read the kubeconfig {path}: {err}; pass "
                                "--kubeconfig PATH") from None
    if context is not None:
        chosen = next((c for c in contexts if c["name"] == context), None)
        if chosen is None:
            names = ", ".join(sorted(c["name"] for c in contexts)) or "none"
            raise ClientConfigError(f"--context {context}: no such context in the kubeconfig "
                                    f"(contexts: {names})")
    elif active is None:
        raise ClientConfigError("the kubeconfig has no current-context: pass --context NAME")
    else:
        chosen = active
    configuration = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=path, context=chosen["name"],
                                       client_configuration=configuration)
    namespace = (chosen.get("context") or {}).get("namespace") or "default"
    return Target(BoundedApiClient(configuration), namespace)


def _in_cluster() -> Target:
    configuration = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=configuration)
    except kubernetes.config.ConfigException:
        raise ClientConfigError("no kubeconfig (~/.kube/config, $KUBECONFIG) and not in a pod: "
                                "pass --kubeconfig PATH") from None
    namespace = os.environ.get("POD_NAMESPACE") or (
        SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
        if SERVICE_ACCOUNT_NAMESPACE.exists() else "default")
    return Target(BoundedApiClient(configuration), namespace)
