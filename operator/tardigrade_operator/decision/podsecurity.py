"""The Pod Security Standards (baseline, restricted) as checks on a pod manifest.

Follows upstream Pod Security Admission, `staging/src/k8s.io/pod-security-admission/policy`
(one `check_*.go` per rule below, latest version of each), so that a pod this module passes is
one a namespace labelled `pod-security.kubernetes.io/enforce=<level>` admits. The operator runs
it on the pods it renders, before creating them: a TrainingJob must not be a way to create a
pod its author could not create directly. tests/operator/test_podsecurity.py holds it to the
upstream fixtures (`pod-security-admission/test/testdata`).

Checks report the pod field they object to (`spec.volumes[0].hostPath`), as upstream's field
errors do; the caller maps that back to the TrainingJob field it came from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any, Literal

Level = Literal["privileged", "baseline", "restricted"]
LEVELS: tuple[Level, ...] = ("privileged", "baseline", "restricted")

APPARMOR_ANNOTATION_PREFIX = "container.apparmor.security.beta.kubernetes.io/"
# Deprecated seccomp annotations. PSA stopped reading them at v1.19 (check_seccomp_baseline.go
# covers only older policy versions), but a cluster that still honours them would run the pod
# unconfined; refusing `unconfined` costs nothing.
SECCOMP_POD_ANNOTATION = "seccomp.security.alpha.kubernetes.io/pod"
SECCOMP_CONTAINER_ANNOTATION_PREFIX = "container.seccomp.security.alpha.kubernetes.io/"

# check_capabilities_baseline.go: what baseline allows in capabilities.add.
BASELINE_CAPABILITIES = frozenset({
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
    "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
})
# check_sysctls.go: the safe set, as grown in 1.27 (ip_local_reserved_ports), 1.29 (tcp
# keepalive/fin timeout) and 1.32 (tcp_rmem/tcp_wmem).
SAFE_SYSCTLS = frozenset({
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.ip_local_reserved_ports", "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes",
    "net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem",
})
# check_seLinuxOptions.go (container_engine_t since 1.31).
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t",
                           "container_engine_t"})
# check_restrictedVolumes.go: the only volume sources restricted allows (image since 1.33).
RESTRICTED_VOLUME_TYPES = frozenset({"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                                     "persistentVolumeClaim", "projected", "secret", "image"})
_VOLUME_KEYS_NOT_SOURCES = frozenset({"name"})


@dataclasses.dataclass(frozen=True)
class Violation:
    check: str  # upstream's check ID, e.g. hostPathVolumes
    level: Level  # the lowest level that forbids it
    field: str  # pod field path, e.g. spec.volumes[0].hostPath
    detail: str

    def __str__(self) -> str:
        return f"{self.field}: {self.detail} (Pod Security {self.level}: {self.check})"


def check_pod(pod: Mapping[str, Any], level: Level) -> list[Violation]:
    """Everything in `pod` (a v1 Pod manifest) that Pod Security `level` forbids."""
    if level == "privileged":
        return []
    found = list(_baseline(pod))
    if level == "restricted":
        found += _restricted(pod)
    return found


# ------------------------------------------------------------------------------ helpers ---


def _containers(spec: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(field path, container) for containers, initContainers and ephemeralContainers."""
    for kind in ("containers", "initContainers", "ephemeralContainers"):
        for i, container in enumerate(spec.get(kind) or []):
            yield f"spec.{kind}[{i}]", container


