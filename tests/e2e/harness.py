"""Drive the local cluster, the real operator and real trainer processes from tests."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import kubernetes
import pytest
import yaml
from kubernetes.client.exceptions import ApiException
from tardigrade_local.cluster import LocalCluster
from tardigrade_local.logshipper import LogShipper
from tardigrade_local.realcluster import (
    CHECKPOINT_CLAIM,
    CHECKPOINT_MOUNT,
    OPERATOR_NAMESPACE,
    SPOT_LABEL,
    NodePlan,
    RealNodeCluster,
    plan_nodes,
)
from tardigrade_local.steplog import StepLog
from tardigrade_operator.apidecode import BoundedApiClient

from tests.conftest import EXAMPLES, REPO_ROOT
from tests.polling import wait_for

# Real nodes need namespaces, mounts and cgroups.
REAL_NODES_HERE = sys.platform.startswith("linux") and os.geteuid() == 0
# A real-node module's mark: skipped, saying why, where real nodes cannot run.
NEEDS_REAL_NODES = pytest.mark.skipif(
    not REAL_NODES_HERE, reason="real nodes need Linux and root (namespaces, mounts, cgroups)")

T = TypeVar("T")
NAMESPACE = "default"


class OperatorProcess:
    """The operator of this checkout (`tardigrade operator run`) beside a control plane with
    no nodes, in a subprocess we can kill. On real nodes the chart installs the operator's
    image (`InstalledOperator`)."""

    def __init__(self, cluster: LocalCluster, log_path: Path,
                 peering: tuple[str, int] | None = None,
                 env: dict[str, str] | None = None,
                 namespaces: tuple[str, ...] = (NAMESPACE,), health_port: int = 0) -> None:
        """`health_port`: where /healthz is served (0: not at all)."""
        self.cluster = cluster
        self.health_port = health_port
        self.namespaces = namespaces
        self.log_path = log_path
        # (peering object, priority) to run as one of several replicas; None: standalone.
        self.peering = peering
        self.extra_env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {
            **os.environ, **self.cluster.client_env(),
            "TARDIGRADE_RESYNC_SECONDS": "1",
            "TARDIGRADE_METRICS_PORT": "0",
            "TARDIGRADE_UNSCHEDULABLE_TIMEOUT_SECONDS": "15",
            # Long enough that a busy CI machine never makes a live leader look dead.
            "TARDIGRADE_PEERING_LIFETIME_SECONDS": "20",
            **self.extra_env,
        }
        mode = ["--standalone"] if self.peering is None else [
            f"--peering={self.peering[0]}", f"--priority={self.peering[1]}"]
        log = open(self.log_path, "ab")  # noqa: SIM115  (owned by the child for its lifetime)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tardigrade_operator.cli", "operator", "run",
             *(f"--namespace={ns}" for ns in self.namespaces), *mode,
             "--health-port", str(self.health_port)],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
        )
        log.close()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(30)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.proc = None

    def assert_alive(self) -> None:
        assert self.proc is not None and self.proc.poll() is None, (
            "operator exited:\n" + self.log_path.read_text()[-3000:]
        )


TOKEN_REVIEW = "tardigrade-trainer-tokenreview"


def grant_trainer_token_review(rbac: kubernetes.client.RbacAuthorizationV1Api) -> None:
    """Rank 0 reviews its peers' rendezvous tokens, so tests that run the operator outside
    the chart grant trainers TokenReview too: here every ServiceAccount, for the test
    cluster's convenience; the chart grants only the allowed ones (values
    trainerTokenReview, admission.serviceAccounts)."""
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {"name": TOKEN_REVIEW},
            "rules": [{"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"],
                       "verbs": ["create"]}]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": TOKEN_REVIEW},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                           "name": TOKEN_REVIEW},
               "subjects": [{"kind": "Group", "apiGroup": "rbac.authorization.k8s.io",
                             "name": "system:serviceaccounts"}]}
    for create, body in ((rbac.create_cluster_role, role),
                         (rbac.create_cluster_role_binding, binding)):
        try:
            create(body)
        except ApiException as err:
            if err.status != 409:
                raise


class Cluster:
    """Thin conveniences over a running LocalCluster."""

    def __init__(self, local: LocalCluster, trainer_token_review: bool = True) -> None:
        """`trainer_token_review`: grant trainers TokenReview as the chart would; chart tests
        pass False, since the chart they install grants it (and helm refuses to take over an
        object of that name it did not create)."""
        self.local = local
        self.env = {**os.environ, **local.client_env()}
        # Bounded like the operator's: the tests read back objects nested 10,000 levels.
        configuration = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(config_file=str(local.kubeconfig),
                                           client_configuration=configuration)
        client = BoundedApiClient(configuration)
        self.core = kubernetes.client.CoreV1Api(client)
        self.custom = kubernetes.client.CustomObjectsApi(client)
        if trainer_token_review:
            grant_trainer_token_review(kubernetes.client.RbacAuthorizationV1Api(client))

    def kubectl(self, *args: str, check: bool = True, stdin: str | None = None,
                binary: str = "kubectl") -> str:
        result = subprocess.run([binary, *args], env=self.env, capture_output=True,
                                text=True, input=stdin, timeout=180)
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr}")
        return result.stdout + (result.stderr if not check else "")

    def apply(self, manifest: dict[str, Any]) -> str:
        return self.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(manifest))

    def job(self, name: str) -> dict[str, Any] | None:
        try:
            return self.custom.get_namespaced_custom_object(
                "tardigrade.dev", "v1alpha1", NAMESPACE, "trainingjobs", name)
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def status(self, name: str) -> dict[str, Any]:
        return (self.job(name) or {}).get("status") or {}

    def pods(self, job: str) -> list[Any]:
        return self.core.list_namespaced_pod(
            NAMESPACE, label_selector=f"tardigrade.dev/job={job}").items

    def clear_jobs(self) -> None:
        """Delete every job and wait for its pods to go: on two cores a test's leftover gang
        would slow the next test down."""
        self.kubectl("delete", "trainingjobs", "--all", "--wait=false")

        def left() -> list[str]:
            return [f"{p.metadata.name} on {p.spec.node_name}: {p.status.phase}"
                    f"{' deleting' if p.metadata.deletion_timestamp else ''}"
                    for p in self.core.list_namespaced_pod(
                        NAMESPACE, label_selector="tardigrade.dev/job").items]
        remaining: list[str] = []

        def gone() -> bool:
            remaining[:] = left()
            return not remaining
        try:
            wait_for(gone, 120, "leftover pods to go")
        except AssertionError as err:
            raise AssertionError(f"{err}: {remaining}") from None

    def step_log(self, job: str) -> StepLog:
        return StepLog(self.core, NAMESPACE, job)

    def complete_log(self, job: str) -> StepLog:
        """Rank 0's log of every attempt so far, with the last lines of pods already deleted,
        which a `step_log` polling the API may have missed: only real nodes have pods
        (`RealCluster.complete_log`)."""
        raise AssertionError(f"{job}: a control plane without nodes ran no pod; complete "
                             f"logs come from real nodes (RealCluster)")

    def wait_phase(self, name: str, phases: set[str], timeout: float,
                   collector: StepLog | None = None) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            if collector is not None:
                collector.collect()
            status = self.status(name)
            if status.get("phase") == "Failed" and "Failed" not in phases:
                raise AssertionError(f"{name} failed: {status.get('message')}")
            return status if status.get("phase") in phases else None
        return wait_for(reached, timeout, f"{name} in {sorted(phases)}")


def trainingjob(name: str, steps: int, replicas: int = 2, **spec: Any) -> dict[str, Any]:
    """The shipped example, renamed and shortened for a test."""
    job = copy.deepcopy(yaml.safe_load((EXAMPLES / "trainingjob.yaml").read_text()))
    job["metadata"] = {"name": name, "namespace": NAMESPACE}
    job["spec"]["replicas"] = replicas
    job["spec"]["trainer"]["steps"] = steps
    job["spec"]["checkpoint"]["path"] = f"gs://tardigrade/checkpoints/{name}"
    for key, value in spec.items():
        job["spec"][key] = value
    return job


@contextlib.contextmanager
def running_operator(cluster: Cluster, log_dir: Path, env: dict[str, str] | None = None,
                     namespaces: tuple[str, ...] = (NAMESPACE,), health_port: int = 0
                     ) -> Iterator[OperatorProcess]:
    """A standalone operator for a test module, logging into `log_dir`; stopped afterwards."""
    process = OperatorProcess(cluster.local, log_dir / "operator.log", env=env,
                              namespaces=namespaces, health_port=health_port)
    process.start()
    try:
        yield process
    finally:
        process.stop()


def assert_goodput_adds_up(cluster: Cluster, name: str) -> None:
    """As a user reads it: the goodput account's buckets add up to the job's wall time, from
    its creation to its completion, and the real trainer's phases are in them."""
    job = yaml.safe_load(cluster.kubectl("get", "tj", name, "-o", "yaml"))
    account, status = job["status"]["goodput"], job["status"]
    seconds = account["seconds"]
    assert all(value >= 0 for value in seconds.values()), seconds
    assert abs(sum(seconds.values()) - account["wallSeconds"]) < 1e-6, account
    created = datetime.fromisoformat(job["metadata"]["creationTimestamp"])
    completed = datetime.fromisoformat(status["completionTime"])
    assert abs((completed - created).total_seconds() - account["wallSeconds"]) < 0.01, account
    # A real trainer's attempts: each started, restored or initialised, compiled, trained.
    # (Pod start may be too quick here for any pass to see it.)
    for bucket in ("acceleratorStart", "restore", "compile", "productive"):
        assert seconds[bucket] > 0, (bucket, account)
    assert 0 < account["fraction"] < 1


