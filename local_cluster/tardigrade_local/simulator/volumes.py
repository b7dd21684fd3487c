"""Pod volumes on a node's own disk: `emptyDir` and `hostPath`, and where a container's mount
paths lead.

Every node has a directory of its own standing for its root filesystem
(`StateLayout.node_root`); a node path `/x/y` is `<node root>/x/y`. Upstream behaviour:
- emptyDir (`pkg/volume/emptydir/empty_dir.go`): the directory is
  `/var/lib/kubelet/pods/<pod uid>/volumes/kubernetes.io~empty-dir/<name>` (`getPath`, through
  `GetPodVolumeDir` and `EscapeQualifiedName("kubernetes.io/empty-dir")`), created with mode
  0777 (`setupDir`, `defaultPerm`); it lives as long as the pod runs on the node (a container
  restart keeps it) and goes with the pod's volumes when the pod terminates or is deleted
  (`TearDownAt`; the volume manager's `findAndRemoveDeletedPods` drops a pod whose runtime was
  removed). `medium: Memory` would be a tmpfs: here it is a directory like any other.
- hostPath (`pkg/volume/hostpath/host_path.go`): the node's own path, no copy, nothing
  deleted. `SetUp` refuses a path with `..` (`ValidatePathNoBacksteps`) and checks `type`
  (`checkType`): DirectoryOrCreate makes the directory (0755), FileOrCreate an empty file
  (0644, not its parent), Directory/File/Socket/CharDevice/BlockDevice must already be that
  (`typeMatchedOrError`); an unset type checks nothing.
- A failed SetUp is a `FailedMount` event, `MountVolume.SetUp failed for volume "<name>" :
  <error>` (`pkg/volume/util/operationexecutor`, `VolumeToMount.GenerateError`); the pod
  stays `ContainerCreating` and the volume manager retries with exponential backoff from
  0.5 s to 2 min 2 s (`pkg/util/goroutinemap/exponentialbackoff`).
- volumeMounts (`pkg/kubelet/kubelet_pods.go`, `makeMounts`): a mount names a volume of the
  pod; `subPath` (or `subPathExpr`, expanded with the container's env) is a descending path
  inside it, created with the volume directory's mode when missing; errors there make the
  container `CreateContainerConfigError`.

Processes have no mount namespace, so a container cannot see a volume at its `mountPath`.
Instead the kubelet rewrites every environment value and argument that is a mount path or
lies below one (`map_path`) to the volume's directory on the node, as it already does for
`terminationMessagePath`. What this does not reach is written down in local_cluster/README.md.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import stat
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from tardigrade_local.simulator.env import EnvError, expand

EMPTY_DIR_PLUGIN = "kubernetes.io~empty-dir"
EMPTY_DIR_MODE = 0o777
HOST_PATH_DIR_MODE = 0o755
HOST_PATH_FILE_MODE = 0o644
SUPPORTED_SOURCES = ("emptyDir", "hostPath", "projected", "configMap", "secret", "downwardAPI")
MOUNT_RETRY_FIRST_SECONDS = 0.5
MOUNT_RETRY_MAX_SECONDS = 122.0

# hostPath `type` -> (what `GetFileType` calls it, how typeMatchedOrError describes it).
_HOST_PATH_TYPES = {
    "Directory": ("Directory", "directory"),
    "File": ("File", "file"),
    "Socket": ("Socket", "socket file"),
    "CharDevice": ("CharDevice", "character device"),
    "BlockDevice": ("BlockDevice", "block device"),
}


class VolumeSetupError(Exception):
    """A volume of the pod could not be set up on the node (the kubelet's FailedMount)."""

    def __init__(self, volume: str, reason: str) -> None:
        super().__init__(f'MountVolume.SetUp failed for volume "{volume}" : {reason}')
        self.volume = volume


@dataclasses.dataclass(frozen=True)
class NodeDisk:
    """One node's root filesystem, as a directory on this machine."""

    root: Path

    def path(self, node_path: str) -> Path:
        """Where the node's absolute path `node_path` is on this machine."""
        return self.root.joinpath(*PurePosixPath("/", node_path).parts[1:])

    def pod_dir(self, uid: str) -> Path:
        return self.path(f"/var/lib/kubelet/pods/{uid}")

    def empty_dir(self, uid: str, name: str) -> Path:
        return self.pod_dir(uid) / "volumes" / EMPTY_DIR_PLUGIN / name


@dataclasses.dataclass(frozen=True)
class Mount:
    """One volumeMount of a container: its path inside the container, and where that is."""

    mount_path: str
    local_path: Path
    read_only: bool = False


def _file_type(path: Path) -> str:
    mode = os.stat(path).st_mode
    for test, name in ((stat.S_ISDIR, "Directory"), (stat.S_ISSOCK, "Socket"),
                       (stat.S_ISCHR, "CharDevice"), (stat.S_ISBLK, "BlockDevice")):
        if test(mode):
            return name
    return "File"


def _host_path(name: str, source: Mapping[str, Any], disk: NodeDisk) -> Path:
    path = str(source.get("path") or "")
    if ".." in PurePosixPath(path).parts:
        raise VolumeSetupError(name, f"invalid HostPath `{path}`: must not contain '..'")
    local = disk.path(path)
    kind = source.get("type") or ""
    try:
        if kind == "DirectoryOrCreate" and not local.exists():
            local.mkdir(mode=HOST_PATH_DIR_MODE, parents=True, exist_ok=True)
        elif kind == "FileOrCreate" and not local.exists():
            local.touch(mode=HOST_PATH_FILE_MODE)
    except OSError as err:
        raise VolumeSetupError(name, f"{err.strerror}: {path}") from err
    wanted = {"DirectoryOrCreate": "Directory", "FileOrCreate": "File"}.get(kind, kind)
    if not wanted:
        return local
    if wanted not in _HOST_PATH_TYPES:
        raise VolumeSetupError(name, f"{kind} is an invalid volume type")
    if not local.exists():
        raise VolumeSetupError(name, f"hostPath {path} doesn't exist")
    actual = _file_type(local)
    file_type, description = _HOST_PATH_TYPES[wanted]
    if actual != file_type:
        raise VolumeSetupError(
            name, f"hostPath type check failed: {path} is not a {description}, it's a {actual}")
    return local


def set_up(pod: Mapping[str, Any], disk: NodeDisk,
           projected_dir: Callable[[str], Path] | None = None) -> dict[str, Path]:
    """Set up every volume of the pod on the node: volume name -> its directory (or file).

    `projected_dir`: where the API-backed volumes (projected, configMap, secret, downwardAPI)
    are written (projected.py writes and refreshes them).

    Raises VolumeSetupError for the first volume that cannot be set up; calling again after
    a success is harmless (an emptyDir keeps its content, as `SetUpAt` does when it is ready).
    """
    uid = str(pod["metadata"].get("uid") or pod["metadata"]["name"])
    paths: dict[str, Path] = {}
    for volume in pod["spec"].get("volumes") or []:
        name = str(volume["name"])
        if "emptyDir" in volume:
            local = disk.empty_dir(uid, name)
            try:
                local.mkdir(parents=True, exist_ok=True)
                local.chmod(EMPTY_DIR_MODE)  # mkdir's mode is cut by the umask, setupDir's not
            except OSError as err:
                raise VolumeSetupError(name, f"{err.strerror}: {local}") from err
            paths[name] = local
        elif "hostPath" in volume:
            paths[name] = _host_path(name, volume["hostPath"] or {}, disk)
        elif projected_dir is not None and any(k in volume for k in SUPPORTED_SOURCES[2:]):
            paths[name] = projected_dir(name)
        else:
            source = next((k for k in volume if k != "name"), "an unknown source")
            raise VolumeSetupError(
                name, f"the local kubelet does not model {source} volumes (it has "
                      f"{' and '.join(SUPPORTED_SOURCES)}; see local_cluster/README.md)")
    return paths


def tear_down(disk: NodeDisk, uid: str) -> None:
    """Remove the pod's directory on the node, emptyDir data included; hostPaths stay."""
    shutil.rmtree(disk.pod_dir(uid), ignore_errors=True)


def container_mounts(container: Mapping[str, Any], volumes: Mapping[str, Path],
                     env: Mapping[str, str]) -> list[Mount]:
    """The container's volumeMounts resolved against the pod's set-up volumes (makeMounts);
    raises EnvError, which the worker reports as CreateContainerConfigError."""
    cname = container.get("name", "")
    mounts = []
    for mount in container.get("volumeMounts") or []:
        name = mount.get("name", "")
        if name not in volumes:
            raise EnvError(f'cannot find volume "{name}" to mount into container "{cname}"')
        local = volumes[name]
        sub = str(mount.get("subPath") or "")
        if mount.get("subPathExpr"):
            sub = expand(str(mount["subPathExpr"]), env)
        if sub:
            parts = PurePosixPath(sub).parts
            if PurePosixPath(sub).is_absolute() or ".." in parts:
                raise EnvError(f"unable to provision SubPath `{sub}`: must be a relative path "
                               f"without '..'")
            volume_dir = local
            local = local.joinpath(*parts)
            if not local.exists():
                try:
                    local.mkdir(parents=True)
                    local.chmod(stat.S_IMODE(volume_dir.stat().st_mode))
                except OSError as err:
                    raise EnvError(f'failed to create subPath directory for volumeMount '
                                   f'"{name}" of container "{cname}"') from err
        mount_path = str(PurePosixPath("/", str(mount.get("mountPath") or "/")))
        mounts.append(Mount(mount_path, local, bool(mount.get("readOnly"))))
    return mounts


def map_path(value: str, mounts: Sequence[Mount]) -> str:
    """`value` with a leading mount path replaced by where that volume is on this machine.

    Only a whole value that is a mount path or lies below one: `/ckpt` and `/ckpt/run` map
    under a mount at `/ckpt`, `/ckpt2` and `--dir=/ckpt` do not. The deepest mount wins, as
    a mount on top of another hides what is below it.
    """
    best: Mount | None = None
    for mount in mounts:
        root = mount.mount_path.rstrip("/") or "/"
        below = value == root or value.startswith(root + "/") or (root == "/" and
                                                                   value.startswith("/"))
        if below and (best is None or len(root) > len(best.mount_path.rstrip("/"))):
            best = mount
    if best is None:
        return value
    root = best.mount_path.rstrip("/")
    rest = value[len(root):].lstrip("/")
    return str(best.local_path / rest) if rest else str(best.local_path)
