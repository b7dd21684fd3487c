"""The process kubelet against the local API server, through the official clients.

One cluster serves the module; tests that destroy nodes add their own first.
"""

from __future__ import annotations

import itertools
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from kube_helpers import Kube, condition, container_status, kubectl, python_pod, wait_for
from kubernetes import client
from tardigrade_local.cluster import LocalCluster
from tardigrade_local.gke import disruptions as d
from tardigrade_local.gke.nodes import NodeConfig

pytestmark = pytest.mark.slow
_names = itertools.count()
POD_GC_SECONDS = 20 + 40 + 20


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    state = tmp_path_factory.mktemp("kubelet") / "state"
    nodes = [NodeConfig("node-a"), NodeConfig("node-b", capacity={"cpu": "2"})]
    with LocalCluster(state, nodes=nodes, with_gcs=False, shutdown_grace_seconds=30,
                      backoff_base_seconds=0.2) as running:
        yield running


@pytest.fixture(scope="module")
def kube(cluster):
    return Kube(str(cluster.kubeconfig))


def wait_log(cluster, pod: str, text: str) -> None:
    """Wait until the pod printed `text` (e.g. after installing a signal handler)."""
    path = cluster.layout.container_log("default", pod, "main")
    wait_for(lambda: path.exists() and text in path.read_text(), what=f"{text!r} from {pod}")


def fresh_node(cluster, kube, **labels) -> str:
    name = f"extra-{next(_names)}"
    cluster.add_node(name, labels=labels)
    wait_for(lambda: name in kube.node_names(), what=f"node {name}")
    return name


