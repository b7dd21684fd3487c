"""Real nodes' pieces that run without root: how their programs are built, and the egress
proxy kube-apiserver reaches kubelets through."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import tomllib
from pathlib import Path
from types import SimpleNamespace

import kubernetes
import pytest
from tardigrade_local import egressproxy, gobuild, noderegistry, nodeshape
from tardigrade_local.gke.autoscaler import NodePool
from tardigrade_local.gke.nodes import NodeConfig
from tardigrade_local.gke.tpuslices import SliceShape, slice_nodes
from tardigrade_local.realcluster import (
    SPOT_LABEL,
    NodePlan,
    RealClusterError,
    RealNodeCluster,
    plan_nodes,
)
from tardigrade_local.realnode import (
    KUBELET_WITHOUT_RESTART_RULES,
    Addresses,
    RealNode,
    RealNodeError,
)


def test_node_programs_are_stamped_with_their_pinned_versions():
    assert gobuild._version_ldflags(gobuild.KUBERNETES_NODE) == gobuild._version_ldflags(
        gobuild.KUBERNETES)
    assert ("-X github.com/containerd/containerd/v2/version.Version=v2.4.2"
            in gobuild._ldflags(gobuild.CONTAINERD))
    assert "-X sigs.k8s.io/cri-tools/pkg/version.Version=v1.37.0" in gobuild._ldflags(
        gobuild.CRI_TOOLS)
    assert gobuild.RUNC.cgo and "seccomp" in gobuild.RUNC.tags.split(",")
    assert gobuild.go_env(cgo=True)["CGO_ENABLED"] == "1"
    assert gobuild.go_env()["CGO_ENABLED"] == "0"
    # The control plane's build key (and so its cache entry) is not moved by the new fields.
    assert gobuild.KUBERNETES.build_flags == ("-trimpath", "-tags", "selinux,notest")


def test_the_node_group_names_every_node_module_and_a_plain_setup_builds_none():
    assert {m.name for m in gobuild.GROUPS["node"]} == {
        "kubernetes-node", "containerd", "runc", "cri-tools", "cni-plugins", "coredns",
        "kube-router"}
    assert not set(gobuild.NODE_MODULES) & set(gobuild.MODULES)
    for program in ("kubelet", "kube-proxy", "containerd", "containerd-shim-runc-v2", "ctr",
                    "runc", "crictl", "bridge", "host-local", "loopback", "portmap", "coredns",
                    "kube-router"):
        assert gobuild.PROGRAMS[program] in gobuild.NODE_MODULES


def test_node_addresses_are_private_and_distinct_per_index():
    one, two = Addresses.for_index(1), Addresses.for_index(2)
    assert (one.node_ip, one.pod_cidr, one.gateway) == ("10.250.0.1", "10.251.1.0/24",
                                                        "10.251.1.1")
    assert two.pod_cidr != one.pod_cidr and two.node_ip != one.node_ip
    with pytest.raises(ValueError, match=r"outside 1\.\.250"):
        Addresses.for_index(0)


async def _connect(socket_path: Path, authority: str) -> tuple[bytes, asyncio.StreamReader,
                                                                asyncio.StreamWriter]:
    reader, writer = await asyncio.open_unix_connection(str(socket_path))
    writer.write(f"CONNECT {authority} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    return head, reader, writer


async def test_the_egress_proxy_relays_to_loopback_and_refuses_anything_else(tmp_path):
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(await reader.readline())
        await writer.drain()
        writer.close()

    target = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = target.sockets[0].getsockname()[1]
    socket_path = tmp_path / "egress.sock"
    proxy = asyncio.create_task(egressproxy.serve(socket_path, tmp_path / "routes"))
    try:
        for _ in range(200):
            if socket_path.exists():
                break
            await asyncio.sleep(0.05)
        head, reader, writer = await _connect(socket_path, f"127.0.0.1:{port}")
        assert head.startswith(b"HTTP/1.1 200 ")
        writer.write(b"ping\n")
        await writer.drain()
        assert await asyncio.wait_for(reader.readline(), 10) == b"ping\n"
        writer.close()
        # No route file for it and not loopback: the cluster reaches nothing off this machine.
        head, _, writer = await _connect(socket_path, "10.250.0.9:10250")
        assert head.startswith(b"HTTP/1.1 502 ")
        writer.close()
        head, _, writer = await _connect(socket_path, "no-port")
        assert head.startswith(b"HTTP/1.1 502 ")
        writer.close()
    finally:
        proxy.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await proxy
        target.close()
        await target.wait_closed()


def test_a_node_directory_too_long_for_the_kubelets_sockets_is_refused_naming_the_limit(
        monkeypatch):
    from tardigrade_local import realnode

    monkeypatch.setattr(realnode.os, "geteuid", lambda: 0)
    fits = Path("/") / ("d" * (realnode.MAX_DIRECTORY_CHARS - 1))
    assert len(str(fits / "kubelet/device-plugins/kubelet.sock")) <= 107
    too_long = Path("/") / ("d" * realnode.MAX_DIRECTORY_CHARS)
    node = realnode.RealNode("n", too_long, "", too_long)
    with pytest.raises(realnode.RealNodeError, match="108-byte limit"):
        node.start()


def test_a_nodes_registry_configuration_is_plain_http_for_that_host_only(tmp_path):
    written = noderegistry.write_hosts(tmp_path, "127.0.0.1:5123")
    # containerd's directory for a host with a port is `host:port` (docs/hosts.md).
    assert written == tmp_path / "127.0.0.1:5123" / "hosts.toml"
    config = tomllib.loads(written.read_text())
    assert config == {"server": "http://127.0.0.1:5123", "host": {
        "http://127.0.0.1:5123": {"capabilities": ["pull", "resolve"]}}}
    argv = noderegistry.proxy_argv("python3", Path("/run/netns/tdg-x"), "127.0.0.1:5123")
    assert argv[-3:] == ["/run/netns/tdg-x", "5123", "127.0.0.1:5123"]


@pytest.mark.parametrize("registry", ["localhost:5000", "10.0.0.1:5000", "127.0.0.1",
                                      "127.0.0.1:http", "127.0.0.1:70000", "127.0.0.2:5000"])
def test_a_registry_a_node_cannot_reach_under_the_same_name_is_refused(registry, tmp_path):
    with pytest.raises(noderegistry.NodeRegistryError, match=r"127\.0\.0\.1:PORT"):
        RealNode("n", tmp_path, "https://127.0.0.1:6443", tmp_path, registry=registry)


def test_network_policies_need_a_cluster_network(tmp_path):
    with pytest.raises(ValueError, match=r"network_policies=True needs a cluster network"):
        RealNode("n", tmp_path, "https://127.0.0.1:6443", tmp_path, network_policies=True)


def test_a_nodes_kubelet_gets_its_own_feature_gates_and_the_others_the_defaults(tmp_path):

    def config(**kwargs: object) -> dict[str, object]:
        directory = tmp_path / str(len(list(tmp_path.iterdir())))
        (directory / "etc").mkdir(parents=True)
        node = RealNode("n", directory, "https://127.0.0.1:6443", tmp_path, **kwargs)
        return dict(json.loads(node._write_kubelet_config().read_text()))

    assert "featureGates" not in config()
    # The rules' gate goes off with the one that depends on it: the kubelet would refuse
    # RestartAllContainersOnContainerExits on over ContainerRestartRules off.
    assert config(feature_gates=KUBELET_WITHOUT_RESTART_RULES)["featureGates"] == {
        "ContainerRestartRules": False, "RestartAllContainersOnContainerExits": False}


# A machine of 2 CPUs and 8 GiB, as cAdvisor would report it.
MACHINE = nodeshape.Machine(cpu_millis=2000, memory_bytes=8 * 2**30)
TPU_HOST = NodeConfig("tpu-1", labels={"cloud.google.com/gke-tpu-topology": "2x4"},
                      taints=({"key": "google.com/tpu", "value": "present",
                               "effect": "NoSchedule"},),
                      capacity={"cpu": "1500m", "memory": "2Gi", "pods": "32",
                                "google.com/tpu": "4", "ephemeral-storage": "100Gi"},
                      pool="tpu-pool")


def test_a_node_config_becomes_the_kubelets_labels_taints_and_reservations():
    shape = nodeshape.shape(TPU_HOST, MACHINE)
    assert shape.node_labels == ("cloud.google.com/gke-nodepool=tpu-pool,"
                                 "cloud.google.com/gke-tpu-topology=2x4")
    assert shape.config == {
        "registerWithTaints": [{"key": "google.com/tpu", "value": "present",
                                "effect": "NoSchedule"}],
        "maxPods": 32,
        # What the template does not offer is reserved; memory less the eviction threshold.
        "systemReserved": {"cpu": "500m",
                           "memory": str(6 * 2**30 - nodeshape.EVICTION_HARD_MEMORY_BYTES)}}
    assert shape.extended == {"google.com/tpu": "4"}
    assert nodeshape.capacity_patch(shape.extended) == [
        {"op": "add", "path": "/status/capacity/google.com~1tpu", "value": "4"}]
    node = {"status": {"capacity": {"cpu": "2", "memory": "8Gi", "google.com/tpu": "4"},
                       "allocatable": {"cpu": "1500m", "memory": "2Gi"}}}
    assert nodeshape.mismatches(shape, node) == ["allocatable google.com/tpu None (wanted 4)"]
    node["status"]["allocatable"]["google.com/tpu"] = "4"
    assert nodeshape.mismatches(shape, node) == []


@pytest.mark.parametrize(("change", "message"), [
    ({"capacity": {"cpu": "4"}}, r"capacity.cpu 4 is more than this machine's 2 CPUs"),
    ({"capacity": {"memory": "8Gi"}}, r"capacity.memory 8Gi is more than this machine's "
                                      r"memory less the kubelet's eviction threshold: give "
                                      r"it at most 8092Mi"),
    ({"capacity": {"example": "1"}}, r"capacity.example is neither"),
    ({"capacity": {"nvidia.com/gpu": "0.5"}}, r"a whole number of devices"),
    ({"labels": {"kubernetes.io/role": "x"}}, r"label kubernetes.io/role: the kubelet refuses"),
    ({"labels": {"node-restriction.kubernetes.io/a": "x"}}, r"may never set labels"),
    ({"taints": ({"key": "a", "effect": "Sometimes"},)}, r"effect of NoSchedule"),
])
def test_a_node_config_no_real_node_of_this_machine_can_be_is_refused_naming_it(
        change, message):
    with pytest.raises(nodeshape.NodeShapeError, match=message):
        nodeshape.shape(dataclasses.replace(NodeConfig("n"), **change), MACHINE)


def test_allowed_kubelet_labels_pass():
    config = NodeConfig("n", labels={"node.kubernetes.io/instance-type": "ct5lp-hightpu-4t",
                                     "topology.kubernetes.io/zone": "us-west4-a"},
                        capacity={})
    assert nodeshape.shape(config, MACHINE).config == {}


def test_a_node_plan_is_a_node_config_with_the_spot_label_and_its_gates():
    spot = plan_nodes(1, 1)[1]
    assert spot.node_config() == NodeConfig("real-2", labels={SPOT_LABEL: "true"},
                                            capacity={})
    gated = dataclasses.replace(spot, kubelet_feature_gates=KUBELET_WITHOUT_RESTART_RULES,
                                config=TPU_HOST)
    config = gated.node_config()
    assert (config.name, config.pool, config.capacity) == ("real-2", "tpu-pool",
                                                           TPU_HOST.capacity)
    assert config.labels[SPOT_LABEL] == "true" and config.feature_gates == \
        KUBELET_WITHOUT_RESTART_RULES
    assert NodePlan.of(dataclasses.replace(TPU_HOST, labels={SPOT_LABEL: "true"})).spot


def test_a_real_node_refuses_a_config_larger_than_the_machine_before_starting(tmp_path):
    with pytest.raises(nodeshape.NodeShapeError, match=r"capacity.cpu 4096 is more"):
        RealNode("n", tmp_path, "https://127.0.0.1:6443", tmp_path,
                 config=NodeConfig("n", capacity={"cpu": "4096"}))


def test_a_vm_its_pool_recreates_is_on_its_way_from_the_moment_it_goes(tmp_path):
    real = RealNodeCluster(tmp_path, plan_nodes(1, 1))
    real.nodes = {name: RealNode(name, tmp_path / name, "", tmp_path)
                  for name in ("real-1", "real-2")}
    assert real.pool_sizes() == {"default-pool": 2} and real.upcoming_nodes() == []
    with real._coming_back("real-2", 1.0):  # while its shutdown fails its pods
        assert real.pool_sizes() == {"default-pool": 1}
        [coming] = real.upcoming_nodes()
        # As the autoscaler simulates it: the kubelet's figures are the machine's.
        assert (coming.name, coming.labels, coming.capacity["cpu"]) == (
            "real-2", {SPOT_LABEL: "true"}, f"{nodeshape.Machine.here().cpu_millis}m")
    with pytest.raises(RuntimeError), real._coming_back("real-1", 1.0):
        raise RuntimeError("the shutdown failed")
    assert [c.name for c in real.upcoming_nodes()] == ["real-2"]
    assert real.has_node("real-2") and not real.has_node("spot-pool-1")


def test_a_released_queued_provisioning_node_is_deleted_and_its_name_stays_taken(tmp_path):
    queued = NodePool("dws", max_size=2, queued_provisioning=True)
    real = RealNodeCluster(tmp_path, plan_nodes(1, 0), pools=[queued], kueue=True)
    assert real._queued_pools() == [queued] and real._autoscaled_pools() == []
    # Without Kueue there is no ProvisioningRequest API: nothing grows the pool.
    assert RealNodeCluster(tmp_path, plan_nodes(1, 0), pools=[queued])._queued_pools() == []
    real.plan.append(NodePlan.of(queued.node_config("dws-1")))
    stopped: list[str] = []
    real.nodes = {name: RealNode(name, tmp_path / name, "", tmp_path)
                  for name in ("real-1", "dws-1")}
    for node in real.nodes.values():
        node.stop = lambda name=node.name: stopped.append(name)  # type: ignore[method-assign]
    deleted: list[str] = []

    async def delete_node(name: str) -> None:
        deleted.append(name)

    real._pool_cloud = SimpleNamespace(delete_node=delete_node)  # type: ignore[assignment]
    assert real.pool_sizes() == {"default-pool": 1, "dws": 1}
    asyncio.run(real.remove_node("dws-1"))
    assert (stopped, deleted) == (["dws-1"], ["dws-1"])
    assert real.pool_sizes() == {"default-pool": 1}
    assert [n.name for n in real.retired] == ["dws-1"] and real.has_node("dws-1")
    asyncio.run(real.remove_node("dws-1"))  # gone already: nothing more
    assert (stopped, deleted) == (["dws-1"], ["dws-1"])


def test_a_reclaim_takes_every_host_of_a_multi_host_slice_and_its_pool_brings_them_back(
        tmp_path, monkeypatch):
    host = {"cpu": "500m", "memory": "1Gi", "pods": "20"}
    shape = SliceShape("tpu-v5-lite-podslice", "2x4", 4)
    real = RealNodeCluster(tmp_path, [*plan_nodes(1, 0),
                                      *slice_nodes("s1", shape, host_capacity=host),
                                      *slice_nodes("s2", shape, host_capacity=host)])
    real.nodes = {p.name: RealNode(p.name, tmp_path / p.name, "", tmp_path) for p in real.plan}
    shut: list[str] = []
    deleted: list[str] = []

    def shutdown(node: RealNode) -> dict[str, object]:
        if node.name == "s2-1":
            raise RealNodeError("logind did not answer")
        shut.append(node.name)
        return {"released": True, "host": node.name}

    monkeypatch.setattr(RealNode, "shutdown", shutdown)
    monkeypatch.setattr(RealNodeCluster, "kube", lambda self: contextlib.nullcontext())
    monkeypatch.setattr(kubernetes.client, "CoreV1Api",
                        lambda api: SimpleNamespace(delete_node=deleted.append))
    try:
        assert real.reclaim("s1-1", replace_after_seconds=3600)["host"] == "s1-1"
        assert sorted(shut) == sorted(deleted) == ["s1-0", "s1-1"]
        assert sorted(real.nodes) == ["real-1", "s2-0", "s2-1"]
        # The pool recreates both hosts: on their way, out of its size.
        assert sorted(real.recreating) == ["s1-0", "s1-1"]
        assert real.pool_sizes() == {"default-pool": 1, "s2": 2}
        assert [(c.labels["cloud.google.com/gke-tpu-topology"], c.capacity["google.com/tpu"])
                for c in real.upcoming_nodes()] == [("2x4", "4")] * 2
        # A host whose VM would not shut down stays; the one that did goes and comes back.
        with pytest.raises(RealNodeError, match="logind"):
            real.reclaim("s2-0", replace_after_seconds=3600)
        assert sorted(real.nodes) == ["real-1", "s2-1"]
        assert sorted(real.recreating) == ["s1-0", "s1-1", "s2-0"]
        # A node of no slice goes alone.
        real.reclaim("real-1")
        assert sorted(real.nodes) == ["s2-1"] and deleted[-1] == "real-1"
        with pytest.raises(RealClusterError, match=r"no running node 's1-0' \(running: \['s2-1'\]"):
            real.reclaim("s1-0")
    finally:
        real._settle_recreations()  # the recreations waiting for their delay end
