"""What a container process is started with: argv, environment, termination message.

Pure apart from `env_sources`, which fetches the ConfigMaps and Secrets a pod reads env from.
"""

from __future__ import annotations

import base64
import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tardigrade_local import crilog
from tardigrade_local.gke.client import ApiClient, core_path
from tardigrade_local.kubelet.config import PODSITE_DIR, KubeletSettings
from tardigrade_local.kubelet.credentials import service_account_volume, write_pod_kubeconfig
from tardigrade_local.kubelet.env import container_env, expand, referenced_objects
from tardigrade_local.kubelet.network import CLUSTER_DOMAIN
from tardigrade_local.kubelet.volumes import container_mounts, map_path

DEFAULT_TERMINATION_MESSAGE_PATH = "/dev/termination-log"
ENV_TERMINATION_LOG = "TARDIGRADE_TERMINATION_LOG"
TERMINATION_MESSAGE_LIMIT = 4096
FALLBACK_LOG_LINES = 80
FALLBACK_LOG_BYTES = 2048
# Only these come from the kubelet's own environment; a pod does not inherit the host's.
INHERITED_ENV = ("PATH", "LANG", "LC_ALL", "TZ", "TMPDIR")

Sources = dict[str, dict[str, str]]


def pod_credentials(settings: KubeletSettings, pod: Mapping[str, Any],
                    volumes: Mapping[str, Path]) -> str | None:
    """The pod's kubeconfig (written now) from its service-account volume, or None if the
    API server gave it none (it opted out)."""
    name = service_account_volume(pod["spec"])
    if name is None or name not in volumes:
        return None
    return str(write_pod_kubeconfig(volumes[name], settings.api_url, pod, settings.ca_pem))


async def env_sources(client: ApiClient, namespace: str,
                      pod_spec: Mapping[str, Any]) -> tuple[Sources, Sources]:
    configmap_names, secret_names = referenced_objects(pod_spec)
    configmaps: Sources = {}
    secrets: Sources = {}
    for name in configmap_names:
        obj = await client.get(core_path("configmaps", namespace, name))
        if obj is not None:
            configmaps[name] = dict(obj.get("data") or {})
    for name in secret_names:
        obj = await client.get(core_path("secrets", namespace, name))
        if obj is not None:
            data = {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}
            secrets[name] = {**data, **(obj.get("stringData") or {})}
    return configmaps, secrets


def pod_base_env(settings: KubeletSettings, pod: Mapping[str, Any], pod_ip: str,
                 kubeconfig: str | None = None) -> dict[str, str]:
    meta, spec = pod["metadata"], pod["spec"]
    layout = settings.layout
    inherited = {k: v for k, v in os.environ.items() if k in INHERITED_ENV}
    python_path = [str(PODSITE_DIR), *settings.python_path]
    # API access comes as KUBECONFIG, not KUBERNETES_SERVICE_HOST: see `credentials`.
    credentials = {"KUBECONFIG": kubeconfig} if kubeconfig else {}
    return {
        **inherited,
        **credentials,
        "HOME": str(layout.pod_dir(meta.get("namespace") or "default", meta["name"])),
        "HOSTNAME": spec.get("hostname") or meta["name"],
        "PYTHONPATH": os.pathsep.join(python_path),
        "TARDIGRADE_HOSTS_FILE": str(layout.hosts_file),
        "TARDIGRADE_POD_IP": pod_ip,
        # The pod's own names, as the kubelet-managed /etc/hosts lists them
        # (`managedHostsFileContent`, pkg/kubelet/kubelet_pods.go): its FQDN when it has a
        # subdomain, resolvable before cluster DNS has caught up with the pod.
        "TARDIGRADE_POD_NAMES": ",".join(own_names(pod)),
        **settings.cluster_env,
    }


