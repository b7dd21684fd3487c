"""emptyDir and hostPath volumes through the process kubelet: per pod, per node, as upstream."""

from __future__ import annotations

import json

import pytest
from kube_helpers import Kube, container_status, python_pod, wait_for
from tardigrade_local.cluster import LocalCluster
from tardigrade_local.gke.nodes import NodeConfig
from tardigrade_local.kubelet.volumes import EMPTY_DIR_PLUGIN

pytestmark = pytest.mark.slow

SHOW = """
    import json, os, sys
    data = os.environ["DATA"]
    if len(sys.argv) > 1:
        open(os.path.join(data, sys.argv[1]), "w").write("x")
    print(json.dumps({"data": data, "files": sorted(os.listdir(data))}))
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    state = tmp_path_factory.mktemp("volumes") / "state"
    nodes = [NodeConfig("node-a"), NodeConfig("node-b")]
    with LocalCluster(state, nodes=nodes, with_gcs=False, backoff_base_seconds=0.2) as running:
        yield running


@pytest.fixture(scope="module")
def kube(cluster):
    return Kube(str(cluster.kubeconfig))


def volume_pod(name: str, node: str, volume: dict, write: str | None = None,
               **spec: object) -> dict:
    body = python_pod(name, SHOW, node=node, volumes=[{"name": "data", **volume}], **spec)
    container = body["spec"]["containers"][0]
    container["command"] += [write] if write else []
    container["env"] = [{"name": "DATA", "value": "/data"}]
    container["volumeMounts"] = [{"name": "data", "mountPath": "/data"}]
    return body


def run(kube: Kube, body: dict) -> dict:
    kube.create_pod(body)
    name = body["metadata"]["name"]
    kube.wait_phase(name, ("Succeeded",))
    return json.loads(kube.core.read_namespaced_pod_log(name, "default").strip().splitlines()[-1])


def test_host_path_is_per_node(kube, cluster):
    volume = {"hostPath": {"path": "/srv/shared-looking", "type": "DirectoryOrCreate"}}
    first = volume_pod("hp-a1", "node-a", volume, write="from-a")
    assert run(kube, first)["files"] == ["from-a"]
    again = volume_pod("hp-a2", "node-a", volume)
    other = volume_pod("hp-b1", "node-b", volume)
    # The same node sees what an earlier pod left there; another node has its own directory.
    seen_a, seen_b = run(kube, again), run(kube, other)
    assert seen_a["files"] == ["from-a"]
    assert seen_b["files"] == []
    assert seen_a["data"] == str(cluster.layout.node_root("node-a") / "srv/shared-looking")
    assert seen_b["data"] == str(cluster.layout.node_root("node-b") / "srv/shared-looking")


def test_empty_dir_survives_a_container_restart_and_goes_with_the_pod(kube, cluster):
    script = """
        import os, sys
        marker = os.path.join(os.environ["DATA"], "first-run")
        if not os.path.exists(marker):
            open(marker, "w").write("x")
            sys.exit(1)
        print(os.environ["DATA"])
    """
    body = python_pod("ed", script, restart="OnFailure", node="node-b",
                      volumes=[{"name": "scratch", "emptyDir": {}}])
    container = body["spec"]["containers"][0]
    container["env"] = [{"name": "DATA", "value": "/scratch"}]
    container["volumeMounts"] = [{"name": "scratch", "mountPath": "/scratch"}]
    kube.create_pod(body)
    pod = kube.wait_phase("ed", ("Succeeded",))
    assert container_status(pod)["restartCount"] == 1
    uid = pod["metadata"]["uid"]
    where = (cluster.layout.node_root("node-b") / "var/lib/kubelet/pods" / uid / "volumes"
             / EMPTY_DIR_PLUGIN / "scratch")
    assert kube.core.read_namespaced_pod_log("ed", "default").strip() == str(where)
    # A terminated pod's volumes are torn down: the emptyDir's data is gone.
    wait_for(lambda: not where.exists(), what="the emptyDir to be torn down")


def test_empty_dirs_are_per_pod_even_on_one_node(kube):
    one = run(kube, volume_pod("ed-1", "node-a", {"emptyDir": {}}, write="mine"))
    two = run(kube, volume_pod("ed-2", "node-a", {"emptyDir": {}}))
    assert one["files"] == ["mine"] and two["files"] == []
    assert one["data"] != two["data"]


def test_missing_host_path_directory_is_a_failed_mount_until_it_exists(kube, cluster):
    body = volume_pod("hp-missing", "node-a", {"hostPath": {"path": "/srv/later",
                                                            "type": "Directory"}})
    kube.create_pod(body)

    def failed_mount() -> str | None:
        events = kube.core.list_namespaced_event("default").items
        return next((e.message for e in events if e.involved_object.name == "hp-missing"
                     and e.reason == "FailedMount"), None)

    message = wait_for(failed_mount, what="a FailedMount event")
    assert message == ('MountVolume.SetUp failed for volume "data" : '
                       'hostPath /srv/later doesn\'t exist')
    pod = kube.pod("hp-missing")
    assert pod["status"]["phase"] == "Pending"
    assert container_status(pod)["state"]["waiting"]["reason"] == "ContainerCreating"
    # The volume manager keeps trying: once the node has the directory, the pod runs.
    (cluster.layout.node_root("node-a") / "srv/later").mkdir(parents=True)
    kube.wait_phase("hp-missing", ("Succeeded",), timeout=60)
