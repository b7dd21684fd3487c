"""Which Kueue the API server serves, from discovery (ClusterWriter.kueue_api): Workloads at
v1beta2, none at all, or a Kueue too old for Tardigrade (its group at older versions only)."""

from __future__ import annotations

from typing import Any

import kubernetes
from kubernetes.client import (
    V1APIGroup,
    V1APIGroupList,
    V1APIResource,
    V1APIResourceList,
    V1GroupVersionForDiscovery,
)
from kubernetes.client.exceptions import ApiException
from tardigrade_operator.apply.kube import ClusterWriter
from tardigrade_operator.decision import queueing


class Discovery:
    """The answers of /apis and /apis/kueue.x-k8s.io/v1beta2 for a cluster with `kueue`
    serving those versions of its group."""

    def __init__(self, versions: list[str]) -> None:
        self.versions = versions
        self.asked = 0

    def get_api_resources(self, group: str, version: str) -> V1APIResourceList:
        self.asked += 1
        if version not in self.versions:
            raise ApiException(status=404, reason="Not Found")
        return V1APIResourceList(group_version=f"{group}/{version}", resources=[
            V1APIResource(name="workloads", kind="Workload", namespaced=True,
                          singular_name="workload", verbs=["get"])])

    def get_api_versions(self) -> V1APIGroupList:
        groups = [V1APIGroup(name="apps", versions=[
            V1GroupVersionForDiscovery(group_version="apps/v1", version="v1")])]
        if self.versions:
            groups.append(V1APIGroup(name=queueing.GROUP, versions=[
                V1GroupVersionForDiscovery(group_version=f"{queueing.GROUP}/{v}", version=v)
                for v in self.versions]))
        return V1APIGroupList(groups=groups)


def writer_for(versions: list[str]) -> tuple[ClusterWriter, Discovery]:
    writer = ClusterWriter(kubernetes.client.ApiClient())
    discovery = Discovery(versions)
    writer.custom = discovery  # type: ignore[assignment]
    writer.apis = discovery  # type: ignore[assignment]
    return writer, discovery


def gate(api: queueing.KueueApi) -> Any:
    return queueing.gate_for("team-queue", None, {}, 2, kueue=api)


def test_kueue_serving_v1beta2_workloads_is_usable():
    writer, discovery = writer_for(["v1beta1", "v1beta2"])
    api = writer.kueue_api()
    assert api.workloads and not api.too_old and gate(api).installed
    writer.kueue_api()
    assert discovery.asked == 1  # asked again only after KUEUE_DISCOVERY_SECONDS


def test_no_kueue_is_not_installed_and_an_old_one_is_too_old():
    missing = writer_for([])[0].kueue_api()
    assert not missing.workloads and not missing.too_old
    assert gate(missing).reason() == "KueueNotInstalled"
    old = writer_for(["v1beta1"])[0].kueue_api()
    assert old.too_old and old.other_versions == ("v1beta1",)
    assert gate(old).reason() == "KueueTooOld"
    assert "Tardigrade needs Kueue >= v0.17" in gate(old).waiting_message()
