"""Kueue's manager in the local cluster (`ClusterConfig.kueue`, `tardigrade local up --kueue`):
installed from its own module's manifests, its webhooks called by URL, its controllers at work
against the real kube-apiserver, and a process that dies with the cluster's supervisor."""

from __future__ import annotations

import base64
import os
import signal
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
from kubernetes.client.exceptions import ApiException
from tardigrade_local import gobuild, kueue
from tardigrade_local.cluster import ClusterConfig, LocalCluster

from tests.e2e.harness import Cluster
from tests.polling import wait_for

KUEUE = ("kueue.x-k8s.io", "v1beta2")
CA = b"-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n"
URL = "https://127.0.0.1:9443"


def test_kueue_is_built_only_when_asked(monkeypatch: pytest.MonkeyPatch):
    assert gobuild.KUEUE not in gobuild.MODULES and gobuild.KUEUE_OLDEST not in gobuild.MODULES
    assert gobuild.PROGRAMS["kueue"] is gobuild.KUEUE
    monkeypatch.delenv(gobuild.KUEUE_MODULE_ENV, raising=False)
    assert gobuild.kueue_module() is gobuild.KUEUE
    assert gobuild.kueue_version() == "v0.19.2"
    # One run checks the oldest Kueue Tardigrade supports.
    monkeypatch.setenv(gobuild.KUEUE_MODULE_ENV, "kueue-v0.17")
    assert gobuild.kueue_module() is gobuild.KUEUE_OLDEST
    assert gobuild.kueue_version() == "v0.17.0"
    monkeypatch.setenv(gobuild.KUEUE_MODULE_ENV, "kubernetes")
    with pytest.raises(gobuild.BuildError, match="TARDIGRADE_KUEUE_MODULE='kubernetes'"):
        gobuild.kueue_module()


def test_manifests_come_from_the_module_with_webhooks_by_url():
    source = kueue.module_source()
    crds = {c["metadata"]["name"]: c for c in kueue.crds(source, URL, CA)}
    assert "workloads.kueue.x-k8s.io" in crds and "clusterqueues.kueue.x-k8s.io" in crds
    conversion = crds["workloads.kueue.x-k8s.io"]["spec"]["conversion"]
    assert conversion["strategy"] == "Webhook"
    assert conversion["webhook"]["clientConfig"] == {
        "url": f"{URL}/convert", "caBundle": base64.b64encode(CA).decode()}
    # A CRD whose kustomization enables no conversion webhook keeps the module's spec.
    assert "conversion" not in crds["resourceflavors.kueue.x-k8s.io"]["spec"]
    configs = kueue.webhook_configurations(source, URL, CA)
    assert {c["metadata"]["name"] for c in configs} == {
        "kueue-mutating-webhook-configuration", "kueue-validating-webhook-configuration"}
    hooks = {h["name"]: h for c in configs for h in c["webhooks"]}
    assert all(set(h["clientConfig"]) == {"url", "caBundle"} for h in hooks.values())
    assert hooks["mworkload.kb.io"]["clientConfig"]["url"] == (
        f"{URL}/mutate-kueue-x-k8s-io-v1beta2-workload")
    # The kustomization's patch: Kueue's pod webhook never sees kube-system's pods.
    expression = hooks["mpod.kb.io"]["namespaceSelector"]["matchExpressions"][0]
    assert expression["operator"] == "NotIn" and "kube-system" in expression["values"]
    # ... nor its job webhooks (v0.19 copies the selector by a kustomize replacement).
    assert hooks["mjob.kb.io"]["namespaceSelector"] == hooks["mpod.kb.io"]["namespaceSelector"]


def test_the_configuration_names_trainingjob_an_external_framework(tmp_path):
    config = kueue.manager_config(9443, 8081, tmp_path)
    assert config["integrations"]["externalFrameworks"] == ["TrainingJob.v1alpha1.tardigrade.dev"]
    assert config["internalCertManagement"] == {"enable": False}
    assert config["webhook"] == {"host": "127.0.0.1", "port": 9443, "certDir": str(tmp_path)}
    # Kueue's own default for waitForPodsReady unless the cluster sets it.
    assert "waitForPodsReady" not in config


def test_wait_for_pods_ready_is_written_in_kueues_field_names(tmp_path):
    short = kueue.WaitForPodsReady(timeout_seconds=45, backoff_base_seconds=5,
                                   backoff_max_seconds=20)
    config = kueue.manager_config(9443, 8081, tmp_path, wait_for_pods_ready=short)
    assert config["waitForPodsReady"] == {
        "timeout": "45s",
        "requeuingStrategy": {"backoffBaseSeconds": 5, "backoffMaxSeconds": 20}}
    full = kueue.WaitForPodsReady(timeout_seconds=1.5, recovery_timeout_seconds=90,
                                  block_admission=True, backoff_limit_count=3)
    assert full.to_config() == {"timeout": "1.5s", "recoveryTimeout": "90s",
                                "blockAdmission": True,
                                "requeuingStrategy": {"backoffLimitCount": 3}}
    with pytest.raises(ValueError, match="timeout_seconds must be > 0"):
        kueue.WaitForPodsReady(timeout_seconds=0)
    # The cluster's config file carries it to the supervisor and back.
    config_back = ClusterConfig.from_json(ClusterConfig(
        state_dir=tmp_path, kueue=True, kueue_wait_for_pods_ready=short).to_json())
    assert config_back.kueue_wait_for_pods_ready == short


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("kueue")
    # No node: these tests run no pod, only Kueue's objects and its manager.
    with LocalCluster(root / "cluster", nodes=0, with_gcs=False, kueue=True) as local:
        yield Cluster(local, trainer_token_review=False)


def _create(cluster: Cluster, plural: str, body: dict[str, Any]) -> dict[str, Any]:
    return dict(cluster.custom.create_cluster_custom_object(*KUEUE, plural, body))


@pytest.mark.slow
def test_kueue_runs_against_the_real_api_server(cluster: Cluster):
    _create(cluster, "resourceflavors", {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
        "metadata": {"name": "default-flavor"}})
    _create(cluster, "clusterqueues", {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue",
        "metadata": {"name": "team"},
        "spec": {"namespaceSelector": {}, "resourceGroups": [{
            "coveredResources": ["cpu"],
            "flavors": [{"name": "default-flavor",
                         "resources": [{"name": "cpu", "nominalQuota": "4"}]}]}]}})

    def active() -> dict[str, Any] | None:
        queue = cluster.custom.get_cluster_custom_object(*KUEUE, "clusterqueues", "team")
        conditions = (queue.get("status") or {}).get("conditions") or []
        return queue if any(c["type"] == "Active" and c["status"] == "True"
                            for c in conditions) else None

    # Kueue's ClusterQueue controller read the flavor and marked the queue Active.
    wait_for(active, 60, "ClusterQueue team Active")
    # Kueue's validating webhook, called by URL, refuses what its own code refuses.
    with pytest.raises(ApiException) as refused:
        _create(cluster, "clusterqueues", {
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue",
            "metadata": {"name": "bad"},
            "spec": {"cohortName": "Not_A_DNS_Label", "resourceGroups": []}})
    assert refused.value.status in (400, 422), refused.value.body


@pytest.mark.slow
def test_kueue_dies_with_the_clusters_supervisor(cluster: Cluster):
    processes = cluster.local.processes()
    manager = psutil.Process(processes["kueue"])
    assert manager.is_running() and "kueue" in manager.name()
    os.kill(processes["supervisor"], signal.SIGKILL)
    manager.wait(30)  # PR_SET_PDEATHSIG: the kernel kills it with its parent
