"""Drive the local cluster, the real operator and real trainer processes from tests."""

from __future__ import annotations

import contextlib
import copy
import os
import subprocess
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import kubernetes
import yaml
from kubernetes.client.exceptions import ApiException
from tardigrade_local import imagevenv
from tardigrade_local.cluster import LocalCluster
from tardigrade_local.kubelet.config import PODSITE_DIR
from tardigrade_local.steplog import StepLog
from tardigrade_operator.apidecode import BoundedApiClient

from tests.conftest import EXAMPLES, REPO_ROOT
from tests.polling import wait_for

T = TypeVar("T")
NAMESPACE = "default"


def operator_venv() -> imagevenv.ImageVenv:
    """The operator image's virtualenv, built or refreshed from the current sources."""
    return imagevenv.shipped_image("operator")


class OperatorProcess:
    """The operator as its image runs it (`tardigrade operator run` from the operator image's
    virtualenv, without the checkout on PYTHONPATH), in a subprocess we can kill."""

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
            # Only the pod network's site directory, as in an operator pod (`operator_command`).
            "PYTHONPATH": str(PODSITE_DIR),
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
            [str(operator_venv().bin_dir / "tardigrade"), "operator", "run",
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
        wait_for(lambda: not self.core.list_namespaced_pod(
            NAMESPACE, label_selector="tardigrade.dev/job").items, 120, "leftover pods to go")

    def step_log(self, job: str) -> StepLog:
        return StepLog(self.core, NAMESPACE, job)

    def complete_log(self, job: str) -> StepLog:
        """Rank 0's log of every attempt so far, from the kubelets' files: with the last lines
        of pods already deleted, which a `step_log` polling the API may have missed."""
        return StepLog.from_container_logs(self.local.layout, NAMESPACE, job)

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
