"""Container restart rules (KEP-5307) and RestartAllContainers (KEP-5532): the kubelet's
decision on a container exit, and the API server's gate on the fields."""

from __future__ import annotations

import json

import pytest
from api_helpers import running_server
from kubernetes import client, config
from tardigrade_local.apiserver.featuregates import FeatureGates
from tardigrade_local.kubelet.config import NodeConfig
from tardigrade_local.kubelet.node import node_status
from tardigrade_local.kubelet.restartrules import KubeletGates, OnExit, on_exit

BOTH = KubeletGates(container_restart_rules=True, restart_all_containers=True)
RULES_ONLY = KubeletGates(container_restart_rules=True)
OLD = KubeletGates()


def container(policy=None, *rules):
    c = {"name": "c"}
    if policy is not None:
        c["restartPolicy"] = policy
    if rules:
        c["restartPolicyRules"] = [
            {"action": action, "exitCodes": {"operator": op, "values": values}}
            for action, op, values in rules]
    return c


@pytest.mark.parametrize("spec, pod_policy, code, gates, expected", [
    # The pod-level policy alone, as before the feature.
    (container(), "Never", 1, BOTH, OnExit.STOP),
    (container(), "OnFailure", 0, BOTH, OnExit.STOP),
    (container(), "OnFailure", 1, BOTH, OnExit.RESTART),
    (container(), "Always", 0, BOTH, OnExit.RESTART),
    # A matching In rule restarts in place although the pod says Never.
    (container("Never", ("Restart", "In", [42])), "Never", 42, BOTH, OnExit.RESTART),
    # No rule matches: the container-level policy decides, not the pod's.
    (container("Never", ("Restart", "In", [42])), "Always", 1, BOTH, OnExit.STOP),
    (container("OnFailure", ("Restart", "In", [42])), "Never", 3, BOTH, OnExit.RESTART),
    # NotIn matches every code but the listed ones; rules apply in order.
    (container("Never", ("Restart", "NotIn", [0])), "Never", 7, BOTH, OnExit.RESTART),
    (container("Never", ("Restart", "NotIn", [0])), "Never", 0, BOTH, OnExit.STOP),
    (container("Never", ("RestartAllContainers", "In", [88]), ("Restart", "In", [88])),
     "Never", 88, BOTH, OnExit.RESTART_ALL),
    # A kubelet without RestartAllContainers skips that action: container policy decides.
    (container("Never", ("RestartAllContainers", "In", [88])), "Never", 88, RULES_ONLY,
     OnExit.STOP),
    # A kubelet older than restart rules does not know the fields: the pod policy decides.
    (container("Never", ("Restart", "In", [42])), "Never", 42, OLD, OnExit.STOP),
    (container("Never", ("Restart", "In", [42])), "OnFailure", 42, OLD, OnExit.RESTART),
])
def test_on_exit_follows_container_should_restart(spec, pod_policy, code, gates, expected):
    assert on_exit(spec, pod_policy, code, gates) is expected


def test_node_declares_restart_all_containers_only_with_its_gate():
    old = node_status(NodeConfig("old", kubelet_version="v1.34.2"), "127.0.0.9", 1)
    new = node_status(NodeConfig("new", kubelet_version="v1.36.0", feature_gates={
        "ContainerRestartRules": True, "RestartAllContainersOnContainerExits": True}),
        "127.0.0.9", 1)
    assert old["nodeInfo"]["kubeletVersion"] == "v1.34.2" and "declaredFeatures" not in old
    assert new["nodeInfo"]["kubeletVersion"] == "v1.36.0"
    assert new["declaredFeatures"] == ["RestartAllContainersOnContainerExits"]


def test_feature_gate_flag_names_the_bad_item():
    assert FeatureGates.parse("ContainerRestartRules=true") == FeatureGates(
        container_restart_rules=True)
    with pytest.raises(ValueError, match="unknown gate 'Nope'"):
        FeatureGates.parse("Nope=true")
    with pytest.raises(ValueError, match="'ContainerRestartRules' is not Name=true"):
        FeatureGates.parse("ContainerRestartRules")


def _pod(name, action="Restart"):
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
        "restartPolicy": "Never",
        "initContainers": [{"name": "side", "image": "x", "restartPolicy": "Always"}],
        "containers": [{"name": "main", "image": "x", "restartPolicy": "Never",
                        "restartPolicyRules": [{"action": action, "exitCodes": {
                            "operator": "In", "values": [42]}}]}]}}


def _core(kubeconfig):
    return client.CoreV1Api(config.new_client_from_config(str(kubeconfig)))


def test_api_server_drops_restart_rules_when_the_gate_is_off(tmp_path):
    with running_server(tmp_path) as (_, kubeconfig):
        core = _core(kubeconfig)
        core.create_namespaced_pod("default", _pod("old-plane"))
        stored = core.api_client.sanitize_for_serialization(
            core.read_namespaced_pod("old-plane", "default"))
    main = stored["spec"]["containers"][0]
    assert "restartPolicyRules" not in main and "restartPolicy" not in main
    # The sidecar's restartPolicy is another feature's and survives.
    assert stored["spec"]["initContainers"][0]["restartPolicy"] == "Always"


def test_api_server_keeps_rules_and_gates_restart_all_action(tmp_path):
    gates = FeatureGates(container_restart_rules=True)
    with running_server(tmp_path, feature_gates=gates) as (_, kubeconfig):
        core = _core(kubeconfig)
        core.create_namespaced_pod("default", _pod("new-plane"))
        stored = core.read_namespaced_pod("new-plane", "default")
        with pytest.raises(client.ApiException) as err:
            core.create_namespaced_pod("default", _pod("all", "RestartAllContainers"))
    rule = stored.spec.containers[0].restart_policy_rules[0]
    assert (rule.action, rule.exit_codes.operator, rule.exit_codes.values) == (
        "Restart", "In", [42])
    assert err.value.status == 422
    message = json.loads(err.value.body)["message"]
    assert ('spec.containers[0].restartPolicyRules[0].action: Unsupported value: '
            '"RestartAllContainers": supported values: "Restart"') in message