def test_pod_succeeds_with_env_exit_code_and_termination_message(kube):
    script = """
        import os
        with open(os.environ["TLOG"], "w") as f:
            f.write("done: " + os.environ["ME"] + " " + os.environ["NS"] + " " + os.environ["IP"])
        print("hello from", os.environ["ME"])
    """
    env = [
        {"name": "TLOG", "value": "/dev/termination-log"},
        {"name": "ME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    kube.create_pod(python_pod("ok", script, container={"env": env}))
    pod = kube.wait_phase("ok", ("Succeeded", "Failed"))
    assert pod["status"]["phase"] == "Succeeded"
    terminated = container_status(pod)["state"]["terminated"]
    assert terminated["exitCode"] == 0 and terminated["reason"] == "Completed"
    ip = pod["status"]["podIP"]
    assert ip.startswith("127.") and ip != "127.0.0.1"
    assert terminated["message"] == f"done: ok default {ip}"
    assert terminated["startedAt"] <= terminated["finishedAt"]
    assert condition(pod, "PodScheduled")["status"] == "True"
    assert condition(pod, "Ready")["reason"] == "PodCompleted"
    assert pod["spec"]["nodeName"] in ("node-a", "node-b")

    def reasons():
        events = kube.core.list_namespaced_event("default").items
        found = {e.reason for e in events if e.involved_object.name == "ok"}
        return found if {"Scheduled", "Started"} <= found else None

    wait_for(reasons, what="Scheduled and Started events")


def test_failing_pod_is_failed_with_exit_code_and_log_fallback(kube, cluster):
    script = "import sys; print('something broke'); sys.exit(3)"
    kube.create_pod(python_pod("bad", script, container={
        "terminationMessagePolicy": "FallbackToLogsOnError"}))
    pod = kube.wait_phase("bad", ("Succeeded", "Failed"))
    assert pod["status"]["phase"] == "Failed"
    terminated = container_status(pod)["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (3, "Error")
    assert terminated["message"].strip() == "something broke"
    assert kubectl("logs", "bad", env=cluster.client_env()) == "something broke\n"


def test_logs_follow_while_running(kube, cluster):
    script = """
        import time
        for i in range(3):
            print("line", i, flush=True)
            time.sleep(0.3)
    """
    kube.create_pod(python_pod("chatty", script))
    kube.wait_phase("chatty", ("Running", "Succeeded"))
    out = kubectl("logs", "-f", "chatty", env=cluster.client_env())
    assert out == "line 0\nline 1\nline 2\n"
    assert kubectl("logs", "chatty", "--tail=1", env=cluster.client_env()) == "line 2\n"
    stamped = kubectl("logs", "chatty", "--timestamps", "--since=1h", env=cluster.client_env())
    stamps = [line.split(" ", 1) for line in stamped.splitlines()]
    assert [text for _, text in stamps] == ["line 0", "line 1", "line 2"]
    assert all(stamp.endswith("Z") and "T" in stamp for stamp, _ in stamps)
    assert kubectl("logs", "chatty", "--limit-bytes=4", env=cluster.client_env()) == "line"


def test_logs_keep_stdout_and_stderr_lines_whole(kube):
    script = """
        import sys
        print("to stdout", flush=True)
        print("to stderr", file=sys.stderr, flush=True)
        sys.stdout.write("x" * 40000 + "\\n")
        sys.stdout.write("no newline at the end")
    """
    kube.create_pod(python_pod("streams", script))
    kube.wait_phase("streams", ("Succeeded",))
    out = kube.core.read_namespaced_pod_log("streams", "default")
    # Each stream keeps its order; how the two interleave is not defined (as on a real node).
    assert "to stderr\n" in out
    assert out.replace("to stderr\n", "", 1) == (
        "to stdout\n" + "x" * 40000 + "\nno newline at the end")


def test_graceful_deletion_sigterm_then_sigkill_after_grace(kube, cluster):
    script = """
        import signal, time
        def term(*_):
            print("got SIGTERM", flush=True)
        signal.signal(signal.SIGTERM, term)
        print("ready", flush=True)
        while True:
            time.sleep(0.1)
    """
    kube.create_pod(python_pod("stubborn", script, grace=2))
    log_path = cluster.layout.container_log("default", "stubborn", "main")
    wait_log(cluster, "stubborn", "ready")
    pid = int(cluster.layout.container_pid("default", "stubborn", "main").read_text())
    started = time.monotonic()
    kube.core.delete_namespaced_pod("stubborn", "default")
    deleting = kube.pod("stubborn")
    assert deleting is not None and deleting["metadata"]["deletionTimestamp"]
    kube.wait_gone("stubborn", timeout=20)
    elapsed = time.monotonic() - started
    assert 1.8 <= elapsed < 10, elapsed
    assert "got SIGTERM" in log_path.read_text()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_polite_process_goes_at_once_on_delete(kube, cluster):
    kube.create_pod(python_pod("polite", "import time; time.sleep(60)", grace=30))
    kube.wait_phase("polite", ("Running",))
    started = time.monotonic()
    kube.core.delete_namespaced_pod("polite", "default")
    kube.wait_gone("polite")
    assert time.monotonic() - started < 10


def test_preempted_node_gives_disruption_target_grace_and_disappears(kube, cluster):
    node = fresh_node(cluster, kube, **{"cloud.google.com/gke-spot": "true"})
    script = """
        import signal, sys, time
        def term(*_):
            print("saving", flush=True)
            time.sleep(0.5)
            sys.exit(75)
        signal.signal(signal.SIGTERM, term)
        print("ready", flush=True)
        while True:
            time.sleep(0.1)
    """
    kube.create_pod(python_pod("spot-worker", script, node=node, grace=20))
    wait_log(cluster, "spot-worker", "ready")
    cluster.preempt_node(node, grace_seconds=5)
    pod = kube.wait_phase("spot-worker", ("Failed",))
    target = condition(pod, d.DISRUPTION_TARGET)
    assert target and target["reason"] == d.REASON_TERMINATION_BY_KUBELET
    assert target["message"] == d.NODE_SHUTDOWN_MESSAGE
    assert pod["status"]["reason"] == "Terminated"
    assert container_status(pod)["state"]["terminated"]["exitCode"] == 75
    # The VM is gone: GKE's cloud controller deletes its Node (kube-controller-manager's pod
    # GC then deletes the pod, after its quarantine: test_lost_node_pods_are_failed_by_pod_gc).
    wait_for(lambda: node not in kube.node_names(), what="node deleted")


def test_preemption_grace_ends_in_sigkill(kube, cluster):
    node = fresh_node(cluster, kube)
    script = """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        while True:
            time.sleep(0.1)
    """
    kube.create_pod(python_pod("deaf", script, node=node, grace=30))
    wait_log(cluster, "deaf", "ready")
    started = time.monotonic()
    cluster.preempt_node(node, grace_seconds=1, replace_after_seconds=0.5, wait=True)
    assert 0.9 <= time.monotonic() - started < 10
    pod = kube.pod("deaf")
    if pod is not None:
        assert container_status(pod)["state"]["terminated"]["exitCode"] == 137
    # The replacement VM comes back under the same name, as a managed instance group does.
    wait_for(lambda: node in kube.node_names(), what="replacement node")


def test_lost_node_pods_are_failed_by_pod_gc(kube, cluster):
    node = fresh_node(cluster, kube)
    kube.create_pod(python_pod("orphan", "import time; time.sleep(60)", node=node))
    kube.wait_phase("orphan", ("Running",))
    pid = int(cluster.layout.container_pid("default", "orphan", "main").read_text())
    cluster.delete_node(node)
    assert node not in kube.node_names()

    def gc_condition():
        pod = kube.pod("orphan")
        return pod is None or condition(pod, d.DISRUPTION_TARGET)

    # kube-controller-manager's pod GC looks every 20 s (`gcCheckPeriod`) and waits 40 s for a
    # vanished node to come back (`quarantineTime`), constants of pkg/controller/podgc.
    seen = wait_for(gc_condition, POD_GC_SECONDS, what="pod GC")
    if seen is not True:
        assert seen["reason"] == d.REASON_DELETION_BY_POD_GC
    kube.wait_gone("orphan")
    wait_for(lambda: not psutil.pid_exists(pid)
             or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, what="process gone")


def test_eviction_api_marks_and_stops_the_pod(kube):
    kube.create_pod(python_pod("evictee", "import time; time.sleep(60)", grace=5))
    kube.wait_phase("evictee", ("Running",))
    body = {"apiVersion": "policy/v1", "kind": "Eviction",
            "metadata": {"name": "evictee", "namespace": "default"}}
    kube.core.create_namespaced_pod_eviction("evictee", "default", body)
    pod = kube.pod("evictee")
    if pod is not None:
        assert condition(pod, d.DISRUPTION_TARGET)["reason"] == d.REASON_EVICTION_BY_EVICTION_API
    kube.wait_gone("evictee")


def test_crashed_container_restarts_on_failure(kube, cluster):
    script = "import time; print('first words', flush=True); time.sleep(60)"
    kube.create_pod(python_pod("crashy", script, restart="OnFailure"))
    wait_log(cluster, "crashy", "first words")
    cluster.crash_pod("default", "crashy", sig=signal.SIGKILL)

    def restarted():
        pod = kube.pod("crashy")
        status = container_status(pod)
        return pod if status["restartCount"] >= 1 and "running" in status["state"] else None

    pod = wait_for(restarted, what="restart")
    last = container_status(pod)["lastState"]["terminated"]
    assert (last["exitCode"], last["reason"]) == (137, "Error")
    assert kube.pod("crashy")["status"]["phase"] == "Running"
    previous = kubectl("logs", "crashy", "--previous", env=cluster.client_env())
    assert previous == "first words\n"
    kube.core.delete_namespaced_pod("crashy", "default", grace_period_seconds=0)


def test_headless_service_names_let_two_pods_talk(kube):
    kube.core.create_namespaced_service("default", {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "gang"},
        "spec": {"clusterIP": "None", "selector": {"app": "gang"},
                 "ports": [{"port": 7000}]}})
    server = """
        import socket
        s = socket.create_server(("0.0.0.0", 7000))
        conn, _ = s.accept()
        conn.sendall(b"hello " + conn.recv(100))
    """
    client = """
        import os, socket, time
        for _ in range(200):
            try:
                c = socket.create_connection(("rank-0.gang.default.svc.cluster.local", 7000), 2)
                break
            except OSError:
                time.sleep(0.1)
        c.sendall(b"rank-1")
        reply = c.recv(100).decode()
        # The peer listens on its own pod IP, so this pod may use the same port too.
        socket.create_server(("0.0.0.0", 7000)).close()
        open(os.environ["TARDIGRADE_TERMINATION_LOG"], "w").write(reply)
    """
    for rank, script in ((0, server), (1, client)):
        kube.create_pod(python_pod(f"rank-{rank}", script, labels={"app": "gang"},
                                   hostname=f"rank-{rank}", subdomain="gang"))
    pod = kube.wait_phase("rank-1", ("Succeeded", "Failed"))
    assert container_status(pod)["state"]["terminated"]["message"] == "hello rank-1"
    assert kube.wait_phase("rank-0", ("Succeeded", "Failed"))["status"]["phase"] == "Succeeded"


def test_unschedulable_pod_stays_pending_with_condition(kube):
    kube.create_pod(python_pod("nowhere", "pass", nodeSelector={"pool": "tpu-v5"}))

    def unschedulable():
        pod = kube.pod("nowhere")
        cond = condition(pod, "PodScheduled")
        return cond if cond and cond["status"] == "False" else None

    cond = wait_for(unschedulable, what="Unschedulable")
    assert cond["reason"] == "Unschedulable"
    assert "didn't match Pod's node affinity/selector" in cond["message"]
    assert kube.pod("nowhere")["status"]["phase"] == "Pending"
    kube.core.delete_namespaced_pod("nowhere", "default")
    kube.wait_gone("nowhere")


def test_unknown_image_waits_in_image_pull_back_off(kube):
    body = python_pod("unpullable", "pass")
    body["spec"]["containers"][0]["image"] = "example.com/not-mapped:1"
    kube.create_pod(body)

    def waiting():
        pod = kube.pod("unpullable")
        statuses = pod.get("status", {}).get("containerStatuses") or []
        reason = statuses and (statuses[0]["state"].get("waiting") or {}).get("reason")
        return pod if reason == "ImagePullBackOff" else None

    pod = wait_for(waiting, what="ImagePullBackOff")
    assert pod["status"]["phase"] == "Pending"
    kube.core.delete_namespaced_pod("unpullable", "default")
    kube.wait_gone("unpullable")


def test_pod_sees_hostname_and_cluster_env(kube):
    script = """
        import os, socket, json
        print(json.dumps([socket.gethostname(), os.environ["HOSTNAME"],
                          "KUBERNETES_SERVICE_HOST" in os.environ, os.environ["NO_GCE_CHECK"]]))
    """
    kube.create_pod(python_pod("who", script, hostname="worker-7"))
    kube.wait_phase("who", ("Succeeded",))
    out = kube.core.read_namespaced_pod_log("who", "default")
    assert out.strip() == '["worker-7", "worker-7", false, "true"]'


def test_pods_get_api_credentials_unless_they_opt_out(kube):
    """The pod's token is its service account's: RBAC grants it what the Role says."""
    script = """
        import json, os, socket
        import kubernetes
        kubernetes.config.load_kube_config()
        _, active = kubernetes.config.list_kube_config_contexts()
        core = kubernetes.client.CoreV1Api()
        me = core.read_namespaced_pod(socket.gethostname(), active["context"]["namespace"])
        try:
            core.list_node()
        except kubernetes.client.ApiException as err:
            denied = err.status
        print(json.dumps([me.metadata.name, me.spec.service_account_name,
                          active["context"]["user"], denied]))
    """
    rbac = client.RbacAuthorizationV1Api(kube.api)
    rbac.create_namespaced_role("default", {
        "metadata": {"name": "read-pods"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]})
    rbac.create_namespaced_role_binding("default", {
        "metadata": {"name": "default-reads-pods"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                    "name": "read-pods"},
        "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": "default"}]})
    kube.create_pod(python_pod("with-token", script))
    kube.create_pod(python_pod("no-token", "import os; print('KUBECONFIG' in os.environ)",
                               automountServiceAccountToken=False))
    for name in ("with-token", "no-token"):
        kube.wait_phase(name, ("Succeeded", "Failed"), timeout=60)
    out = kube.core.read_namespaced_pod_log("with-token", "default")
    assert out.strip() == ('["with-token", "default", "system:serviceaccount:default:default", '
                           '403]')
    assert kube.core.read_namespaced_pod_log("no-token", "default").strip() == "False"