# --- on real nodes ---------------------------------------------------------------------------
OPERATOR_SELECTOR = "app.kubernetes.io/name=tardigrade-operator"
# Pulls of the operator image on a node and the operator's start, on a shared machine.
OPERATOR_READY_SECONDS = 300.0
# What a real-node module's operator is told besides the chart's defaults: status follows
# progress within seconds, and a pod the scheduler cannot place is reported soon (the
# process operator of the other modules gets the same through its environment).
FAST_OPERATOR_VALUES = ("--set", "operator.resyncSeconds=1",
                        "--set", "operator.progressMaxIntervalSeconds=2",
                        "--set", "operator.unschedulableTimeoutSeconds=15")


class RealCluster(Cluster):
    """A `Cluster` over a `RealNodeCluster`: the operator is the chart's (helm, its image from
    the registry, `InstalledOperator`), trainers are containers of the registry's trainer-cpu
    image on real kubelets, placed on the spot nodes, checkpointing to the GCS emulator
    through its Service."""

    def __init__(self, real: RealNodeCluster, shipped_logs: Path) -> None:
        """`shipped_logs`: where a `LogShipper` writes the job pods' logs."""
        # The chart grants trainers TokenReview itself.
        super().__init__(real.cluster, trainer_token_review=False)
        self.real = real
        self.shipped_logs = shipped_logs

    def trainingjob(self, name: str, steps: int, replicas: int = 2, **spec: Any
                    ) -> dict[str, Any]:
        """`trainingjob`, for this cluster's nodes: the registry's trainer image, a small
        model and small requests (several ranks share a 2-core machine), on spot nodes, and
        the emulator's client variables (a real kubelet adds nothing to a pod's env)."""
        job = trainingjob(name, steps, replicas)
        body = job["spec"]
        body.update(image=self.real.images["trainer-cpu"], maxReplicas=max(replicas, 4),
                    resources={"requests": {"cpu": "100m", "memory": "256Mi"},
                               "limits": {"memory": "3Gi"}},
                    env=[{"name": k, "value": v} for k, v in self.real.gcs_pod_env().items()])
        # 12: a data axis of 1 to 4 ranks splits it evenly.
        body["trainer"].update(global_batch_size=12, seq_len=16, devices_per_process=1)
        body["podTemplate"] = {"terminationGracePeriodSeconds": 30,
                               "nodeSelector": {SPOT_LABEL: "true"}}
        body.update(spec)
        return job

    def mount_shared_checkpoints(self, job: dict[str, Any]) -> tuple[str, Path]:
        """Mount the cluster's ReadWriteMany claim (a shared filesystem: Filestore on GKE) in
        the job's pods; returns where the pods see it and where this machine does."""
        template = job["spec"].setdefault("podTemplate", {})
        template.setdefault("volumes", []).append(
            {"name": "shared", "persistentVolumeClaim": {"claimName": CHECKPOINT_CLAIM}})
        template.setdefault("volumeMounts", []).append(
            {"name": "shared", "mountPath": CHECKPOINT_MOUNT})
        return CHECKPOINT_MOUNT, self.real.checkpoints

    def complete_log(self, job: str) -> StepLog:
        """Rank 0's log of every attempt, as shipped off the nodes while it was written (a
        real kubelet removes a deleted pod's files)."""
        return StepLog.from_pod_log_dirs([self.shipped_logs], NAMESPACE, job)

    def spot_node_of(self, pod: Any) -> str:
        node = pod.spec.node_name
        labels = self.core.read_node(node).metadata.labels or {}
        assert labels.get(SPOT_LABEL) == "true", f"{pod.metadata.name} is on {node}, not spot"
        return str(node)


