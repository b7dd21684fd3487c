"""What a simulated container starts with: its environment, and its termination message.

Pure apart from `env_sources`, which fetches the ConfigMaps and Secrets a pod reads env from.
A simulated container runs no program (`simulated.py`): only its environment matters, which
says whether it is a Tardigrade rank and which.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tardigrade_contract import contract

from tardigrade_local.gke.client import ApiClient, core_path
from tardigrade_local.simulator.config import SimulatorSettings
from tardigrade_local.simulator.env import container_env, referenced_objects
from tardigrade_local.simulator.volumes import container_mounts, map_path

DEFAULT_TERMINATION_MESSAGE_PATH = "/dev/termination-log"
TERMINATION_MESSAGE_LIMIT = 4096

Sources = dict[str, dict[str, str]]


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


def container_env_of(settings: SimulatorSettings, pod: Mapping[str, Any],
                     spec: Mapping[str, Any], pod_ip: str, host_ip: str,
                     configmaps: Sources, secrets: Sources,
                     volumes: Mapping[str, Path] | None = None) -> dict[str, str]:
    """The environment of one simulated container; raises EnvError like the kubelet's
    CreateContainerConfigError. `volumes`: the pod's volumes set up on the node
    (`volumes.set_up`): paths under a mount lead to the volume's directory."""
    meta = pod["metadata"]
    # The downward API sees the addresses this kubelet assigned, reported or not.
    status = {**(pod.get("status") or {}), "podIP": pod_ip, "podIPs": [{"ip": pod_ip}],
              "hostIP": host_ip, "hostIPs": [{"ip": host_ip}]}
    own_env = container_env({**pod, "status": status}, spec, configmaps, secrets)
    term_path = str(settings.layout.termination_log(meta.get("namespace") or "default",
                                                    meta["name"], spec["name"]))
    declared = spec.get("terminationMessagePath") or DEFAULT_TERMINATION_MESSAGE_PATH
    # The container's idea of its termination-log path is mapped to a file of its own.
    own_env = {k: (term_path if v == declared else v) for k, v in own_env.items()}
    mounts = container_mounts(spec, volumes or {}, own_env)
    own_env = {k: map_path(v, mounts) for k, v in own_env.items()}
    return {contract.ENV_POD_IP: pod_ip, **settings.cluster_env, **own_env,
            contract.ENV_TERMINATION_LOG: term_path}


def termination_message(term_path: Path) -> str:
    """The termination-log file's first 4 KiB."""
    with contextlib.suppress(OSError):
        return term_path.read_bytes()[:TERMINATION_MESSAGE_LIMIT].decode(errors="replace")
    return ""