def own_names(pod: Mapping[str, Any]) -> list[str]:
    meta, spec = pod["metadata"], pod["spec"]
    hostname, subdomain = spec.get("hostname") or meta["name"], spec.get("subdomain")
    if not subdomain:
        return [hostname]
    namespace = meta.get("namespace") or "default"
    base = f"{hostname}.{subdomain}"
    return [f"{base}.{namespace}.svc.{CLUSTER_DOMAIN}", f"{base}.{namespace}.svc",
            f"{base}.{namespace}", base, hostname]


def container_launch(settings: KubeletSettings, pod: Mapping[str, Any],
                     spec: Mapping[str, Any], pod_ip: str, host_ip: str,
                     configmaps: Sources, secrets: Sources,
                     kubeconfig: str | None = None, volumes: Mapping[str, Path] | None = None,
                     ) -> tuple[list[str], dict[str, str]]:
    """argv and env of one container; raises ImagePullError or EnvError like the kubelet's
    ErrImagePull and CreateContainerConfigError. `kubeconfig`: the pod's API credentials;
    `volumes`: the pod's volumes set up on the node (`volumes.set_up`)."""
    meta = pod["metadata"]
    image_rule = settings.image_map.resolve(spec.get("image", ""))
    # The downward API sees the addresses this kubelet assigned, reported or not.
    status = {**(pod.get("status") or {}), "podIP": pod_ip, "podIPs": [{"ip": pod_ip}],
              "hostIP": host_ip, "hostIPs": [{"ip": host_ip}]}
    own_env = container_env({**pod, "status": status}, spec, configmaps, secrets)
    term_path = str(settings.layout.termination_log(meta.get("namespace") or "default",
                                                    meta["name"], spec["name"]))
    declared = spec.get("terminationMessagePath") or DEFAULT_TERMINATION_MESSAGE_PATH
    # The container's idea of its termination-log path is mapped to a file of its own.
    own_env = {k: (term_path if v == declared else v) for k, v in own_env.items()}
    command = [expand(str(x), own_env) for x in spec.get("command") or []]
    args = [expand(str(x), own_env) for x in spec.get("args") or []]
    argv = settings.image_map.argv(spec.get("image", ""), command, args)
    argv = [term_path if x == declared else x for x in argv]
    # No mount namespace: paths inside volumeMounts lead to the volumes' directories instead.
    mounts = container_mounts(spec, volumes or {}, own_env)
    own_env = {k: map_path(v, mounts) for k, v in own_env.items()}
    argv = [map_path(x, mounts) for x in argv]
    base = pod_base_env(settings, pod, pod_ip, kubeconfig)
    if image_rule.bin_dir:
        # A shipped image runs from its own venv: none of the checkout's sources, only the pod
        # network that the runtime (not the image) provides.
        base["PYTHONPATH"] = str(PODSITE_DIR)
        base["PATH"] = image_rule.search_path(base.get("PATH", os.defpath))
    env = {**base, **dict(image_rule.env), **own_env}
    if own_env.get("PYTHONPATH"):
        # The image's own packages and pod networking stay importable, as site-packages of a
        # real image would.
        env["PYTHONPATH"] = os.pathsep.join([base["PYTHONPATH"], own_env["PYTHONPATH"]])
    env[ENV_TERMINATION_LOG] = term_path
    return argv, env


def termination_message(spec: Mapping[str, Any], term_path: Path, log_path: Path,
                        code: int) -> str:
    """The file's first 4 KiB; with FallbackToLogsOnError and a failure, the log's tail."""
    message = ""
    with contextlib.suppress(OSError):
        message = term_path.read_bytes()[:TERMINATION_MESSAGE_LIMIT].decode(errors="replace")
    fallback = spec.get("terminationMessagePolicy") == "FallbackToLogsOnError"
    if not message and code != 0 and fallback:
        with contextlib.suppress(OSError):
            lines = crilog.text(log_path.read_bytes()).splitlines()[-FALLBACK_LOG_LINES:]
            message = "\n".join(lines)[-FALLBACK_LOG_BYTES:]
    return message
