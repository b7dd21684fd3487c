"""The kubelet's pure parts: images, env, scheduling, status, names."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tardigrade_local.gke import disruptions as d
from tardigrade_local.gke import fitcheck
from tardigrade_local.kubelet import network
from tardigrade_local.kubelet import podstatus as ps
from tardigrade_local.kubelet.config import PODSITE_DIR
from tardigrade_local.kubelet.credentials import service_account_volume, write_pod_kubeconfig
from tardigrade_local.kubelet.env import EnvError, container_env, expand
from tardigrade_local.kubelet.images import ImageMap, ImagePullError, ImageRule, repository
from tardigrade_local.paths import project_python_path

from tests.conftest import REPO_ROOT

OPERATOR_DOCKERFILE = REPO_ROOT / "operator" / "Dockerfile"


# --- images ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("image", "repo"),
    [
        ("us-docker.pkg.dev/p/r/tardigrade-trainer:v1", "us-docker.pkg.dev/p/r/tardigrade-trainer"),
        ("localhost:5000/tardigrade-trainer", "localhost:5000/tardigrade-trainer"),
        ("python:3.11@sha256:abcd", "python"),
        ("local/python", "local/python"),
    ],
)
def test_repository_strips_tag_and_digest(image, repo):
    assert repository(image) == repo


def _shipped_images(tmp_path, built=True) -> ImageMap:
    """The cluster's image map with the shipped images' venvs under tmp_path (fake `bin/`)."""
    from tardigrade_local.imagevenv import shipped_image_rules

    rules = shipped_image_rules(tmp_path)
    for rule in rules:
        if built:
            os.makedirs(rule.bin_dir, exist_ok=True)
            for program in ("python", "tardigrade"):
                (Path(rule.bin_dir) / program).touch()
    return ImageMap.with_extra(rules)


def test_trainer_image_runs_trainer_module_from_its_venv_and_args_replace_cmd(tmp_path):
    images = _shipped_images(tmp_path)
    argv = images.argv("gcr.io/x/tardigrade-trainer:latest", None, ["--steps", "3"])
    assert argv == [str(tmp_path / "trainer-cpu" / "venv" / "bin" / "python"), "-m",
                    "tardigrade_trainer", "--steps", "3"]


def test_a_shipped_image_whose_venv_is_not_built_fails_like_a_pull(tmp_path):
    images = _shipped_images(tmp_path, built=False)
    with pytest.raises(ImagePullError, match=r"tardigrade-trainer.*not built"):
        images.argv("gcr.io/x/tardigrade-trainer:latest", None, None)


def test_command_overrides_entrypoint_and_python_maps_to_this_interpreter():
    images = ImageMap()
    assert images.argv("local/python", ["python3", "-c"], ["print(1)"]) == [
        sys.executable, "-c", "print(1)"]
    assert images.argv("local/python", None, None) == [sys.executable]
    assert images.argv("local/python", ["/bin/echo", "hi"], None) == ["/bin/echo", "hi"]


def _dockerfile(name: str) -> str | None:
    found = re.findall(rf"^{name}\s+(.+)$", OPERATOR_DOCKERFILE.read_text(), flags=re.MULTILINE)
    return found[-1].strip() if found else None


def test_operator_image_runs_what_the_operator_dockerfile_runs(tmp_path):
    images = _shipped_images(tmp_path)
    rule = images.resolve("ghcr.io/tardigrade-dev/tardigrade-operator:0.1.0")
    # ENTRYPOINT is the venv's console script, as /usr/local/bin/tardigrade is in the image.
    entrypoint = json.loads(_dockerfile("ENTRYPOINT") or "[]")
    assert entrypoint == ["tardigrade"]
    bin_dir = tmp_path / "operator" / "venv" / "bin"
    assert list(rule.cmd) == json.loads(_dockerfile("CMD") or "[]")
    image_env = dict(pair.split("=", 1) for pair in (_dockerfile("ENV") or "").split())
    assert dict(rule.env) == image_env
    # The chart's args replace CMD, as a container runtime does.
    args = ["operator", "run", "--namespace=ml", "--standalone"]
    assert images.argv("example.com/tardigrade-operator@sha256:ab", None, args) == [
        str(bin_dir / "tardigrade"), *args]
    assert images.argv("example.com/tardigrade-operator", None, None) == [
        str(bin_dir / "tardigrade"), *json.loads(_dockerfile("CMD") or "[]")]


def test_unknown_image_is_a_pull_error_and_extra_rules_win():
    with pytest.raises(ImagePullError, match='Failed to pull image "nginx:1"'):
        ImageMap().resolve("nginx:1")
    rule = ImageRule.from_dict({"pattern": "nginx", "entrypoint": ["true"]})
    images = ImageMap.with_extra([rule])
    assert images.argv("nginx:1", None, None) == ["true"]


# --- API credentials ------------------------------------------------------------------------
def test_pod_kubeconfig_names_the_api_server_service_account_and_namespace(tmp_path):
    from kubernetes import config

    pod = {"metadata": {"name": "op-1", "namespace": "tardigrade-system", "uid": "u9"},
           "spec": {"serviceAccountName": "tardigrade", "containers": [{
               "name": "operator", "volumeMounts": [{
                   "name": "kube-api-access-x1",
                   "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}]}]}}
    assert service_account_volume(pod["spec"]) == "kube-api-access-x1"
    volume = tmp_path / "volumes" / "kube-api-access-x1"
    volume.mkdir(parents=True)
    (volume / "token").write_text("signed.jwt.token")
    path = write_pod_kubeconfig(volume, "https://127.0.0.1:6443", pod, None)
    _, active = config.list_kube_config_contexts(str(path))
    assert active["context"]["namespace"] == "tardigrade-system"
    assert active["context"]["user"] == "system:serviceaccount:tardigrade-system:tardigrade"
    client = config.new_client_from_config(str(path))
    assert client.configuration.host == "https://127.0.0.1:6443"
    assert list(client.configuration.api_key.values()) == ["Bearer signed.jwt.token"]
    assert service_account_volume({"containers": [{"name": "c"}]}) is None


# --- env ------------------------------------------------------------------------------------
POD = {
    "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "labels": {"a": "1", "b": "2"},
                 "annotations": {"x/y": "z"}},
    "spec": {"nodeName": "n1"},
    "status": {"podIP": "127.16.0.5", "hostIP": "127.8.0.2"},
}


def test_env_field_refs_literals_expansion_and_refs():
    container = {
        "env": [
            {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "LABEL_A", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['a']"}}},
            {"name": "ANN",
             "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['x/y']"}}},
            {"name": "LABELS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels"}}},
            {"name": "ADDR", "value": "$(NAME).$(NS):1 $(MISSING) $$(NAME)"},
            {"name": "FROM_CM", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}},
            {"name": "OPT", "valueFrom": {"secretKeyRef": {"name": "s", "key": "nope",
                                                           "optional": True}}},
            {"name": "CPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu",
                                                               "divisor": "1m"}}},
        ],
        "envFrom": [{"secretRef": {"name": "s"}, "prefix": "S_"}],
        "resources": {"limits": {"cpu": "1500m"}},
    }
    env = container_env(POD, container, {"cm": {"k": "v"}}, {"s": {"token": "t"}})
    assert env == {
        "S_token": "t", "NAME": "p", "NS": "ns", "IP": "127.16.0.5", "LABEL_A": "1",
        "ANN": "z", "LABELS": 'a="1"\nb="2"', "ADDR": "p.ns:1 $(MISSING) $(NAME)",
        "FROM_CM": "v", "CPU": "1500",
    }


def test_env_missing_configmap_is_an_error():
    ref = {"configMapKeyRef": {"name": "cm", "key": "k"}}
    container = {"env": [{"name": "X", "valueFrom": ref}]}
    with pytest.raises(EnvError):
        container_env(POD, container, {}, {})
    assert expand("$(A)-$(B)", {"A": "1"}) == "1-$(B)"


# --- the autoscaler's fit check ----------------------------------------------------------
def node(name, labels=None, taints=None, cpu="4", ready=True, pods="110"):
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
        "spec": {"taints": taints or []},
        "status": {"allocatable": {"cpu": cpu, "memory": "8Gi", "pods": pods},
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def pod(name, cpu=None, selector=None, tolerations=None, node_name=None, affinity=None):
    container = {"name": "c", "image": "local/python"}
    if cpu:
        container["resources"] = {"requests": {"cpu": cpu}}
    spec = {"containers": [container], "nodeSelector": selector or {},
            "tolerations": tolerations or []}
    if node_name:
        spec["nodeName"] = node_name
    if affinity:
        spec["affinity"] = affinity
    return {"metadata": {"name": name, "namespace": "default"}, "spec": spec, "status": {}}


SPOT = {"cloud.google.com/gke-spot": "true"}
SPOT_TAINT = {"key": "cloud.google.com/gke-spot", "value": "true", "effect": "NoSchedule"}


def test_scheduler_honours_selector_taints_and_tolerations():
    nodes = [node("plain"), node("spot", SPOT, [SPOT_TAINT])]
    assert fitcheck.schedule(pod("a"), nodes, []).node == "plain"
    spot_pod = pod("b", selector=SPOT)
    decision = fitcheck.schedule(spot_pod, nodes, [])
    assert decision.node is None
    assert decision.message.startswith(
        "0/2 nodes are available: 1 node(s) didn't match Pod's node affinity/selector, "
        "1 node(s) had untolerated taint {cloud.google.com/gke-spot: true}. preemption:")
    tolerant = pod("c", selector=SPOT, tolerations=[{"key": "cloud.google.com/gke-spot",
                                                     "operator": "Equal", "value": "true",
                                                     "effect": "NoSchedule"}])
    assert fitcheck.schedule(tolerant, nodes, []).node == "spot"
    exists = pod("d", selector=SPOT, tolerations=[{"operator": "Exists"}])
    assert fitcheck.schedule(exists, nodes, []).node == "spot"


def test_scheduler_counts_requests_and_spreads():
    nodes = [node("n1", cpu="2"), node("n2", cpu="2")]
    bound = [pod("x", cpu="1500m", node_name="n1")]
    assert fitcheck.schedule(pod("a", cpu="1"), nodes, bound).node == "n2"
    bound.append(pod("y", cpu="1500m", node_name="n2"))
    decision = fitcheck.schedule(pod("a", cpu="1"), nodes, bound)
    assert decision.node is None and "2 Insufficient cpu" in decision.message
    finished = pod("z", cpu="1500m", node_name="n2")
    finished["status"]["phase"] = "Succeeded"
    assert fitcheck.schedule(pod("a", cpu="1"), nodes, [bound[0], finished]).node == "n2"


def test_scheduler_skips_not_ready_nodes_and_reads_node_affinity():
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "pool", "operator": "In", "values": ["a", "b"]}]}]}}}
    nodes = [node("n1", {"pool": "c"}), node("n2", {"pool": "b"}), node("n3", {"pool": "a"},
                                                                       ready=False)]
    assert fitcheck.schedule(pod("a", affinity=affinity), nodes, []).node == "n2"
    assert fitcheck.schedule(pod("a"), [], []).message == "no nodes available to schedule pods"


# --- status ---------------------------------------------------------------------------------
def test_exit_codes_and_phases():
    assert ps.exit_code(-15) == 143 and ps.exit_code(3) == 3
    assert ps.termination_reason(0, False) == "Completed"
    assert ps.termination_reason(137, True) == "OOMKilled"
    rec = ps.ContainerRecord("c", "img")
    assert ps.running_phase([rec], "Never") == "Pending"
    rec.start("local://1")
    assert ps.running_phase([rec], "Never") == "Running"
    rec.terminate(1, "Error")
    assert ps.running_phase([rec], "Never") is None
    assert ps.running_phase([rec], "OnFailure") == "Running"
    assert ps.final_phase([rec]) == "Failed"
    assert rec.to_json()["state"]["terminated"]["exitCode"] == 1


def test_merge_conditions_keeps_foreign_conditions_and_transition_times():
    old = [{"type": "Ready", "status": "False", "lastTransitionTime": "T0"},
           {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}]
    merged = ps.merge_conditions(old, [ps.condition("Ready", False, "X")])
    assert merged[0]["lastTransitionTime"] == "T0"
    assert merged[1]["reason"] == "EvictionByEvictionAPI"
    flipped = ps.merge_conditions(old, [ps.condition("Ready", True)])
    assert flipped[0]["lastTransitionTime"] != "T0"


# --- names ----------------------------------------------------------------------------------
def test_ip_allocator_gives_distinct_loopback_addresses():
    alloc = network.IpAllocator()
    ips = {alloc.allocate() for _ in range(600)}
    assert len(ips) == 600 and all(ip.startswith("127.") for ip in ips)
    assert not any(ip.endswith((".0", ".255")) for ip in ips)


def test_headless_service_names():
    svc = {"metadata": {"name": "job", "namespace": "ns"},
           "spec": {"clusterIP": "None", "selector": {"app": "j"}}}
    p = {"metadata": {"name": "job-0", "namespace": "ns", "labels": {"app": "j"}},
         "spec": {"hostname": "job-0", "subdomain": "job"},
         "status": {"podIP": "127.16.0.9", "phase": "Running"}}
    assert network.pod_dns_names(p, [svc])[0] == "job-0.job.ns.svc.cluster.local"
    assert "127.16.0.9 job-0.job.ns.svc.cluster.local" in network.hosts_file([p], [svc])
    clusterip = {**svc, "spec": {**svc["spec"], "clusterIP": "10.0.0.1"}}
    assert network.pod_dns_names(p, [clusterip]) == []


def test_hosts_file_reads_each_service_once_not_once_per_pod():
    """The file is rewritten as pods start: with a headless Service per one-pod job, a scan
    of every Service for every pod grows with the square of the jobs."""
    reads = []

    class Meta(dict):
        def __getitem__(self, key):
            reads.append(self.get("name"))
            return super().__getitem__(key)

    def service(name):
        return {"metadata": Meta(name=name, namespace="ns"),
                "spec": {"clusterIP": "None", "selector": {"job": name}}}

    def pod(name, i):
        return {"metadata": {"name": f"{name}-0", "namespace": "ns", "labels": {"job": name}},
                "spec": {"hostname": f"{name}-0", "subdomain": name},
                "status": {"podIP": f"127.16.1.{i}", "phase": "Running"}}

    names = [f"job{i}" for i in range(40)]
    text = network.hosts_file([pod(n, i) for i, n in enumerate(names)],
                              [service(n) for n in names])
    assert "127.16.1.7 job7-0.job7.ns.svc.cluster.local" in text
    assert len(text.splitlines()) == 41
    assert max(reads.count(n) for n in names) <= 2


def test_pod_python_resolves_hosts_file_names_and_binds_its_own_ip(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.16.3.4 peer.svc.ns.svc.cluster.local peer.svc\n")
    probe = textwrap.dedent("""
        import json, socket
        s = socket.socket(); s.bind(("0.0.0.0", 0))
        print(json.dumps({
            "peer": socket.gethostbyname("peer.svc"),
            "fqdn": socket.getaddrinfo("peer.svc.ns.svc.cluster.local", 80)[0][4][0],
            "self": socket.gethostbyname("me"),
            "hostname": socket.gethostname(),
            "bound": s.getsockname()[0],
        }))
    """)
    path = os.pathsep.join([str(PODSITE_DIR), *project_python_path()])
    env = {**os.environ, "PYTHONPATH": path, "TARDIGRADE_HOSTS_FILE": str(hosts),
           "TARDIGRADE_POD_IP": "127.16.3.5", "HOSTNAME": "me"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                         check=True, timeout=60)
    assert json.loads(out.stdout) == {"peer": "127.16.3.4", "fqdn": "127.16.3.4",
                                      "self": "127.16.3.5", "hostname": "me",
                                      "bound": "127.16.3.5"}
    assert socket.gethostbyname("localhost").startswith("127.")


def test_a_process_outside_the_cluster_can_resolve_pod_names(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.16.7.7 rank-0.job.ns.svc.cluster.local\n")
    probe = (
        "import socket; from tardigrade_local import podnet; "
        f"podnet.install({str(hosts)!r}); "
        "print(socket.gethostbyname('rank-0.job.ns.svc.cluster.local'))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(project_python_path())}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                         text=True, check=True, timeout=60)
    assert out.stdout.strip() == "127.16.7.7"


# --- launch ---------------------------------------------------------------------------------
def test_launch_maps_termination_log_and_keeps_pod_networking_on_pythonpath(tmp_path):
    from tardigrade_local.kubelet.config import KubeletSettings
    from tardigrade_local.kubelet.launch import container_launch
    from tardigrade_local.paths import StateLayout

    settings = KubeletSettings(layout=StateLayout(tmp_path), api_url="http://127.0.0.1:1",
                               cluster_env={"STORAGE_EMULATOR_HOST": "http://127.0.0.1:2"})
    pod = {"metadata": {"name": "p", "namespace": "ns"}, "spec": {"hostname": "h"}}
    spec = {"name": "main", "image": "local/python",
            "command": ["python", "-c", "x", "/dev/termination-log"],
            "env": [{"name": "TERM_LOG", "value": "/dev/termination-log"},
                    {"name": "PYTHONPATH", "value": "/opt/app"}]}
    argv, env = container_launch(settings, pod, spec, "127.16.0.3", "127.8.0.2", {}, {})
    local_log = str(tmp_path / "pods" / "ns_p" / "main.termination-log")
    assert argv == [sys.executable, "-c", "x", local_log]
    assert env["TERM_LOG"] == env["TARDIGRADE_TERMINATION_LOG"] == local_log
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(PODSITE_DIR)
    assert env["PYTHONPATH"].endswith(os.pathsep + "/opt/app")
    assert (env["HOSTNAME"], env["TARDIGRADE_POD_IP"]) == ("h", "127.16.0.3")
    assert env["STORAGE_EMULATOR_HOST"] == "http://127.0.0.1:2"
    assert env["PYTHONUNBUFFERED"] == "1"


def test_a_shipped_image_gets_its_venv_path_and_env_but_not_the_checkout(tmp_path):
    from tardigrade_local.kubelet.config import KubeletSettings
    from tardigrade_local.kubelet.launch import container_launch
    from tardigrade_local.paths import StateLayout

    settings = KubeletSettings(layout=StateLayout(tmp_path / "state"),
                               api_url="http://127.0.0.1:1",
                               image_map=_shipped_images(tmp_path / "images"))
    pod = {"metadata": {"name": "p", "namespace": "ns"}, "spec": {}}
    spec = {"name": "trainer", "image": "ghcr.io/tardigrade-dev/tardigrade-trainer:0.1.0-cpu",
            "env": [{"name": "JAX_PLATFORMS", "value": "cpu,tpu"}]}
    argv, env = container_launch(settings, pod, spec, "127.16.0.3", "127.8.0.2", {}, {})
    bin_dir = str(tmp_path / "images" / "trainer-cpu" / "venv" / "bin")
    assert argv == [os.path.join(bin_dir, "python"), "-m", "tardigrade_trainer"]
    # Only the pod network's site directory: the image's packages come from its venv.
    assert env["PYTHONPATH"] == str(PODSITE_DIR)
    assert env["PATH"].split(os.pathsep)[0] == bin_dir
    # ENV from trainer_image/Dockerfile.cpu, under the pod's own env.
    assert env["PIP_NO_CACHE_DIR"] == "1"
    assert env["JAX_PLATFORMS"] == "cpu,tpu"


# --- CRI logs -------------------------------------------------------------------------------
def test_cri_log_records_round_trip_with_partial_lines_and_tail():
    import io

    from tardigrade_local import crilog

    out = io.BytesIO()
    writer = crilog.CriLogWriter(out, "stdout")
    writer.feed(b"one\ntw")
    writer.feed(b"o\n" + b"y" * (crilog.MAX_RECORD_BYTES + 5) + b"\nlast")
    writer.close()
    records = list(crilog.parse(out.getvalue()))
    assert [r.partial for r in records] == [False, False, True, False, True]
    long_line = "y" * (crilog.MAX_RECORD_BYTES + 5)
    assert crilog.text(out.getvalue()) == "one\ntwo\n" + long_line + "\nlast"
    tail = crilog.select(records, tail_lines=1)
    assert b"".join(r.render(False) for r in tail) == b"last"
    tail2 = crilog.select(records[:4], tail_lines=1)
    assert b"".join(r.render(False) for r in tail2) == b"y" * (crilog.MAX_RECORD_BYTES + 5) + b"\n"
    stamped = records[0].render(True).decode()
    assert stamped.endswith(" one\n") and stamped[:4].isdigit()


@pytest.mark.parametrize(
    ("pod_grace", "group_grace", "expected"),
    [
        (None, d.REGULAR_POD_SHUTDOWN_GRACE_SECONDS, 15.0),  # no pod grace: the group's
        (30, d.REGULAR_POD_SHUTDOWN_GRACE_SECONDS, 15.0),  # the API server's default 30 s
        (15, 15.0, 15.0),
        (5, 15.0, 5.0),  # a shorter pod grace wins
        (150, 105.0, 105.0),  # a GKE node pool opted in to a 120 s notice
    ],
)
def test_node_shutdown_gives_regular_pods_the_smaller_grace(pod_grace, group_grace, expected):
    assert d.SHUTDOWN_GRACE_PERIOD_SECONDS == 30.0  # GKE spot's notice, split 15 + 15
    assert d.node_shutdown_pod_grace(pod_grace, group_grace) == expected