def test_init_container_runs_first_in_the_shared_pod_dir(kube):
    body = python_pod("staged", "print(open('staged.txt').read())")
    body["spec"]["initContainers"] = [{
        "name": "setup", "image": "local/python",
        "command": ["python", "-c", "open('staged.txt', 'w').write('prepared')"]}]
    kube.create_pod(body)
    pod = kube.wait_phase("staged", ("Succeeded", "Failed"))
    assert pod["status"]["phase"] == "Succeeded"
    assert pod["status"]["initContainerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    assert kube.core.read_namespaced_pod_log("staged", "default").strip() == "prepared"


def test_memory_limit_gives_oom_killed(kube):
    script = """
        import time
        hog = bytearray(400 * 1024 * 1024)
        time.sleep(30)
    """
    kube.create_pod(python_pod("hog", script, container={
        "resources": {"limits": {"memory": "100Mi"}}}))
    pod = kube.wait_phase("hog", ("Failed", "Succeeded"))
    terminated = container_status(pod)["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (137, "OOMKilled")


def test_restart_always_restarts_a_completed_container(kube):
    kube.create_pod(python_pod("again", "print('run')", restart="Always"))

    def restarted():
        pod = kube.pod("again")
        statuses = pod.get("status", {}).get("containerStatuses") or []
        return pod if statuses and statuses[0]["restartCount"] >= 2 else None

    pod = wait_for(restarted, what="two restarts")
    assert pod["status"]["phase"] == "Running"
    assert container_status(pod)["lastState"]["terminated"]["reason"] == "Completed"
    kube.core.delete_namespaced_pod("again", "default")
    kube.wait_gone("again")


def test_readiness_probe_holds_ready_until_the_server_answers(kube, cluster):
    script = """
        import http.server, os, time
        while not os.path.exists("go"):  # the test says when to listen
            time.sleep(0.05)
        http.server.HTTPServer(("0.0.0.0", 8080), http.server.SimpleHTTPRequestHandler
                               ).serve_forever()
    """
    probe = {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1}
    kube.create_pod(python_pod("probed", script, container={
        "ports": [{"name": "http", "containerPort": 8080}], "readinessProbe": probe}))
    running = kube.wait_phase("probed", ("Running",))
    assert container_status(running)["ready"] is False
    assert condition(running, "Ready")["status"] == "False"
    (cluster.layout.pod_dir("default", "probed") / "go").touch()
    wait_for(lambda: condition(kube.pod("probed"), "Ready")["status"] == "True",
             what="Ready=True")
    assert container_status(kube.pod("probed"))["ready"] is True
    kube.core.delete_namespaced_pod("probed", "default", grace_period_seconds=0)


def test_failing_liveness_probe_kills_the_container(kube):
    probe = {"exec": {"command": ["false"]}, "periodSeconds": 1, "failureThreshold": 2}
    kube.create_pod(python_pod("unhealthy", "import time; time.sleep(60)",
                               container={"livenessProbe": probe}))
    pod = kube.wait_phase("unhealthy", ("Failed",), timeout=30)
    terminated = container_status(pod)["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (143, "Error")


def test_active_deadline_fails_the_pod(kube):
    kube.create_pod(python_pod("slowpoke", "import time; time.sleep(60)",
                               activeDeadlineSeconds=1))
    pod = kube.wait_phase("slowpoke", ("Failed",), timeout=30)
    assert pod["status"]["reason"] == "DeadlineExceeded"
    assert container_status(pod)["state"]["terminated"]["exitCode"] == 143
    kube.core.delete_namespaced_pod("slowpoke", "default")
    kube.wait_gone("slowpoke")


def test_processes_beside_the_cluster_reach_pods_by_name(kube, cluster):
    """What an operator started with `cluster.client_env()` sees: pod names resolve."""
    kube.core.create_namespaced_service("default", {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
        "spec": {"clusterIP": "None", "selector": {"app": "web"}, "ports": [{"port": 8477}]}})
    server = """
        import http.server
        http.server.HTTPServer(("0.0.0.0", 8477), http.server.SimpleHTTPRequestHandler
                               ).serve_forever()
    """
    kube.create_pod(python_pod("web-0", server, labels={"app": "web"}, hostname="web-0",
                               subdomain="web"))
    kube.wait_phase("web-0", ("Running",))
    probe = textwrap.dedent("""
        import time, urllib.request
        for _ in range(100):
            try:
                url = "http://web-0.web.default.svc.cluster.local:8477/"
                print(urllib.request.urlopen(url, timeout=2).status)
                break
            except OSError:
                time.sleep(0.1)
    """)
    out = subprocess.run([sys.executable, "-c", probe], env=cluster.client_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "200", out.stderr
    kube.core.delete_namespaced_pod("web-0", "default", grace_period_seconds=0)


def test_missing_executable_is_a_start_error(kube):
    body = python_pod("noexec", "pass")
    body["spec"]["containers"][0]["command"] = ["no-such-program"]
    kube.create_pod(body)
    pod = kube.wait_phase("noexec", ("Failed",))
    terminated = container_status(pod)["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (128, "StartError")
    assert 'exec: "no-such-program": executable file not found in $PATH' in terminated["message"]


def test_kubelet_rejects_a_pod_bound_past_its_allocatable(kube):
    # Bound by name, the scheduler never saw it: the kubelet's own admission refuses it
    # (pkg/kubelet/lifecycle/predicate.go; Kubelet.rejectPod writes the status).
    body = python_pod("too-big", "print('never runs')", nodeName="node-b",
                      container={"resources": {"requests": {"cpu": "3"}}})
    kube.create_pod(body)
    pod = kube.wait_phase("too-big", ("Failed", "Running", "Succeeded"))
    assert pod["status"]["phase"] == "Failed"
    assert pod["status"]["reason"] == "OutOfcpu"
    # `used` counts whatever else of this module still runs on node-b.
    assert re.fullmatch(r"Pod was rejected: Node didn't have enough resource: cpu, "
                        r"requested: 3000, used: \d+, capacity: 2000", pod["status"]["message"])
    assert not pod["status"].get("containerStatuses")
    kube.core.delete_namespaced_pod("too-big", "default")
    kube.wait_gone("too-big")


def _as_node(cluster, node: str) -> client.CoreV1Api:
    """A client with the node agent's own credentials (`system:node:NODE`, `system:nodes`)."""
    pki = Path(cluster.info["ca_file"]).parent
    config = client.Configuration()
    config.host = cluster.api_url
    config.ssl_ca_cert = str(pki / "ca.crt")
    config.cert_file = str(pki / f"node-{node}.crt")
    config.key_file = str(pki / f"node-{node}.key")
    return client.CoreV1Api(client.ApiClient(config))


def _refused(call, *args, **kwargs) -> str:
    with pytest.raises(client.ApiException) as err:
        call(*args, **kwargs)
    assert err.value.status == 403, err.value
    return err.value.body


def test_a_node_agent_is_held_to_its_own_node_as_a_kubelet_is(kube, cluster):
    """The node agents speak as kubelets do, so kube-apiserver's Node authorizer and
    NodeRestriction apply to them: a node cannot taint itself or touch another Node, cannot
    write the status of a pod bound elsewhere, and reads a Secret only when a pod bound to it
    uses that Secret."""
    core = kube.core
    core.create_namespaced_secret("default", {"metadata": {"name": "b-only"},
                                              "stringData": {"k": "v"}})
    body = python_pod("on-b", "import time; time.sleep(600)", node="node-b", grace=0)
    body["spec"]["volumes"] = [{"name": "s", "secret": {"secretName": "b-only"}}]
    body["spec"]["containers"][0]["volumeMounts"] = [{"name": "s", "mountPath": "/s"}]
    kube.create_pod(body)
    kube.wait_phase("on-b", ("Running",), timeout=60)
    node_a, node_b = _as_node(cluster, "node-a"), _as_node(cluster, "node-b")

    # Its own Node: readable, but a taint is the control plane's to set.
    assert node_a.read_node("node-a").metadata.name == "node-a"
    why = _refused(node_a.patch_node, "node-a", {"spec": {"taints": [
        {"key": "example.com/mine", "effect": "NoSchedule"}]}})
    assert "is not allowed to modify taints" in why
    why = _refused(node_a.patch_node, "node-b", {"metadata": {"labels": {"x": "y"}}})
    assert "node-b" in why
    # A pod bound to node-b: node-a may not write its status; node-b may.
    status = {"status": {"conditions": [{"type": "example.com/Probe", "status": "True"}]}}
    why = _refused(node_a.patch_namespaced_pod_status, "on-b", "default", status)
    assert "node-a" in why
    node_b.patch_namespaced_pod_status("on-b", "default", status)
    # The Secret reaches only the node whose pod mounts it.
    assert node_b.read_namespaced_secret("b-only", "default").data["k"]
    _refused(node_a.read_namespaced_secret, "b-only", "default")
    core.delete_namespaced_pod("on-b", "default", grace_period_seconds=0)