def _context(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("securityContext") or {}


def _is_windows(spec: Mapping[str, Any]) -> bool:
    # Since policy v1.25 restricted's Linux-only checks skip pods that declare os.name windows.
    return (spec.get("os") or {}).get("name") == "windows"


# ----------------------------------------------------------------------------- baseline ---


def _baseline(pod: Mapping[str, Any]) -> Iterator[Violation]:
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    pod_ctx = _context(spec)

    def v(check: str, field: str, detail: str) -> Violation:
        return Violation(check, "baseline", field, detail)

    # check_hostNamespaces.go
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key) is True:
            yield v("hostNamespaces", f"spec.{key}", f"{key}=true shares the node's namespace")
    # check_hostPathVolumes.go, check_volumes_baseline.go
    for i, volume in enumerate(spec.get("volumes") or []):
        if volume.get("hostPath") is not None:
            yield v("hostPathVolumes", f"spec.volumes[{i}].hostPath",
                    f"volume {volume.get('name')!r} mounts a path of the node")
        if volume.get("gitRepo") is not None:
            yield v("baselineVolumes", f"spec.volumes[{i}].gitRepo",
                    f"volume {volume.get('name')!r} uses the gitRepo volume type")
    # check_appArmorProfile.go: the annotation and (1.30+) the field.
    for key, value in (meta.get("annotations") or {}).items():
        if key.startswith(APPARMOR_ANNOTATION_PREFIX) and not (
                value in ("", "runtime/default") or str(value).startswith("localhost/")):
            yield v("appArmorProfile", f"metadata.annotations[{key}]",
                    f"AppArmor profile {value!r} (allowed: runtime/default, localhost/*)")
        if (key == SECCOMP_POD_ANNOTATION or key.startswith(SECCOMP_CONTAINER_ANNOTATION_PREFIX)) \
                and value == "unconfined":
            yield v("seccompProfile", f"metadata.annotations[{key}]",
                    "seccomp profile 'unconfined'")
    for path, obj in [("spec", spec), *_containers(spec)]:
        ctx = _context(obj)
        where = f"{path}.securityContext"
        profile = (ctx.get("appArmorProfile") or {}).get("type")
        if profile not in (None, "RuntimeDefault", "Localhost"):
            yield v("appArmorProfile", f"{where}.appArmorProfile.type",
                    f"AppArmor profile type {profile!r} (allowed: RuntimeDefault, Localhost)")
        # check_seccompProfile_baseline.go
        if (ctx.get("seccompProfile") or {}).get("type") == "Unconfined":
            yield v("seccompProfile", f"{where}.seccompProfile.type",
                    "seccomp profile type 'Unconfined'")
        # check_seLinuxOptions.go
        selinux = ctx.get("seLinuxOptions") or {}
        if selinux.get("type", "") not in SELINUX_TYPES:
            yield v("seLinuxOptions", f"{where}.seLinuxOptions.type",
                    f"SELinux type {selinux['type']!r}")
        for key in ("user", "role"):
            if selinux.get(key):
                yield v("seLinuxOptions", f"{where}.seLinuxOptions.{key}",
                        f"SELinux {key} may not be set")
        # check_windowsHostProcess.go
        if (ctx.get("windowsOptions") or {}).get("hostProcess") is True:
            yield v("windowsHostProcess", f"{where}.windowsOptions.hostProcess",
                    "Windows HostProcess containers")
    for path, container in _containers(spec):
        ctx = _context(container)
        where = f"{path}.securityContext"
        # check_privileged.go
        if ctx.get("privileged") is True:
            yield v("privileged", f"{where}.privileged", "privileged container")
        # check_capabilities_baseline.go
        for j, cap in enumerate((ctx.get("capabilities") or {}).get("add") or []):
            if cap not in BASELINE_CAPABILITIES:
                yield v("capabilities", f"{where}.capabilities.add[{j}]",
                        f"capability {cap!r} beyond the baseline set")
        # check_procMount_baseline.go: Unmasked only inside a user namespace (1.35).
        mount = ctx.get("procMount")
        if mount not in (None, "", "Default") and spec.get("hostUsers") is not False:
            yield v("procMount", f"{where}.procMount", f"procMount {mount!r}")
        # check_hostPorts.go
        for j, port in enumerate(container.get("ports") or []):
            if port.get("hostPort"):
                yield v("hostPorts", f"{path}.ports[{j}].hostPort",
                        f"hostPort {port['hostPort']}")
        # check_hostProbesAndhostLifecycle.go (1.34): probes and hooks stay on the pod.
        for probe_key in ("livenessProbe", "readinessProbe", "startupProbe"):
            yield from _host_handler(container.get(probe_key), f"{path}.{probe_key}", v)
        for hook in ("postStart", "preStop"):
            yield from _host_handler((container.get("lifecycle") or {}).get(hook),
                                     f"{path}.lifecycle.{hook}", v)
    # check_sysctls.go
    for i, sysctl in enumerate(pod_ctx.get("sysctls") or []):
        if sysctl.get("name") not in SAFE_SYSCTLS:
            yield v("sysctls", f"spec.securityContext.sysctls[{i}].name",
                    f"sysctl {sysctl.get('name')!r} is not in the safe set")


