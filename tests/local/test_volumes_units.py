"""Pod volumes on a node's disk (kubelet/volumes.py), without a cluster."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from tardigrade_local.kubelet.env import EnvError
from tardigrade_local.kubelet.volumes import (
    EMPTY_DIR_PLUGIN,
    Mount,
    NodeDisk,
    VolumeSetupError,
    container_mounts,
    map_path,
    set_up,
    tear_down,
)


def pod(*volumes: dict, uid: str = "uid-1") -> dict:
    return {"metadata": {"name": "p", "uid": uid}, "spec": {"volumes": list(volumes)}}


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_empty_dir_is_under_the_pod_dir_world_writable_and_goes_with_the_pod(tmp_path):
    disk = NodeDisk(tmp_path / "node-a")
    paths = set_up(pod({"name": "scratch", "emptyDir": {}}), disk)
    expected = (tmp_path / "node-a" / "var/lib/kubelet/pods/uid-1/volumes" / EMPTY_DIR_PLUGIN
                / "scratch")
    assert paths == {"scratch": expected}
    assert mode(expected) == 0o777
    (expected / "kept").write_text("x")
    # A container restart sets the pod up again: the data stays.
    assert set_up(pod({"name": "scratch", "emptyDir": {}}), disk) == paths
    assert (expected / "kept").read_text() == "x"
    tear_down(disk, "uid-1")
    assert not (tmp_path / "node-a" / "var/lib/kubelet/pods/uid-1").exists()


def test_host_path_is_the_nodes_own_and_survives_the_pod(tmp_path):
    volume = {"name": "data", "hostPath": {"path": "/srv/data", "type": "DirectoryOrCreate"}}
    on_a = set_up(pod(volume), NodeDisk(tmp_path / "node-a"))["data"]
    on_b = set_up(pod(volume, uid="uid-2"), NodeDisk(tmp_path / "node-b"))["data"]
    assert on_a == tmp_path / "node-a" / "srv/data" and on_a.is_dir()
    assert mode(on_a) == 0o755
    (on_a / "f").write_text("a")
    assert on_b != on_a and not (on_b / "f").exists()
    tear_down(NodeDisk(tmp_path / "node-a"), "uid-1")
    assert (on_a / "f").read_text() == "a"


@pytest.mark.parametrize(("source", "prepare", "message"), [
    ({"path": "/missing", "type": "Directory"}, None, "hostPath /missing doesn't exist"),
    ({"path": "/f", "type": "Directory"}, "file",
     "hostPath type check failed: /f is not a directory, it's a File"),
    ({"path": "/d", "type": "File"}, "dir",
     "hostPath type check failed: /d is not a file, it's a Directory"),
    ({"path": "/d", "type": "Socket"}, "dir",
     "hostPath type check failed: /d is not a socket file, it's a Directory"),
    ({"path": "/d", "type": "Folder"}, "dir", "Folder is an invalid volume type"),
    ({"path": "/a/../b", "type": ""}, None, "invalid HostPath `/a/../b`: must not contain '..'"),
    ({"path": "/no/parent/f", "type": "FileOrCreate"}, None, "No such file or directory"),
])
def test_host_path_type_checks_fail_like_the_kubelet(tmp_path, source, prepare, message):
    disk = NodeDisk(tmp_path)
    if prepare == "file":
        disk.path(source["path"]).write_text("x")
    elif prepare == "dir":
        disk.path(source["path"]).mkdir()
    with pytest.raises(VolumeSetupError) as err:
        set_up(pod({"name": "v", "hostPath": source}), disk)
    assert str(err.value).startswith('MountVolume.SetUp failed for volume "v" : ')
    assert message in str(err.value)


def test_host_path_creates_what_its_type_asks_for(tmp_path):
    disk = NodeDisk(tmp_path)
    disk.path("/etc").mkdir()
    paths = set_up(pod({"name": "f", "hostPath": {"path": "/etc/x", "type": "FileOrCreate"}},
                       {"name": "u", "hostPath": {"path": "/var/unset"}}), disk)
    assert paths["f"].is_file() and paths["f"].read_text() == ""
    # No type: nothing is checked or created by the volume plugin.
    assert paths["u"] == tmp_path / "var/unset" and not paths["u"].exists()


def test_a_volume_source_that_is_not_modelled_is_a_failed_mount(tmp_path):
    with pytest.raises(VolumeSetupError, match='volume "cfg" : the local kubelet does not '
                                               'model configMap volumes'):
        set_up(pod({"name": "cfg", "configMap": {"name": "x"}}), NodeDisk(tmp_path))


def test_mounts_resolve_sub_paths_inside_the_volume(tmp_path):
    volume = tmp_path / "vol"
    volume.mkdir()
    volume.chmod(0o777)
    container = {"name": "main", "volumeMounts": [
        {"name": "v", "mountPath": "/ckpt/", "subPath": "a/b"},
        {"name": "v", "mountPath": "/per-pod", "subPathExpr": "$(POD)", "readOnly": True},
    ]}
    mounts = container_mounts(container, {"v": volume}, {"POD": "p-0"})
    assert mounts == [Mount("/ckpt", volume / "a/b"), Mount("/per-pod", volume / "p-0", True)]
    assert mode(volume / "a/b") == 0o777 and (volume / "p-0").is_dir()


@pytest.mark.parametrize(("mount", "message"), [
    ({"name": "nope", "mountPath": "/x"}, 'cannot find volume "nope" to mount into container'),
    ({"name": "v", "mountPath": "/x", "subPath": "../up"}, "unable to provision SubPath"),
    ({"name": "v", "mountPath": "/x", "subPath": "/abs"}, "unable to provision SubPath"),
])
def test_bad_mounts_are_container_config_errors(tmp_path, mount, message):
    with pytest.raises(EnvError, match=message):
        container_mounts({"name": "main", "volumeMounts": [mount]}, {"v": tmp_path}, {})


def test_paths_map_below_the_deepest_mount_only():
    mounts = [Mount("/ckpt", Path("/node/ckpt")), Mount("/ckpt/inner", Path("/node/inner"))]
    assert map_path("/ckpt", mounts) == "/node/ckpt"
    assert map_path("/ckpt/job-1/x", mounts) == "/node/ckpt/job-1/x"
    assert map_path("/ckpt/inner/y", mounts) == "/node/inner/y"
    assert map_path("/ckpt2/job", mounts) == "/ckpt2/job"
    assert map_path("gs://bucket/ckpt", mounts) == "gs://bucket/ckpt"
    assert map_path("--dir=/ckpt", mounts) == "--dir=/ckpt"
