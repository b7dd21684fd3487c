"""Pods of the shipped images run from the image's virtualenv (built from its Dockerfile), not
from the development environment, and still get the pod network."""

from __future__ import annotations

import importlib.metadata
import json

import pytest
from kube_helpers import Kube, container_status, python_pod
from tardigrade_local import imagevenv
from tardigrade_local.cluster import LocalCluster

pytestmark = pytest.mark.slow

TRAINER_IMAGE = "ghcr.io/tardigrade-dev/tardigrade-trainer:0.1.0-cpu"
OPERATOR_IMAGE = "ghcr.io/tardigrade-dev/tardigrade-operator:0.1.0"
# What the pod can see of itself: interpreter, where its packages come from, the image's ENV,
# and the pod network: rank 0 listens on its pod IP until rank 1, which found it by its
# headless-service name, has connected (so rank 0 is still in the hosts file when rank 1 looks).
PROBE = """
    import importlib.util, json, os, socket, sys, time
    import tardigrade_trainer
    rank = socket.gethostname()
    if rank == "rank-0":
        server = socket.create_server(("0.0.0.0", 7000))
        conn, _ = server.accept()
        conn.sendall(b"hello")
        conn.close()
        peer = server.getsockname()[0]
    else:
        for _ in range(600):
            try:
                conn = socket.create_connection(("rank-0.gang.default.svc.cluster.local", 7000), 2)
                break
            except OSError:
                time.sleep(0.1)
        assert conn.recv(10) == b"hello"
        peer = conn.getpeername()[0]
    report = {"python": sys.executable, "trainer": tardigrade_trainer.__file__,
              "local": importlib.util.find_spec("tardigrade_local") is not None,
              "operator": importlib.util.find_spec("tardigrade_operator") is not None,
              "jax_platforms": os.environ.get("JAX_PLATFORMS"), "hostname": rank, "peer": peer}
    open(os.environ["TARDIGRADE_TERMINATION_LOG"], "w").write(json.dumps(report))
"""


def test_operator_image_pods_run_the_venv_console_script(tmp_path):
    venv = imagevenv.shipped_image("operator")
    with LocalCluster(tmp_path / "state", nodes=1, with_gcs=False) as cluster:
        kube = Kube(str(cluster.kubeconfig))
        # No command: ENTRYPOINT ["tardigrade"] from the venv; args replace CMD.
        pod = python_pod("version", "", container={"args": ["--version"]})
        del pod["spec"]["containers"][0]["command"]
        pod["spec"]["containers"][0]["image"] = OPERATOR_IMAGE
        kube.create_pod(pod)
        probe = ("import importlib.util, sys, tardigrade_operator.cli; print(sys.executable, "
                 "tardigrade_operator.cli.__file__, importlib.util.find_spec('tardigrade_local'))")
        pod = python_pod("probe", probe)
        pod["spec"]["containers"][0]["image"] = OPERATOR_IMAGE
        kube.create_pod(pod)
        for name in ("version", "probe"):
            assert kube.wait_phase(name, ("Succeeded", "Failed"), timeout=120)[
                "status"]["phase"] == "Succeeded"
        version = cluster.layout.container_log("default", "version", "main").read_text()
        python, cli, local = cluster.layout.container_log(
            "default", "probe", "main").read_text().split()[-3:]
    assert f"tardigrade {importlib.metadata.version('tardigrade')}" in version
    assert python == str(venv.python) and cli.startswith(str(venv.venv)) and local == "None"


def test_trainer_image_pods_run_from_the_image_venv_and_resolve_pod_names(tmp_path):
    venv = imagevenv.shipped_image("trainer-cpu")
    with LocalCluster(tmp_path / "state", nodes=1, with_gcs=False) as cluster:
        kube = Kube(str(cluster.kubeconfig))
        kube.core.create_namespaced_service("default", {
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": "gang"},
            "spec": {"clusterIP": "None", "selector": {"app": "gang"},
                     "ports": [{"port": 7000}]}})
        for rank in (0, 1):
            pod = python_pod(f"rank-{rank}", PROBE, labels={"app": "gang"},
                             hostname=f"rank-{rank}", subdomain="gang")
            pod["spec"]["containers"][0]["image"] = TRAINER_IMAGE
            kube.create_pod(pod)
        pods = [kube.wait_phase(f"rank-{rank}", ("Succeeded", "Failed"), timeout=120)
                for rank in (0, 1)]
        logs = [cluster.layout.container_log("default", f"rank-{rank}", "main").read_text()
                for rank in (0, 1)]
    for rank, pod in enumerate(pods):
        terminated = container_status(pod)["state"]["terminated"]
        assert pod["status"]["phase"] == "Succeeded", logs[rank][-3000:]
        report = json.loads(terminated["message"])
        assert report["python"] == str(venv.python)
        assert report["trainer"].startswith(str(venv.venv))
        assert not report["local"] and not report["operator"]
        # ENV JAX_PLATFORMS=cpu from trainer_image/Dockerfile.cpu.
        assert report["jax_platforms"] == "cpu"
        assert report["hostname"] == f"rank-{rank}"
        # Rank 0 bound its pod IP; rank 1 reached that address by name.
        assert report["peer"] == pods[0]["status"]["podIP"]
