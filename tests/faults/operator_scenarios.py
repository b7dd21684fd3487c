"""Operator and control-plane faults on real nodes: scenarios, invariants, one runner.

Shared by `tests/faults/test_operator_faults.py` (one trial each) and
`bench/faults_operator.py` (the long run). The cluster is a `RealNodeCluster`: real kubelets
and containerd, one on-demand node for the operator the chart installs (its image from the
local registry) and three spot nodes for the trainers. Each trial runs a TrainingJob of
simulated trainers (`tardigrade_local.simtrainer`, no JAX, in a test image built FROM the
trainer CPU image: `Dockerfile.simtrainer`) through injected faults and checks, with zero
tolerance:
- converged: the job is Running with exactly its gang (one running pod per rank of the
  current attempt, no relaunch pending) before the deadline;
- duplicate pods: one pod name created twice (two uids), i.e. a rank of one attempt launched
  twice, or two pods claiming one (attempt, rank);
- orphans: pods of an older attempt Running while a newer attempt has Running pods (a
  gang never overlaps its successor), or still present, or with a container still running
  on a node (its containerd, `crictl ps`), after convergence;
- counter mismatches: status.attempt, replicas, restarts.* and the recovery causes against
  what the trial injected (every job runs with maxRestarts 0, so a disruption mistaken for a
  crash fails the job).

The faults, as GKE and a cluster have them: the operator's container SIGKILLed by its node's
runtime and its pod replaced by the Deployment; a spot reclaim (`RealNodeCluster.reclaim`: the
kubelet's graceful node shutdown, the Node deleted, the VM back under its name shortly after);
a VM deleted for good (`RealNodeCluster.lose`); kube-apiserver restarted; every connection
through the API proxy cut, the operator pod's included (`pods_api_through_proxy`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes
from kubernetes import watch
from tardigrade_local import imagebuild
from tardigrade_local.gke.nodes import NodeConfig
from tardigrade_local.realcluster import (
    CHECKPOINT_CLAIM,
    CHECKPOINT_MOUNT,
    SPOT_LABEL,
    RealNodeCluster,
    plan_nodes,
)

from tests.conftest import REPO_ROOT
from tests.e2e.harness import NAMESPACE, InstalledOperator, RealCluster
from tests.polling import wait_for

LABEL_JOB = "tardigrade.dev/job"
LABEL_ATTEMPT = "tardigrade.dev/attempt"
LABEL_RANK = "tardigrade.dev/rank"
SIM_COMMAND = ["python", "-m", "tardigrade_local.simtrainer"]
SIM_DOCKERFILE = Path(__file__).with_name("Dockerfile.simtrainer")
POOL_LABEL = "faults.tardigrade.dev/pool"
SPOT_NODES = 3
# Added to the chart's install (`harness.FAST_OPERATOR_VALUES` first): a capacity shrink
# happens within a trial; no grow-back probe meanwhile.
OPERATOR_VALUES = ("--set", "operator.unschedulableTimeoutSeconds=4",
                   "--set", "operator.growBackAfterSeconds=3600")
# A reclaimed VM's pool recreates it this long after its shutdown (as the node agents had it).
REPLACE_AFTER_SECONDS = 1.0
# A recreated or added VM: containerd and the kubelet start, it registers, and (a fresh disk)
# pulls the image for its first pod; on a loaded two-core machine.
NODE_READY_TIMEOUT = 120.0
CONVERGE_TIMEOUT = 120.0
# Old attempts' pods (objects and containers) must be gone this long after convergence.
LEFTOVER_TIMEOUT = 30.0
# After convergence the counters must stay put this long (a late double count shows here).
HOLD_SECONDS = 2.0
GRACE_SECONDS = 5
TERMINAL = ("Succeeded", "Failed")


# ------------------------------------------------------------------------------ results ---


@dataclasses.dataclass(frozen=True)
class Expected:
    attempt: int
    replicas: int
    causes: tuple[str, ...] = ()  # recoveries' causes, oldest first

    def counters(self) -> dict[str, int]:
        counts = {key: 0 for key in ("preemptions", "failures", "resizes", "retries",
                                     "rejections")}
        for cause in self.causes:
            key = {"Preemption": "preemptions", "Failure": "failures", "Resize": "resizes",
                   "Retry": "retries", "NodeRejected": "rejections"}.get(cause)
            if key:
                counts[key] += 1
        counts["total"] = sum(counts.values())
        return counts


@dataclasses.dataclass
class TrialResult:
    scenario: str
    converged: bool
    duplicates: int
    orphans: int
    mismatches: list[str]
    seconds: float  # from the (first) disruption to convergence
    note: str = ""
    # A pace the trial meant to keep and did not (the storm's window): a speed figure, which
    # the bench judges (bench/faults_operator.py); `ok` is the bookkeeping alone.
    pace_missed: str = ""

    @property
    def ok(self) -> bool:
        return self.converged and not self.duplicates and not self.orphans \
            and not self.mismatches

    def describe(self) -> str:
        pace = f" pace missed: {self.pace_missed}" if self.pace_missed else ""
        return (f"{self.scenario}: converged={self.converged} duplicates={self.duplicates} "
                f"orphans={self.orphans} mismatches={self.mismatches} "
                f"seconds={self.seconds:.1f} {self.note}{pace}")


def counter_mismatches(status: dict[str, Any], expected: Expected) -> list[str]:
    restarts = status.get("restarts") or {}
    recoveries = status.get("recoveries") or []
    found = []
    for key, want in expected.counters().items():
        if restarts.get(key, 0) != want:
            found.append(f"restarts.{key}={restarts.get(key, 0)} (want {want})")
    for key, want in (("attempt", expected.attempt), ("replicas", expected.replicas)):
        if status.get(key) != want:
            found.append(f"{key}={status.get(key)} (want {want})")
    causes = tuple(r["cause"] for r in recoveries)
    if causes != expected.causes:
        found.append(f"recovery causes {list(causes)} (want {list(expected.causes)}): "
                     + "; ".join(f"{r['cause']} {r.get('reason', '')}" for r in recoveries))
    attempts = [r["attempt"] for r in recoveries]
    if attempts != list(range(2, len(attempts) + 2)):
        found.append(f"recovery attempts {attempts} are not 2, 3, ...")
    return found


# ------------------------------------------------------------------------- pod monitor ---


def attempt_and_rank(pod: str) -> tuple[int, int]:
    """The attempt and rank in a trainer pod's name (`naming.pod_name`:
    `<job>-a<attempt>-<rank>`)."""
    _, attempt, rank = pod.rsplit("-", 2)
    return int(attempt[1:]), int(rank)


@dataclasses.dataclass(frozen=True)
class PodState:
    job: str
    attempt: int
    rank: int
    uid: str
    phase: str
    node: str | None

    @property
    def active(self) -> bool:
        return self.phase not in TERMINAL


class PodMonitor:
    """Follows every trainer pod by list + watch (relisting after a cut or a 410) and records
    invariant violations the moment they happen, not only at the end of a trial."""

    def __init__(self, core: kubernetes.client.CoreV1Api) -> None:
        self.core = core
        self._lock = threading.Lock()
        self._pods: dict[str, PodState] = {}
        self._uids: dict[str, set[str]] = defaultdict(set)
        self._created: dict[str, list[str]] = defaultdict(list)  # job -> pod names, in order
        self._bound: dict[str, str] = {}  # pod name -> the node it was bound to, deleted or not
        self._overlaps: dict[str, set[tuple[int, ...]]] = defaultdict(set)
        # The active pods when each overlap was first seen, for the trial's note.
        self._overlap_pods: dict[str, list[str]] = defaultdict(list)
        self._synced = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pod-monitor", daemon=True)

    def start(self) -> PodMonitor:
        self._thread.start()
        if not self._synced.wait(30):
            raise TimeoutError("the pod monitor could not list pods")
        return self

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                listing = self.core.list_namespaced_pod(NAMESPACE, label_selector=LABEL_JOB)
                self._sync(listing.items)
                stream = watch.Watch().stream(
                    self.core.list_namespaced_pod, NAMESPACE, label_selector=LABEL_JOB,
                    resource_version=listing.metadata.resource_version, timeout_seconds=20)
                for event in stream:
                    if self._stopped.is_set():
                        return
                    self._apply(event["type"], event["object"])
            except Exception:  # cut, 410 Gone, server restarting: relist
                self._stopped.wait(0.1)

    def _sync(self, pods: list[Any]) -> None:
        with self._lock:
            listed = {p.metadata.name for p in pods}
            for name in [n for n in self._pods if n not in listed]:
                del self._pods[name]
        for pod in pods:
            self._apply("ADDED", pod)
        self._synced.set()

    def _apply(self, kind: str, pod: Any) -> None:
        meta = pod.metadata
        labels = meta.labels or {}
        if LABEL_JOB not in labels:
            return
        state = PodState(job=labels[LABEL_JOB], attempt=int(labels.get(LABEL_ATTEMPT, -1)),
                         rank=int(labels.get(LABEL_RANK, -1)), uid=meta.uid,
                         phase=(pod.status.phase if pod.status else None) or "Pending",
                         node=pod.spec.node_name if pod.spec else None)
        with self._lock:
            if kind == "DELETED":
                self._pods.pop(meta.name, None)
                return
            if meta.uid not in self._uids[meta.name]:
                self._uids[meta.name].add(meta.uid)
                self._created[state.job].append(meta.name)
            if state.node:
                self._bound[meta.name] = state.node
            self._pods[meta.name] = state
            # Running, not merely non-terminal: on real nodes a pod bound to a VM that went
            # before its kubelet ran it stays Pending until pod GC deletes it, never running;
            # should the VM recreated under that name run it, it turns Running here. Older
            # pods left after convergence, Pending or not, are `_leftovers`.
            running = tuple(sorted({p.attempt for p in self._pods.values()
                                    if p.job == state.job and p.phase == "Running"}))
            if len(running) > 1 and running not in self._overlaps[state.job]:
                self._overlaps[state.job].add(running)
                self._overlap_pods[state.job].append(", ".join(
                    f"{n} {p.phase} on {p.node}" for n, p in sorted(self._pods.items())
                    if p.job == state.job and p.active))

    # --- questions -----------------------------------------------------------------------
    def created(self, job: str, attempt: int | None = None) -> list[str]:
        with self._lock:
            names = list(self._created[job])
        if attempt is None:
            return names
        return [n for n in names if attempt_and_rank(n)[0] == attempt]

    def bound_to(self, pod: str) -> str | None:
        """The node pod `pod` was bound to, even once deleted."""
        with self._lock:
            return self._bound.get(pod)

    def pods(self, job: str) -> list[tuple[str, PodState]]:
        with self._lock:
            return [(n, p) for n, p in self._pods.items() if p.job == job]

    def duplicates(self, job: str) -> int:
        with self._lock:
            twice = sum(len(self._uids[n]) - 1 for n in set(self._created[job]))
            claims: dict[tuple[int, int], set[str]] = defaultdict(set)
            for name in set(self._created[job]):
                claims[attempt_and_rank(name)].add(name)
        return twice + sum(len(names) - 1 for names in claims.values())

    def overlaps(self, job: str) -> list[tuple[int, ...]]:
        with self._lock:
            return sorted(self._overlaps[job])

    def overlap_pods(self, job: str) -> list[str]:
        with self._lock:
            return list(self._overlap_pods[job])


# ----------------------------------------------------------------------------- the bed ---


def sim_job(name: str, replicas: int, image: str, node_selector: dict[str, str] | None = None,
            **spec: Any) -> dict[str, Any]:
    """A TrainingJob of simulated trainers that trains until deleted, checkpointing to the
    cluster's shared claim, on spot nodes (or `node_selector`'s)."""
    body: dict[str, Any] = {
        "replicas": replicas, "maxReplicas": 4,
        "image": image, "command": SIM_COMMAND,
        "trainer": {"steps": 10_000_000, "step_seconds": 0.05},
        "checkpoint": {"path": f"{CHECKPOINT_MOUNT}/{name}", "interval": {"steps": 20}},
        # No restart budget: a disruption counted as a crash fails the job at once.
        "failurePolicy": {"maxRestarts": 0, "backoffSeconds": 0},
        "podTemplate": {
            "terminationGracePeriodSeconds": GRACE_SECONDS,
            "nodeSelector": node_selector or {SPOT_LABEL: "true"},
            "volumes": [{"name": "shared",
                         "persistentVolumeClaim": {"claimName": CHECKPOINT_CLAIM}}],
            "volumeMounts": [{"name": "shared", "mountPath": CHECKPOINT_MOUNT}]},
    }
    body.update(spec)
    return {"apiVersion": "tardigrade.dev/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": name, "namespace": NAMESPACE}, "spec": body}


def simtrainer_image(real: RealNodeCluster) -> str:
    """The simulated trainer's test image (`Dockerfile.simtrainer` on the trainer CPU image
    the cluster pushed), built unless its inputs are unchanged, pushed to the cluster's
    registry; returns its reference there."""
    built = imagebuild.build_derived("simtrainer", SIM_DOCKERFILE,
                                     imagebuild.build("trainer-cpu"), root=REPO_ROOT)
    return imagebuild.push_derived(built, real.registry.host)


class FaultBed:
    """A real-node cluster (the operator's on-demand node, `nodes` spot nodes), the chart's
    operator, and a pod monitor."""

    def __init__(self, root: Path, seed: int, nodes: int = SPOT_NODES) -> None:
        self.root = root
        self.rng = random.Random(seed)
        self.nodes = nodes
        self.real = RealNodeCluster(root / "real", plan_nodes(1, nodes), gcs=False,
                                    pods_api_through_proxy=True)
        self.image = ""
        self.cluster: RealCluster
        self.operator: InstalledOperator
        self.monitor: PodMonitor
        # Reclaims under way, each on a thread of its own (a reclaim returns once the VM is
        # gone; the fault's moment is its start), and what went wrong in any.
        self._reclaims: list[threading.Thread] = []
        self._reclaim_errors: list[BaseException] = []
        # The nodes whose VM is going (a reclaim under way): GKE reclaims a VM once.
        self.going: set[str] = set()

    def __enter__(self) -> FaultBed:
        self.real.start()
        try:
            self.image = simtrainer_image(self.real)
            # No log shipper: the trials read no trainer log.
            self.cluster = RealCluster(self.real, self.root / "logs")
            self.operator = InstalledOperator(self.cluster, self.root / "operator.log",
                                              OPERATOR_VALUES)
            self.operator.start()
            self.monitor = PodMonitor(self.cluster.core).start()
        except BaseException:
            self.real.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.monitor.stop()
        self.operator.stop()
        for thread in self._reclaims:
            thread.join(NODE_READY_TIMEOUT)
        self.real.stop()

    def sim_job(self, name: str, replicas: int, **spec: Any) -> dict[str, Any]:
        return sim_job(name, replicas, self.image, **spec)

    # --- acting --------------------------------------------------------------------------
    def apply(self, job: dict[str, Any]) -> None:
        self.cluster.custom.create_namespaced_custom_object(
            "tardigrade.dev", "v1alpha1", NAMESPACE, "trainingjobs", job)

    def scale(self, name: str, replicas: int) -> None:
        self.cluster.custom.patch_namespaced_custom_object(
            "tardigrade.dev", "v1alpha1", NAMESPACE, "trainingjobs", name,
            {"spec": {"replicas": replicas}})

    def restart_operator(self) -> None:
        """SIGKILL to the operator's container (its node's runtime: no cleanup, no last
        status write), its pod deleted at once so that the Deployment replaces it (the
        kubelet's restart in place would add its crash-loop back-off to every later kill);
        returns once the new pod is Ready."""
        for pod in self.operator._pods():
            node = self.real.nodes[pod.spec.node_name]
            for container in node.crictl("ps", "--quiet", "--label",
                                         f"io.kubernetes.pod.uid={pod.metadata.uid}").split():
                node.crictl("stop", "--timeout", "0", container)
        self.operator.kill()
        self.operator.start()

    def reclaim(self, node: str) -> None:
        """A spot reclaim of `node`, its VM back `REPLACE_AFTER_SECONDS` after it went; runs
        on while the trial goes on (`settle_reclaims` waits for it)."""
        def run() -> None:
            try:
                self.real.reclaim(node, replace_after_seconds=REPLACE_AFTER_SECONDS)
            except BaseException as err:  # raised by settle_reclaims
                self._reclaim_errors.append(err)
            finally:
                self.going.discard(node)

        self.going.add(node)
        thread = threading.Thread(target=run, name=f"reclaim-{node}", daemon=True)
        thread.start()
        self._reclaims.append(thread)

    def settle_reclaims(self) -> None:
        """Wait for the reclaims under way to be over; TrialFailed if one went wrong."""
        for thread in self._reclaims:
            thread.join(NODE_READY_TIMEOUT)
        self._reclaims = [t for t in self._reclaims if t.is_alive()]
        if self._reclaim_errors:
            error, self._reclaim_errors = self._reclaim_errors[0], []
            raise TrialFailed(f"a reclaim failed: {error}")

    def reclaimable(self, node: str) -> bool:
        """Whether `node`'s VM runs, started, and is not going already. A rank's pod may name a
        VM that went, or its successor under the same name while it boots (the kubelet of the
        new VM runs the pods bound to its name): a reclaim then would hit a VM that never ran
        the rank, and a reclaim of a booting VM fails its start."""
        return (node in self.real.nodes and node not in self.real.recreating
                and node not in self.going)

    def add_node(self, name: str, labels: dict[str, str], capacity: dict[str, str]) -> None:
        """A VM of a pool of its own boots and its kubelet registers."""
        asyncio.run(self.real.add_node(NodeConfig(name, labels=labels, capacity=capacity)))

    def node_of(self, name: str, rank: int | None = None) -> str:
        """The node of a running rank of the job's current attempt (a random one)."""
        def found() -> str | None:
            attempt = self.cluster.status(name).get("attempt")
            nodes = [p.node for _, p in self.monitor.pods(name)
                     if p.attempt == attempt and p.node and p.active
                     and (rank is None or p.rank == rank) and self.reclaimable(p.node)]
            return self.rng.choice(nodes) if nodes else None
        return wait_for(found, 60, f"a bound pod of {name}")

    def wait_nodes(self, count: int) -> None:
        """`count` spot nodes Ready, once every reclaim under way is over."""
        self.settle_reclaims()

        def ready() -> bool:
            nodes = self.cluster.core.list_node().items
            up = [n for n in nodes if (n.metadata.labels or {}).get(SPOT_LABEL) == "true"
                  and any(c.type == "Ready" and c.status == "True"
                          for c in n.status.conditions or [])]
            return len(up) >= count
        wait_for(ready, NODE_READY_TIMEOUT, f"{count} ready spot nodes")

    def kill_operator_when(self, moment: Callable[[], bool], what: str) -> None:
        wait_for(moment, 60, what, interval=0.005)
        self.restart_operator()

    # --- judging -------------------------------------------------------------------------
    def converged(self, name: str) -> dict[str, Any] | None:
        """The status once the job runs exactly its gang and nothing is pending."""
        job = self.cluster.job(name) or {}
        status = job.get("status") or {}
        if status.get("observedGeneration") != job.get("metadata", {}).get("generation"):
            return None  # the operator has not seen the newest spec yet
        if status.get("phase") == "Failed":
            raise TrialFailed(f"{name} failed: {status.get('message')}")
        if status.get("phase") != "Running":
            return None
        attempt, replicas = status.get("attempt"), status.get("replicas")
        recoveries = status.get("recoveries") or []
        if recoveries and recoveries[-1]["attempt"] > attempt:
            return None
        pods = self.cluster.pods(name)
        current = [p for p in pods if p.metadata.labels[LABEL_ATTEMPT] == str(attempt)]
        ranks = sorted(int(p.metadata.labels[LABEL_RANK]) for p in current)
        if ranks != list(range(replicas or 0)):
            return None
        if any(p.status.phase != "Running" or p.metadata.deletion_timestamp for p in current):
            return None
        return status

    def judge(self, scenario: str, name: str, expected: Expected, started: float,
              note: str = "", checks: Callable[[dict[str, Any]], list[str]] | None = None,
              explained: Callable[[dict[str, Any]], Expected] | None = None
              ) -> TrialResult:
        """Wait for convergence, then check every invariant; always deletes the job.
        `explained`: the expectation once converged, from `expected` (the least the faults
        call for) and what the status shows the faults caused besides."""
        def settled() -> dict[str, Any] | None:
            # At least the relaunches the faults call for must have happened: a gang that
            # looks fine only because nobody reacted yet is not converged. More than that is
            # a mismatch, found below.
            status = self.converged(name)
            return status if status and status["attempt"] >= expected.attempt else None

        try:
            status = wait_for(settled, CONVERGE_TIMEOUT, f"{name} to converge")
            seconds = time.monotonic() - started
        except (AssertionError, TrialFailed) as err:
            result = TrialResult(scenario, False, self.monitor.duplicates(name),
                                 len(self.monitor.overlaps(name)),
                                 counter_mismatches(self.cluster.status(name), expected),
                                 time.monotonic() - started, f"{note} {err}".strip())
            self.delete(name)
            return result
        if explained is not None:
            expected = explained(status)
        mismatches = counter_mismatches(status, expected)
        held = self._hold(name, status)
        if held:
            mismatches.append(held)
        if checks is not None:
            mismatches += checks(status)
        leftovers = self._leftovers(name, status["attempt"])
        orphans = len(self.monitor.overlaps(name)) + len(leftovers)
        if leftovers:
            note = f"{note} left: {'; '.join(leftovers)}".strip()
        if self.monitor.overlaps(name):
            note = f"{note} overlaps: {' | '.join(self.monitor.overlap_pods(name))}".strip()
        result = TrialResult(scenario, True, self.monitor.duplicates(name), orphans, mismatches,
                             seconds, note)
        self.delete(name)
        return result

    def _hold(self, name: str, status: dict[str, Any]) -> str:
        deadline = time.monotonic() + HOLD_SECONDS
        keys = ("attempt", "replicas", "restarts")
        while time.monotonic() < deadline:
            now = self.cluster.status(name)
            if any(now.get(k) != status.get(k) for k in keys):
                return (f"changed after convergence: {[status.get(k) for k in keys]} -> "
                        f"{[now.get(k) for k in keys]}")
            time.sleep(0.2)
        return ""

    def _leftovers(self, name: str, attempt: int) -> list[str]:
        """Old-attempt pods (objects, or containers running on a node) still there once the
        gang converged, each described."""
        current = f"{name}-a{attempt}-"

        def objects() -> list[str]:
            return [f"pod {p.metadata.name} {p.status.phase} on {p.spec.node_name}"
                    f"{' deleting' if p.metadata.deletion_timestamp else ''}"
                    for p in self.cluster.pods(name)
                    if not p.metadata.name.startswith(current)]

        def containers() -> list[str]:
            return [f"container of {pod}" for pod in self.running_containers()
                    if pod.startswith(f"{name}-a") and not pod.startswith(current)]

        started = time.monotonic()
        seen = objects() + containers()
        try:
            wait_for(lambda: not objects() and not containers(), LEFTOVER_TIMEOUT,
                     "old attempts to go")
        except AssertionError:
            return objects() + containers()
        if seen:  # shown with the test's output (-rA), and by the bench
            print(f"{name}: old attempts gone {time.monotonic() - started:.0f} s after "
                  f"convergence: {'; '.join(seen)}", flush=True)
        return []

    def running_containers(self) -> list[str]:
        """The pod of every container running on a node of the cluster, as its containerd
        lists them (a node that went meanwhile has none left)."""
        pods = []
        for node in list(self.real.nodes.values()):
            try:
                listed = json.loads(node.crictl("ps", "--output", "json"))["containers"]
            except Exception:  # the node went while we asked: nothing of it runs any more
                continue
            pods += [c["labels"].get("io.kubernetes.pod.name", "") for c in listed
                     if c["labels"].get("io.kubernetes.pod.namespace") == NAMESPACE]
        return pods

    def delete(self, name: str) -> None:
        self.cluster.custom.delete_namespaced_custom_object(
            "tardigrade.dev", "v1alpha1", NAMESPACE, "trainingjobs", name)
        wait_for(lambda: not self.cluster.pods(name) and self.cluster.job(name) is None, 60,
                 f"{name} and its pods to go")


    def forget_jobs(self) -> None:
        """After a trial broke off: delete whatever it left, so the next starts clean."""
        jobs = self.cluster.custom.list_namespaced_custom_object(
            "tardigrade.dev", "v1alpha1", NAMESPACE, "trainingjobs")["items"]
        for job in jobs:
            self.delete(job["metadata"]["name"])
        self.wait_nodes(self.nodes)


class TrialFailed(Exception):
    pass


# --------------------------------------------------------------------------- scenarios ---


def _start(bed: FaultBed, name: str, replicas: int, **spec: Any) -> None:
    bed.apply(bed.sim_job(name, replicas, **spec))
    wait_for(lambda: bed.converged(name), CONVERGE_TIMEOUT, f"{name} to start")


def _kill_moment(bed: FaultBed, name: str, attempt: int, window: float, replicas: int = 2
                 ) -> tuple[Callable[[], bool], str]:
    """A random moment: after a random delay, or right after the k-th pod of the attempt
    is created (the operator may be half-way through creating the gang)."""
    rng = bed.rng
    if rng.random() < 0.5:
        delay = rng.uniform(0, window)
        deadline = time.monotonic() + delay
        return (lambda: time.monotonic() >= deadline), f"kill after {delay:.2f}s"
    k = rng.randint(1, min(2, replicas))
    return (lambda: len(bed.monitor.created(name, attempt)) >= k,
            f"kill after pod {k} of attempt {attempt}")


def kill_during_launch(bed: FaultBed, index: int) -> TrialResult:
    name = f"launch-{index}"
    replicas = bed.rng.choice([2, 3])
    moment, how = _kill_moment(bed, name, 1, window=3.0)
    started = time.monotonic()
    bed.apply(bed.sim_job(name, replicas))
    bed.kill_operator_when(moment, how)
    return bed.judge("operator SIGKILL during launch", name, Expected(1, replicas), started,
                     how)


def kill_during_recovery(bed: FaultBed, index: int) -> TrialResult:
    name = f"recover-{index}"
    _start(bed, name, 2)
    node = bed.node_of(name)
    moment, how = _kill_moment(bed, name, 2, window=4.0)
    started = time.monotonic()
    bed.reclaim(node)
    bed.kill_operator_when(moment, how)
    result = bed.judge("operator SIGKILL during recovery", name,
                       Expected(2, 2, ("Preemption",)), started, how)
    bed.wait_nodes(bed.nodes)
    return result


def kill_during_resize(bed: FaultBed, index: int) -> TrialResult:
    name = f"resize-{index}"
    _start(bed, name, 2)
    target = bed.rng.choice([1, 3])
    moment, how = _kill_moment(bed, name, 2, window=3.0, replicas=target)
    started = time.monotonic()
    bed.scale(name, target)
    bed.kill_operator_when(moment, how)
    return bed.judge("operator SIGKILL during resize", name, Expected(2, target, ("Resize",)),
                     started, f"2->{target}, {how}")


def _control_plane_fault(bed: FaultBed, index: int, fault: str) -> TrialResult:
    """A preemption, the control-plane fault at a random moment of its recovery, then a
    scale: the operator must still see spec changes (its watches came back)."""
    rng = bed.rng
    name = f"{fault}-{index}"
    _start(bed, name, 2)
    node = bed.node_of(name)
    started = time.monotonic()
    bed.reclaim(node)
    if rng.random() < 0.5:
        time.sleep(rng.uniform(0, 2.0))  # the random moment of the fault, not a wait
    else:
        # The moment the operator is writing the preemption into the status.
        wait_for(lambda: any(p.attempt == 1 and not p.active for _, p in bed.monitor.pods(name)),
                 60, "a rank of the preempted gang to stop", interval=0.005)
    if fault == "apiserver-restart":
        downtime = rng.uniform(0, 3.0)
        bed.real.cluster.restart_apiserver(downtime)
        how = f"API server down {downtime:.1f}s"
    else:
        cuts = rng.randint(2, 4)
        for _ in range(cuts):
            bed.real.cluster.cut_watches(expire_history=rng.random() < 0.5)
            time.sleep(rng.uniform(0, 1.0))
        how = f"{cuts} watch cuts"
    first = wait_for(lambda: bed.converged(name), CONVERGE_TIMEOUT, f"{name} to recover")
    seconds = time.monotonic() - started
    if first["attempt"] != 2:
        bed.delete(name)
        return TrialResult(f"{fault} mid-recovery", True, 0, 0,
                           counter_mismatches(first, Expected(2, 2, ("Preemption",))), seconds)
    bed.wait_nodes(bed.nodes)
    bed.scale(name, 3)
    result = bed.judge(f"{fault} mid-recovery", name,
                       Expected(3, 3, ("Preemption", "Resize")), time.monotonic(), how)
    result.seconds = seconds
    return result


def apiserver_restart(bed: FaultBed, index: int) -> TrialResult:
    return _control_plane_fault(bed, index, "apiserver-restart")


def watch_cuts(bed: FaultBed, index: int) -> TrialResult:
    return _control_plane_fault(bed, index, "watch-cut")


STORM_PREEMPTIONS = 10
STORM_WINDOW_SECONDS = 60.0


def preemption_storm(bed: FaultBed, index: int, preemptions: int = STORM_PREEMPTIONS
                     ) -> TrialResult:
    """Preemptions back to back: each one hits the newest gang as soon as it has a pod on a
    node, before it has even started training."""
    name = f"storm-{index}"
    _start(bed, name, 2)
    started = time.monotonic()
    hits: list[tuple[str, int]] = []  # (node reclaimed, attempt of the gang it hit)
    for hit in range(preemptions):
        def current_gang_placed() -> tuple[str, int] | None:
            status = bed.cluster.status(name)
            attempt = status.get("attempt")
            recoveries = status.get("recoveries") or []
            if not isinstance(attempt, int) or (
                    recoveries and recoveries[-1]["attempt"] > attempt):
                return None
            nodes = [p.node for _, p in bed.monitor.pods(name)
                     if p.attempt == attempt and p.node and p.active
                     and bed.reclaimable(p.node)]
            return (bed.rng.choice(nodes), attempt) if nodes else None

        node, attempt = wait_for(current_gang_placed, 60, f"hit {hit + 1}: a gang placed")
        bed.reclaim(node)
        hits.append((node, attempt))
        # Next hit only once the gang hit is being replaced (the judge checks why).
        wait_for(lambda attempt=attempt: _replaced(bed, name, attempt), 60,
                 f"hit {hit + 1}: attempt {attempt} replaced")
    storm = time.monotonic() - started
    note = f"{preemptions} preemptions in {storm:.0f}s"
    least = Expected(preemptions + 1, 2, ("Preemption",) * preemptions)
    result = bed.judge("preemption storm", name, least, started, note,
                       explained=lambda status: storm_expected(status, hits, bed.monitor.bound_to))
    if storm > STORM_WINDOW_SECONDS:
        # Each hit waits for the gang to be placed and for its replacement to begin, so the
        # storm's pace is the cluster's and the operator's speed, not their bookkeeping.
        result.pace_missed = f"storm took {storm:.0f}s > {STORM_WINDOW_SECONDS:.0f}s"
    bed.wait_nodes(bed.nodes)
    return result


def _replaced(bed: FaultBed, name: str, attempt: int) -> bool:
    status = bed.cluster.status(name)
    return status.get("phase") == "Failed" or any(
        r["attempt"] > attempt for r in status.get("recoveries") or [])


def storm_expected(status: dict[str, Any], hits: list[tuple[str, int]],
                   bound_to: Callable[[str], str | None]) -> Expected:
    """What a storm's `hits` call for: one preemption for each gang hit. Besides, a rank of a
    later gang may be placed on a VM a hit is already shutting down (its Node not NotReady
    yet) and refused by its kubelet (`NodeShutdown`), as on GKE: that ends its gang too, as
    whatever the operator calls it. Any other recovery is unexplained, and a gang hit without
    a recovery is a preemption missed: both mismatches. `bound_to`: a pod's node, deleted pods'
    too (`PodMonitor.bound_to`)."""
    # The attempt a refusal above ended -> its recovery's cause.
    shut_down_by_hit: dict[int, str] = {}
    for recovery in status.get("recoveries") or []:
        pod, _, why = str(recovery.get("reason", "")).partition(": ")
        node = bound_to(pod)
        if not why.startswith("NodeShutdown") or node is None:
            continue
        attempt = attempt_and_rank(pod)[0]
        if any(hit_node == node and hit_attempt < attempt for hit_node, hit_attempt in hits):
            shut_down_by_hit[recovery["attempt"] - 1] = recovery["cause"]
    ended = {attempt: "Preemption" for _, attempt in hits} | shut_down_by_hit
    causes = tuple(ended[attempt] for attempt in sorted(ended))
    return Expected(len(causes) + 1, 2, causes)


def node_lost_for_good(bed: FaultBed, index: int) -> TrialResult:
    """Three one-pod nodes, a 3-rank gang (minReplicas 2); one node vanishes for good: the
    gang is relaunched, cannot fit, and shrinks to the 2 nodes left, saying why."""
    name = f"lost-{index}"
    pool = f"pool{index}"
    nodes = [f"{pool}-{i}" for i in range(3)]
    for node in nodes:
        bed.add_node(node, labels={POOL_LABEL: pool}, capacity={"pods": "1"})
    _start(bed, name, 3, minReplicas=2, node_selector={POOL_LABEL: pool})
    victim = bed.node_of(name)
    started = time.monotonic()
    bed.real.lose(victim)

    def explained(status: dict[str, Any]) -> list[str]:
        problems = []
        limited = next((c for c in status.get("conditions") or []
                        if c["type"] == "CapacityLimited"), None)
        if not limited or limited["status"] != "True" or "unschedulable" not in \
                limited.get("message", ""):
            problems.append(f"CapacityLimited condition: {limited}")
        events = bed.cluster.core.list_namespaced_event(
            NAMESPACE, field_selector=f"involvedObject.name={name}").items
        reasons = {e.reason for e in events}
        if not {"Preemption", "Resize"} <= reasons:
            problems.append(f"events {sorted(reasons)} lack Preemption/Resize")
        return problems

    result = bed.judge("node lost for good", name, Expected(3, 2, ("Preemption", "Resize")),
                       started, f"lost {victim}", checks=explained)
    for node in nodes:
        if node != victim:
            bed.real.lose(node)
    return result


SCENARIOS: dict[str, Callable[[FaultBed, int], TrialResult]] = {
    "operator SIGKILL during launch": kill_during_launch,
    "operator SIGKILL during recovery": kill_during_recovery,
    "operator SIGKILL during resize": kill_during_resize,
    "API server restart mid-recovery": apiserver_restart,
    "watch connections cut mid-recovery": watch_cuts,
    "preemption storm (10 in <60s)": preemption_storm,
    "node lost for good (shrink 3->2)": node_lost_for_good,
}