# Run by the operator image's python: prints [status, body] of a GET of {url}.
HEALTHZ_SCRIPT = """\
import json, urllib.error, urllib.request
try:
    with urllib.request.urlopen("{url}", timeout=10) as r:
        print(json.dumps([r.status, r.read().decode()]))
except urllib.error.HTTPError as e:
    print(json.dumps([e.code, e.read().decode()]))
"""


class InstalledOperator:
    """The operator as a user installs it: `helm install` of the chart, one replica, its
    image from the registry, its pod on the on-demand node under the chart's RBAC.

    The same surface as `OperatorProcess` for the tests: `kill` deletes the pod at once
    (its process is killed; the Deployment starts another), `start` waits for a pod to be
    Ready again, `assert_alive` checks the pod it started with still runs, never restarted,
    and `log_path` holds the pod's log as read at the last call of `read_log`."""

    def __init__(self, cluster: RealCluster, log_path: Path, values: tuple[str, ...] = ()
                 ) -> None:
        self.cluster = cluster
        self.log_path = log_path
        self.values = values
        self.pod_uid: str | None = None
        self.installed = False

    def _pods(self) -> list[Any]:
        return [p for p in self.cluster.core.list_namespaced_pod(
            OPERATOR_NAMESPACE, label_selector=OPERATOR_SELECTOR).items
            if p.metadata.deletion_timestamp is None]

    def _ready_pod(self) -> Any | None:
        for pod in self._pods():
            if any(c.type == "Ready" and c.status == "True"
                   for c in pod.status.conditions or []):
                return pod
        return None

    def start(self) -> None:
        if not self.installed:
            self.cluster.real.install_operator(*FAST_OPERATOR_VALUES, *self.values)
            self.installed = True
        pod = wait_for(self._ready_pod, OPERATOR_READY_SECONDS, "the operator's pod Ready")
        self.pod_uid = pod.metadata.uid

    def scale(self, replicas: int) -> None:
        """The operator's Deployment scaled (0: no operator at all until scaled back)."""
        self.cluster.kubectl("scale", "deployment", "-n", OPERATOR_NAMESPACE,
                             "-l", OPERATOR_SELECTOR, f"--replicas={replicas}")
        if replicas == 0:
            wait_for(lambda: not self._pods(), OPERATOR_READY_SECONDS,
                     "the operator's pods to go")
            self.pod_uid = None

    def kill(self) -> None:
        for pod in self._pods():
            self.cluster.core.delete_namespaced_pod(pod.metadata.name, OPERATOR_NAMESPACE,
                                                    grace_period_seconds=0)
        self.pod_uid = None

    def stop(self) -> None:
        """Keep its log. The release stays: a module's cluster goes with everything on it
        (`uninstall` where the same cluster takes another install)."""
        if self.installed:
            with contextlib.suppress(ApiException):
                self.read_log()

    def uninstall(self) -> None:
        """`helm uninstall`, waiting until the release's objects are gone (the chart's
        pre-delete hook first scales the operator to zero and releases the trainers' pods;
        the CRD stays, `crds.keep`), so that the cluster can take another install of the
        release, e.g. with other values."""
        if self.installed:
            self.cluster.real.uninstall_operator()
            self.installed = False
            self.pod_uid = None

    def read_log(self) -> str:
        text = ""
        for pod in self._pods():
            with contextlib.suppress(ApiException):
                text += self.cluster.core.read_namespaced_pod_log(
                    pod.metadata.name, OPERATOR_NAMESPACE)
        self.log_path.write_text(text)
        return text

    def _started_pod(self) -> Any:
        pods = {p.metadata.uid: p for p in self._pods()}
        assert self.pod_uid in pods, f"the operator's pod {self.pod_uid} is gone"
        return pods[self.pod_uid]

    def ready(self) -> bool:
        """The pod it started with is Ready: the kubelet's last probes of /healthz passed."""
        return any(c.type == "Ready" and c.status == "True"
                   for c in self._started_pod().status.conditions or [])

    def healthz(self) -> tuple[int, str]:
        """The status and body of /healthz in the pod it started with, read from inside the
        pod (`kubectl exec`, through its kubelet): this machine cannot route to pod
        addresses."""
        pod = self._started_pod()
        port = next(p.container_port for c in pod.spec.containers for p in c.ports or []
                    if p.name == "health")
        shown = self.cluster.kubectl(
            "exec", "-n", OPERATOR_NAMESPACE, pod.metadata.name, "--", "python", "-c",
            HEALTHZ_SCRIPT.format(url=f"http://127.0.0.1:{port}/healthz"))
        code, body = json.loads(shown)
        return int(code), str(body)

    def assert_alive(self) -> None:
        pods = {p.metadata.uid: p for p in self._pods()}
        pod = pods.get(self.pod_uid or "")
        restarts = sum(c.restart_count for c in (pod.status.container_statuses or [])
                       ) if pod is not None else None
        assert pod is not None and pod.status.phase == "Running" and restarts == 0, (
            f"the operator's pod {self.pod_uid} is gone or restarted ({restarts}):\n"
            + self.read_log()[-3000:])


