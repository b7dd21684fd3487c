"""A container's environment, resolved the way the kubelet does it.

Pure functions: the caller fetches the ConfigMaps and Secrets the pod refers to.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from kubernetes.utils import parse_quantity

_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class EnvError(ValueError):
    """A reference the kubelet cannot resolve (the real one reports CreateContainerConfigError)."""


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: unknown references stay literal, `$$` escapes."""

    def sub(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env.get(name, match.group(0))

    return _VAR_REF.sub(sub, text)


def field_value(pod: Mapping[str, Any], path: str) -> str:
    """The downward API's `fieldRef.fieldPath` for the paths the real kubelet supports."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName") or "default",
        "status.hostIP": status.get("hostIP"),
        "status.podIP": status.get("podIP"),
        "status.hostIPs": ",".join(x["ip"] for x in status.get("hostIPs") or []),
        "status.podIPs": ",".join(x["ip"] for x in status.get("podIPs") or []),
    }
    if path in simple:
        return simple[path] or ""
    if path in ("metadata.labels", "metadata.annotations"):
        items = meta.get(path.split(".", 1)[1]) or {}
        return "\n".join(f'{k}="{v}"' for k, v in sorted(items.items()))
    for prefix in ("metadata.labels", "metadata.annotations"):
        match = re.fullmatch(re.escape(prefix) + r"\['(.+)'\]", path)
        if match:
            return str((meta.get(prefix.split(".", 1)[1]) or {}).get(match.group(1), ""))
    raise EnvError(f'unsupported fieldRef fieldPath "{path}"')


def resource_value(container: Mapping[str, Any], ref: Mapping[str, Any]) -> str:
    """`resourceFieldRef`: a limit or request divided by the divisor, rounded up."""
    resource = ref["resource"]
    section, _, name = resource.partition(".")
    value = ((container.get("resources") or {}).get(section) or {}).get(name)
    if value is None:
        return "0"
    divisor = parse_quantity(str(ref.get("divisor") or "1"))
    quotient = parse_quantity(str(value)) / divisor
    return str(int(-(-quotient // 1)))


def container_env(
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    configmaps: Mapping[str, Mapping[str, str]],
    secrets: Mapping[str, Mapping[str, str]],
) -> dict[str, str]:
    """`envFrom` then `env`, in order, each value expanded against what came before."""
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix") or ""
        if "configMapRef" in source:
            ref, store, kind = source["configMapRef"], configmaps, "configmap"
        else:
            ref, store, kind = source.get("secretRef") or {}, secrets, "secret"
        data = store.get(ref.get("name", ""))
        if data is None:
            if ref.get("optional"):
                continue
            raise EnvError(f'{kind} "{ref.get("name")}" not found')
        env.update({prefix + k: v for k, v in data.items()})
    for var in container.get("env") or []:
        name = var["name"]
        if "valueFrom" not in var:
            env[name] = expand(str(var.get("value") or ""), env)
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            env[name] = field_value(pod, source["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in source:
            env[name] = resource_value(container, source["resourceFieldRef"])
        else:
            kind, ref, store = (
                ("configmap", source["configMapKeyRef"], configmaps)
                if "configMapKeyRef" in source
                else ("secret", source["secretKeyRef"], secrets)
            )
            data = store.get(ref["name"])
            if data is None or ref["key"] not in data:
                if ref.get("optional"):
                    continue
                what = f'{kind} "{ref["name"]}"' if data is None else f'key "{ref["key"]}"'
                raise EnvError(f"couldn't find {what} in {kind} {ref['name']}")
            env[name] = data[ref["key"]]
    return env


def referenced_objects(spec: Mapping[str, Any]) -> tuple[set[str], set[str]]:
    """Names of the ConfigMaps and Secrets that the pod's containers read env from."""
    configmaps: set[str] = set()
    secrets: set[str] = set()
    containers: Sequence[Mapping[str, Any]] = [
        *(spec.get("initContainers") or []),
        *(spec.get("containers") or []),
    ]
    for container in containers:
        for source in container.get("envFrom") or []:
            if "configMapRef" in source:
                configmaps.add(source["configMapRef"]["name"])
            if "secretRef" in source:
                secrets.add(source["secretRef"]["name"])
        for var in container.get("env") or []:
            source = var.get("valueFrom") or {}
            if "configMapKeyRef" in source:
                configmaps.add(source["configMapKeyRef"]["name"])
            if "secretKeyRef" in source:
                secrets.add(source["secretKeyRef"]["name"])
    return configmaps, secrets