def _host_handler(handler: Mapping[str, Any] | None, path: str, v: Any) -> Iterator[Violation]:
    for kind in ("httpGet", "tcpSocket"):
        host = ((handler or {}).get(kind) or {}).get("host")
        if host:
            yield v("hostProbesAndHostLifecycle", f"{path}.{kind}.host",
                    f"{kind} to host {host!r} (probes and hooks must target the pod)")


# --------------------------------------------------------------------------- restricted ---


def _restricted(pod: Mapping[str, Any]) -> Iterator[Violation]:
    spec = pod.get("spec") or {}
    pod_ctx = _context(spec)
    windows = _is_windows(spec)

    def v(check: str, field: str, detail: str) -> Violation:
        return Violation(check, "restricted", field, detail)

    # check_restrictedVolumes.go
    for i, volume in enumerate(spec.get("volumes") or []):
        kinds = sorted(set(volume) - _VOLUME_KEYS_NOT_SOURCES - RESTRICTED_VOLUME_TYPES)
        for kind in kinds:
            if kind not in ("hostPath", "gitRepo"):  # baseline already names those
                yield v("restrictedVolumes", f"spec.volumes[{i}].{kind}",
                        f"volume {volume.get('name')!r} uses the {kind} volume type")
    # check_runAsNonRoot.go: the pod sets it, or every container does; nobody sets false.
    pod_non_root = pod_ctx.get("runAsNonRoot")
    if pod_non_root is False:
        yield v("runAsNonRoot", "spec.securityContext.runAsNonRoot", "runAsNonRoot=false")
    # check_runAsUser.go
    if pod_ctx.get("runAsUser") == 0:
        yield v("runAsUser", "spec.securityContext.runAsUser", "runAsUser=0 (root)")
    # check_seccompProfile_restricted.go
    pod_seccomp = (pod_ctx.get("seccompProfile") or {}).get("type")
    for path, container in _containers(spec):
        ctx = _context(container)
        where = f"{path}.securityContext"
        non_root = ctx.get("runAsNonRoot")
        if non_root is False:
            yield v("runAsNonRoot", f"{where}.runAsNonRoot", "runAsNonRoot=false")
        elif non_root is None and pod_non_root is not True:
            yield v("runAsNonRoot", f"{where}.runAsNonRoot",
                    "runAsNonRoot must be true (on the pod or the container)")
        if ctx.get("runAsUser") == 0:
            yield v("runAsUser", f"{where}.runAsUser", "runAsUser=0 (root)")
        if windows:
            continue
        if ctx.get("allowPrivilegeEscalation") is not False:
            yield v("allowPrivilegeEscalation", f"{where}.allowPrivilegeEscalation",
                    "allowPrivilegeEscalation must be false")
        seccomp = (ctx.get("seccompProfile") or {}).get("type")
        if seccomp is None and pod_seccomp not in ("RuntimeDefault", "Localhost"):
            yield v("seccompProfile", f"{where}.seccompProfile.type",
                    "seccompProfile.type must be RuntimeDefault or Localhost (on the pod or "
                    "the container)")
        elif seccomp is not None and seccomp not in ("RuntimeDefault", "Localhost",
                                                     "Unconfined"):
            yield v("seccompProfile", f"{where}.seccompProfile.type",
                    f"seccomp profile type {seccomp!r}")
        caps = ctx.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            yield v("capabilities", f"{where}.capabilities.drop",
                    "capabilities.drop must include ALL")
        for j, cap in enumerate(caps.get("add") or []):
            # Beyond the baseline set, baseline has already said so.
            if cap != "NET_BIND_SERVICE" and cap in BASELINE_CAPABILITIES:
                yield v("capabilities", f"{where}.capabilities.add[{j}]",
                        f"capability {cap!r} (restricted allows only NET_BIND_SERVICE)")
        # check_procMount_restricted.go: Default only, user namespace or not.
        mount = ctx.get("procMount")
        if mount not in (None, "", "Default") and spec.get("hostUsers") is False:
            yield v("procMount", f"{where}.procMount", f"procMount {mount!r}")