@contextlib.contextmanager
def real_cluster(directory: Path, spot_nodes: int, *, kueue: bool = False,
                 nodes: Sequence[NodePlan] | None = None, **options: Any
                 ) -> Iterator[RealCluster]:
    """One on-demand node (the operator's: the chart keeps it off spot nodes) and
    `spot_nodes` spot ones (the trainers'), with the registry's images and the GCS
    emulator, for a module; `kueue`: Kueue's manager runs beside the control plane.
    `nodes`: that plan (`plan_nodes(1, spot_nodes)`) with changes of the module's, e.g. a
    kubelet's feature gates; `options`: more of `RealNodeCluster`'s (node lease and monitor
    timings)."""
    plan = list(nodes) if nodes is not None else plan_nodes(1, spot_nodes)
    with RealNodeCluster(directory, plan, kueue=kueue, **options) as real, LogShipper(
            real.pod_logs_dirs, directory / "logs", NAMESPACE) as shipper:
        yield RealCluster(real, shipper.directory)


@contextlib.contextmanager
def installed_operator(cluster: RealCluster, log_dir: Path, *values: str,
                       uninstall: bool = False) -> Iterator[InstalledOperator]:
    """The chart installed with `values` (helm arguments) over `FAST_OPERATOR_VALUES`, its
    pod Ready. `uninstall`: `helm uninstall` at the end, for a fixture that installs again
    into the same cluster (a module parametrized over the chart's values); without it the
    release stays until the module's cluster stops."""
    operator = InstalledOperator(cluster, log_dir / "operator.log", values)
    operator.start()
    try:
        yield operator
    finally:
        operator.stop()
        if uninstall:
            operator.uninstall()
