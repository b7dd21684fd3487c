"""Real nodes' pieces that run without root: how their programs are built, and the egress
proxy kube-apiserver reaches kubelets through."""

from __future__ import annotations

import asyncio
import contextlib
import json
import tomllib
from pathlib import Path

import pytest
from tardigrade_local import egressproxy, gobuild, noderegistry
from tardigrade_local.realnode import KUBELET_WITHOUT_RESTART_RULES, Addresses, RealNode


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
