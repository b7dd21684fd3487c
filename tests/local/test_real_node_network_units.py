"""The cluster network's pieces that run without root: addresses, kube-proxy's and CoreDNS's
configuration, and the endpoint controllers' switch."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from tardigrade_local import clusterdns, clustergcs, controlplane, gobuild, kubeproxy, nodenet
from tardigrade_local.cluster import ClusterConfig
from tardigrade_local.realnode import Addresses


def test_the_cluster_networks_own_addresses_are_no_nodes_and_dns_is_in_the_service_range():
    nodes = {Addresses.for_index(i).node_ip for i in range(1, 251)}
    own = {nodenet.ROUTER_ADDRESS, nodenet.DNS_ADDRESS, nodenet.API_ADDRESS,
           nodenet.GCS_ADDRESS}
    assert len(own) == 4 and not own & nodes
    assert nodenet.ROUTER_ADDRESS not in nodes and nodenet.DNS_ADDRESS not in nodes
    for address in own:
        assert ipaddress.ip_address(address) in nodenet.NODE_NETWORK
    service_range = ipaddress.ip_network(controlplane.SERVICE_CIDR)
    assert ipaddress.ip_address(clusterdns.SERVICE_IP) in service_range
    # Below the band kube-apiserver hands out on its own (KEP-3070: 16 of a /24).
    assert int(ipaddress.ip_address(clusterdns.SERVICE_IP)) - int(
        service_range.network_address) < 16


def test_kube_proxy_leaves_the_hosts_conntrack_settings_alone():
    config = kubeproxy.config("n1", Path("/k"), str(nodenet.POD_NETWORK))
    assert config["mode"] == kubeproxy.MODE == "nftables"
    assert config["conntrack"] == {"maxPerCore": 0, "tcpEstablishedTimeout": "0s",
                                   "tcpCloseWaitTimeout": "0s"}
    assert config["hostnameOverride"] == "n1"
    assert config["detectLocalMode"] == "ClusterCIDR"
    assert config["clusterCIDR"] == "10.251.0.0/16"


def test_coredns_serves_the_cluster_domain_from_the_api_server_on_its_address():
    text = clusterdns.corefile(Path("/dns/coredns.kubeconfig"))
    assert f"bind {nodenet.DNS_ADDRESS}" in text
    assert "kubernetes cluster.local in-addr.arpa ip6.arpa" in text
    assert "kubeconfig /dns/coredns.kubeconfig tardigrade-local" in text
    assert "forward" not in text  # nothing outside the cluster is reachable
    assert gobuild.COREDNS.requirement("github.com/coredns/coredns") == "v1.15.0"
    assert gobuild.COREDNS.tags == "grpcnotrace"  # its Makefile's GOTAGS


def test_the_endpoint_controllers_run_only_when_asked(tmp_path):
    def flag(config: ClusterConfig) -> str:
        plane = controlplane.ControlPlane(tmp_path, config.control_plane_settings())
        return plane._controllers_flag()

    assert flag(ClusterConfig(state_dir=tmp_path)) == (
        "--controllers=*,-endpoints-controller,-endpointslice-controller,"
        "-endpointslice-mirroring-controller")
    assert flag(ClusterConfig(state_dir=tmp_path, endpoint_controllers=True)) == (
        "--controllers=*")


def test_pods_reach_the_gcs_emulator_by_its_services_name_with_its_client_variables():
    env = clustergcs.pod_env()
    url = "http://fake-gcs.kube-system.svc.cluster.local:4443"
    assert clustergcs.pod_url() == url
    # TensorStore's and google-cloud-storage's endpoints, and a test token instead of a
    # metadata server (which is nowhere on the cluster network).
    assert env["TENSORSTORE_GCS_HTTP_URL"] == env["STORAGE_EMULATOR_HOST"] == url
    assert env["GOOGLE_AUTH_TOKEN_FOR_TESTING"]
    assert env["NO_GCE_CHECK"] == "true"
    # What a TrainingJob's spec.env takes: name/value pairs, none the operator reserves.
    pairs = clustergcs.env_vars(env)
    assert {p["name"]: p["value"] for p in pairs} == env
    assert not [p for p in pairs if p["name"].startswith("TARDIGRADE_")]
