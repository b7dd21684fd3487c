"""The process kubelet honours restart rules per node: a 1.36 node restarts a container (or
all of a pod's containers) in the same pod; a node whose kubelet lacks the gates does not."""

from __future__ import annotations

import textwrap

import pytest
from kube_helpers import Kube, condition, container_status, python_pod, wait_for
from tardigrade_local.cluster import LocalCluster
from tardigrade_local.gke.nodes import NodeConfig

pytestmark = pytest.mark.slow
GATES = {"ContainerRestartRules": True, "RestartAllContainersOnContainerExits": True}

# Exits with `code` on its first run in this pod, then stays up; the pod directory (its
# working directory) survives an in-place restart, so the count does too.
ONCE = """
    import os, sys, time
    runs = int(open('{name}.runs').read()) if os.path.exists('{name}.runs') else 0
    open('{name}.runs', 'w').write(str(runs + 1))
    print('run', runs + 1, flush=True)
    if runs == 0 and {code} is not None:
        sys.exit({code})
    time.sleep(120)
"""

AFTER_MAIN_COUNTED = """
    import os, time
    while not (os.path.exists('main.runs') and open('main.runs').read()):
        time.sleep(0.02)
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    state = tmp_path_factory.mktemp("restartrules") / "state"
    nodes = [NodeConfig("new", kubelet_version="v1.36.0", feature_gates=GATES),
             NodeConfig("old", kubelet_version="v1.33.0")]
    with LocalCluster(state, nodes=nodes, with_gcs=False, backoff_base_seconds=0.2,
                      feature_gates="ContainerRestartRules=true,"
                                        "RestartAllContainersOnContainerExits=true") as running:
        yield running


@pytest.fixture(scope="module")
def kube(cluster):
    return Kube(str(cluster.kubeconfig))


def rule(action: str, code: int) -> dict:
    return {"restartPolicy": "Never", "restartPolicyRules": [
        {"action": action, "exitCodes": {"operator": "In", "values": [code]}}]}


def test_nodes_report_their_own_kubelet_version_and_features(kube):
    nodes = {n.metadata.name: n for n in kube.core.list_node().items}
    assert nodes["new"].status.node_info.kubelet_version == "v1.36.0"
    assert nodes["new"].status.declared_features == ["RestartAllContainersOnContainerExits"]
    assert nodes["old"].status.node_info.kubelet_version == "v1.33.0"
    assert not nodes["old"].status.declared_features


def test_restart_rule_is_honoured_per_node(kube):
    """The same pod: restarted in place on the 1.36 node, failed on the old one."""
    for name, node in (("rule-new", "new"), ("rule-old", "old")):
        kube.create_pod(python_pod(name, ONCE.format(name="main", code=42), node=node,
                                   container=rule("Restart", 42)))
    uid = kube.pod("rule-new")["metadata"]["uid"]

    def restarted():
        pod = kube.pod("rule-new")
        if not pod["status"].get("containerStatuses"):
            return None
        status = container_status(pod)
        return pod if status["restartCount"] == 1 and "running" in status["state"] else None

    pod = wait_for(restarted, what="in-place restart on the 1.36 node")
    last = container_status(pod)["lastState"]["terminated"]
    assert (last["exitCode"], last["reason"]) == (42, "Error")
    assert pod["status"]["phase"] == "Running" and pod["metadata"]["uid"] == uid

    old = kube.wait_phase("rule-old", ("Succeeded", "Failed"))
    assert old["status"]["phase"] == "Failed"
    status = container_status(old)
    assert status["restartCount"] == 0 and status["state"]["terminated"]["exitCode"] == 42
    # The API server kept the rule: only the node can say whether it is honoured.
    assert old["spec"]["containers"][0]["restartPolicyRules"][0]["action"] == "Restart"
    for name in ("rule-new", "rule-old"):
        kube.core.delete_namespaced_pod(name, "default", grace_period_seconds=0)


def test_restart_all_containers_reruns_init_and_restarts_every_container(kube, cluster):
    body = python_pod("all-new", ONCE.format(name="main", code=None), node="new")
    body["spec"]["initContainers"] = [{
        "name": "setup", "image": "local/python",
        "command": ["python", "-c", "open('setup.runs', 'a').write('x')"]}]
    body["spec"]["containers"].append({
        "name": "watcher", "image": "local/python",
        # It exits only once main has counted its first run: a main killed before that would
        # count its second run as its first.
        "command": ["python", "-c", textwrap.dedent(AFTER_MAIN_COUNTED)
                    + textwrap.dedent(ONCE.format(name="watcher", code=88))],
        **rule("RestartAllContainers", 88)})
    kube.create_pod(body)
    uid = kube.pod("all-new")["metadata"]["uid"]

    def restarted():
        pod = kube.pod("all-new")
        statuses = {s["name"]: s for s in pod["status"].get("containerStatuses") or []}
        if len(statuses) == 2 and all(s["restartCount"] == 1 and "running" in s["state"]
                                      for s in statuses.values()):
            return pod
        return None

    pod = wait_for(restarted, what="every container restarted in place")
    assert pod["metadata"]["uid"] == uid
    statuses = {s["name"]: s for s in pod["status"]["containerStatuses"]}
    assert statuses["watcher"]["lastState"]["terminated"]["exitCode"] == 88
    # main was killed without grace (KEP-5532: grace periods are not respected).
    assert statuses["main"]["lastState"]["terminated"]["exitCode"] == 137
    assert pod["status"]["initContainerStatuses"][0]["restartCount"] == 1
    restarting = condition(pod, "AllContainersRestarting")
    assert restarting is not None and restarting["status"] == "False"
    assert "watcher exited with code 88" in restarting["message"]
    # The pod directory (volumes) survived: each container counted both of its runs there.
    pod_dir = cluster.layout.pod_dir("default", "all-new")
    wait_for(lambda: (pod_dir / "main.runs").read_text() == "2", what="main's second run")
    assert (pod_dir / "setup.runs").read_text() == "xx"
    kube.core.delete_namespaced_pod("all-new", "default", grace_period_seconds=0)


def test_restarted_container_reads_the_annotation_written_after_pod_creation(kube, cluster):
    """The world channel of restart in place: env from `fieldRef: metadata.annotations[...]`
    is resolved again at each container start, so a kept pod's next run sees new values."""
    script = """
        import os, sys, time
        world = os.environ["WORLD"]
        open('worlds', 'a').write(world + '\\n')
        if world != 'new':
            sys.exit(42)
        time.sleep(120)
    """
    body = python_pod("world", script, node="new", container={
        **rule("Restart", 42),
        "env": [{"name": "WORLD", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.annotations['tardigrade.dev/world']"}}}]})
    body["metadata"]["annotations"] = {"tardigrade.dev/world": "old"}
    kube.create_pod(body)
    uid = kube.pod("world")["metadata"]["uid"]
    worlds = cluster.layout.pod_dir("default", "world") / "worlds"
    wait_for(lambda: worlds.exists() and "old" in worlds.read_text(), what="a run with 'old'")
    kube.core.patch_namespaced_pod(
        "world", "default", {"metadata": {"annotations": {"tardigrade.dev/world": "new"}}})

    def running_new():
        pod = kube.pod("world")
        status = (pod["status"].get("containerStatuses") or [{}])[0]
        return pod if ("running" in status.get("state", {})
                       and worlds.read_text().endswith("new\n")) else None

    pod = wait_for(running_new, what="a restart that reads the new annotation")
    assert pod["metadata"]["uid"] == uid
    assert container_status(pod)["restartCount"] >= 1
    runs = worlds.read_text().split()
    assert runs[0] == "old" and runs[-1] == "new" and set(runs) == {"old", "new"}
    kube.core.delete_namespaced_pod("world", "default", grace_period_seconds=0)
