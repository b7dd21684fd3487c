"""End to end on real nodes: the operator installed by helm from the registry's image, real
multi-process JAX trainers in containers of the trainer-cpu image on real kubelets (spot
nodes), checkpointing to the GCS emulator through its Service; spot reclaims through the
kubelet's graceful node shutdown, the node pool recreating the reclaimed VM."""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator

import pytest
from tardigrade_local.steplog import StepLog
from tardigrade_operator import naming

from tests.e2e.harness import (
    NEEDS_REAL_NODES,
    InstalledOperator,
    RealCluster,
    assert_goodput_adds_up,
    real_cluster,
    wait_for,
)

pytestmark = [
    pytest.mark.slow,
    NEEDS_REAL_NODES,
]

# The trainers' nodes: a gang of 3 at most.
SPOT_NODES = 3
# GKE documents no delay for a node pool recreating a reclaimed VM: long enough here that the
# relaunch lands on the nodes left, short enough that the next test has its 3 nodes.
REPLACE_AFTER_SECONDS = 20.0
NODE_BACK_SECONDS = 300.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    # Short: the kubelet's socket paths live under each node's directory.
    with real_cluster(tmp_path_factory.mktemp("op"), SPOT_NODES) as running:
        yield running


def _reclaim(cluster: RealCluster, node: str) -> threading.Thread:
    """A spot reclaim of `node` in the background (it returns once the VM is off); the pool
    recreates it REPLACE_AFTER_SECONDS later."""
    thread = threading.Thread(target=cluster.real.reclaim, args=(node, REPLACE_AFTER_SECONDS),
                              daemon=True)
    thread.start()
    return thread


def _wait_back(cluster: RealCluster, node: str, reclaim: threading.Thread) -> None:
    """The reclaimed node is back and Ready (the next test needs every node)."""
    reclaim.join(NODE_BACK_SECONDS)

    def ready() -> bool:
        try:
            found = cluster.core.read_node(node)
        except Exception:  # not registered yet
            return False
        return any(c.type == "Ready" and c.status == "True"
                   for c in found.status.conditions or [])
    wait_for(ready, NODE_BACK_SECONDS, f"{node} recreated and Ready")


@pytest.fixture(autouse=True)
def _one_job_at_a_time(cluster: RealCluster) -> Iterator[None]:
    yield
    cluster.clear_jobs()


def _checkpoint_objects(cluster: RealCluster, job: str) -> list[str]:
    url = f"{cluster.real.gcs_url}/storage/v1/b/tardigrade/o?prefix=checkpoints/{job}/"
    with urllib.request.urlopen(url, timeout=10) as response:
        return [item["name"] for item in json.load(response).get("items", [])]


def _assert_continuous(log: StepLog, steps: int) -> None:
    missing = [s for s in range(1, steps + 1) if s not in log.losses]
    assert not missing, f"no loss logged for steps {missing[:10]}"
    for step, losses in log.losses.items():
        # A step trained twice (after a restore) must give the same loss: same data, same state.
        assert max(losses) - min(losses) <= 1e-5 * max(1.0, abs(losses[0])), (step, losses)


def test_apply_runs_to_success_with_truthful_status(cluster: RealCluster,
                                                    operator: InstalledOperator):
    job = cluster.trainingjob("e2e-success", steps=24)
    job["spec"]["checkpoint"]["interval"] = {"steps": 10}
    cluster.apply(job)
    log = cluster.step_log("e2e-success")
    # As CI scripts wait for a job: Ready once the gang trains (or has already finished), and
    # by then the operator is no longer reconciling (Flux's kstatus reads that as current).
    cluster.kubectl("wait", "--for=condition=Ready", "tj/e2e-success", "--timeout=240s")
    summary = {c["type"]: c["status"] for c in cluster.status("e2e-success")["conditions"]}
    assert (summary["Reconciling"], summary["Stalled"]) == ("False", "False")
    status = cluster.wait_phase("e2e-success", {"Succeeded"}, timeout=300, collector=log)
    operator.assert_alive()
    assert status["step"] == 24
    assert status["lastCheckpoint"]["step"] == 24
    assert status["restarts"]["total"] == 0
    assert status["attempt"] == 1
    assert {c["type"]: c["status"] for c in status["conditions"]}["Succeeded"] == "True"
    table = cluster.kubectl("get", "tj", "e2e-success")
    header, row = table.strip().splitlines()
    assert header.split()[:6] == ["NAME", "REPLICAS", "PHASE", "STEP", "CHECKPOINT", "RESTARTS"]
    assert row.split()[:6] == ["e2e-success", "2", "Succeeded", "24", "24", "0"]
    cluster.kubectl("wait", "--for=condition=Succeeded", "tj/e2e-success", "--timeout=10s")
    _assert_continuous(log, 24)
    # The ranks met behind the job's NetworkPolicy, each proving itself with its pod's token.
    policy = json.loads(cluster.kubectl("get", "networkpolicy", "e2e-success-gang", "-o", "json"))
    assert policy["spec"]["podSelector"]["matchLabels"]["tardigrade.dev/job"] == "e2e-success"


def test_preempted_node_relaunches_from_the_coordinated_save(cluster: RealCluster,
                                                            operator: InstalledOperator):
    name = "e2e-preempt"
    job = cluster.trainingjob(name, steps=60)
    job["spec"]["checkpoint"]["interval"] = {"steps": 1000}  # only the preemption save
    cluster.apply(job)
    log = cluster.step_log(name)
    wait_for(lambda: (log.collect(), log.last_step >= 8)[1], 300,
             "training to pass step 8")
    victim = next(p for p in cluster.pods(name) if p.metadata.labels["tardigrade.dev/rank"] == "1")
    node = cluster.spot_node_of(victim)
    reclaim = _reclaim(cluster, node)
    status = cluster.wait_phase(name, {"Succeeded"}, timeout=420, collector=log)
    operator.assert_alive()
    assert status["restarts"]["preemptions"] == 1
    assert status["restarts"]["failures"] == 0
    recovery = status["recoveries"][0]
    assert recovery["cause"] == "Preemption"
    assert recovery["stepsLost"] == 0, recovery
    assert recovery["restoreStep"] >= 8
    assert log.restored == [recovery["restoreStep"]]
    assert recovery["downtimeSeconds"] > 0
    # From the kubelets' files: the old gang's last lines, gone with its pods, are there too.
    _assert_continuous(cluster.complete_log(name), 60)
    assert_goodput_adds_up(cluster, name)
    _wait_back(cluster, node, reclaim)



def test_scale_up_and_down_mid_run(cluster: RealCluster, operator: InstalledOperator):
    name = "e2e-scale"
    job = cluster.trainingjob(name, steps=60, replicas=2)
    cluster.apply(job)
    log = cluster.step_log(name)
    for target in (3, 1):
        before = log.last_step
        wait_for(lambda before=before: (log.collect(), log.last_step >= before + 5)[1],
                 300, "training to make progress")
        cluster.kubectl("scale", f"tj/{name}", f"--replicas={target}")
        wait_for(lambda target=target: (
            log.collect(),
            cluster.status(name).get("replicas") == target
            and cluster.status(name).get("phase") == "Running")[1],
            300, f"{target} replicas running")
        assert len([p for p in cluster.pods(name) if p.metadata.deletion_timestamp is None
                    and p.metadata.labels["tardigrade.dev/attempt"]
                    == str(cluster.status(name)["attempt"])]) == target
    status = cluster.wait_phase(name, {"Succeeded"}, timeout=420, collector=log)
    assert status["restarts"]["resizes"] == 2
    assert status["restarts"]["failures"] == 0
    for recovery in status["recoveries"]:
        assert recovery["cause"] == "Resize"
        assert recovery["stepsLost"] == 0, recovery
    assert [r["toReplicas"] for r in status["recoveries"]] == [3, 1]
    assert log.restored == [r["restoreStep"] for r in status["recoveries"]]
    # Resharding changes float reduction order: continuity holds within tolerance.
    missing = [s for s in range(1, 61) if s not in cluster.complete_log(name).losses]
    assert not missing


def test_crash_loop_fails_after_max_restarts_with_the_reason(cluster: RealCluster,
                                                              operator: InstalledOperator):
    name = "e2e-crash"
    job = cluster.trainingjob(name, steps=10, replicas=1)
    # The trainer image's Python, not the trainer.
    job["spec"]["command"] = ["python3", "-c",
                              "import sys; print('loading data'); "
                              "print('RuntimeError: dataset shard missing'); sys.exit(1)"]
    job["spec"]["failurePolicy"] = {"maxRestarts": 2, "backoffSeconds": 1}
    cluster.apply(job)
    status = cluster.wait_phase(name, {"Failed"}, timeout=180)
    assert status["restarts"]["failures"] == 2
    assert status["restarts"]["preemptions"] == 0
    assert "maxRestarts=2" in status["message"]
    assert "dataset shard missing" in status["message"]
    assert status["attempt"] == 3
    cluster.kubectl("wait", "--for=condition=Stalled", f"tj/{name}", "--timeout=10s")
    times = [r["time"] for r in status["recoveries"]]
    assert len(times) == 2
    events = cluster.kubectl("get", "events", "--field-selector",
                             f"involvedObject.name={name}", "-o", "json")
    reasons = {e["reason"] for e in json.loads(events)["items"]}
    assert {"Failure", "RestartBudgetExhausted"} <= reasons
    operator.assert_alive()


def test_operator_killed_during_relaunch_converges(cluster: RealCluster,
                                                   operator: InstalledOperator):
    name = "e2e-restart"
    job = cluster.trainingjob(name, steps=400)
    cluster.apply(job)
    cluster.wait_phase(name, {"Running"}, timeout=240)
    reclaim = _reclaim(cluster, cluster.spot_node_of(cluster.pods(name)[0]))
    # The recovery is written before the operator acts on it (the relaunch's record): kill the
    # operator as soon as the record shows, mid-relaunch. The record stays; the phase
    # Restarting may last less than a poll.
    wait_for(lambda: (cluster.status(name).get("restarts") or {}).get("total", 0) >= 1, 60,
             "the recovery recorded", interval=0.1)
    operator.kill()
    operator.start()
    status = cluster.wait_phase(name, {"Running"}, timeout=300)
    # Usually one preemption; a relaunched pod can land on the reclaimed node just before it
    # goes, which is a second, real preemption. Either way every relaunch is counted once.
    reasons = [(r["cause"], r["reason"]) for r in status["recoveries"]]
    assert status["attempt"] >= 2, reasons
    assert status["restarts"]["preemptions"] == status["attempt"] - 1 == len(reasons), reasons
    assert status["restarts"]["total"] == status["restarts"]["preemptions"], status["restarts"]
    assert all(cause == "Preemption" for cause, _ in reasons), reasons

    def only_current_gang() -> bool:
        attempt = cluster.status(name)["attempt"]
        pods = cluster.pods(name)
        return sorted(p.metadata.name for p in pods) == [f"{name}-a{attempt}-0",
                                                         f"{name}-a{attempt}-1"]
    wait_for(only_current_gang, 120, "exactly one gang of pods")
    reclaim.join(NODE_BACK_SECONDS)


def test_delete_removes_children_but_keeps_checkpoints(cluster: RealCluster,
                                                       operator: InstalledOperator):
    name = "e2e-delete"
    job = cluster.trainingjob(name, steps=400)
    job["spec"]["checkpoint"]["interval"] = {"steps": 5}
    cluster.apply(job)
    wait_for(lambda: (cluster.status(name).get("lastCheckpoint") or {}).get("step"), 300,
             "a committed checkpoint")
    known = cluster.status(name)["lastCheckpoint"]["step"]
    secret = naming.keys_secret_name(name)
    assert cluster.core.read_namespaced_secret(secret, "default").data  # the job's keys
    cluster.kubectl("delete", "tj", name, "--timeout=120s")
    wait_for(lambda: not cluster.pods(name), 120, "pods to be garbage-collected")
    services = cluster.core.list_namespaced_service(
        "default", label_selector=f"tardigrade.dev/job={name}").items
    assert services == []
    # The keys go with the job (its owner reference, the controller-manager's collector).
    wait_for(lambda: secret not in {s.metadata.name for s in
                                    cluster.core.list_namespaced_secret("default").items},
             120, "the job's keys Secret to be garbage-collected")
    # Committed checkpoints outlive the job: the newest is at least the one the job reported
    # (the gang may have saved more before its pods went; keep-last only drops older ones).
    kept = sorted(int(path.split("/")[2].removeprefix("step_"))
                  for path in _checkpoint_objects(cluster, name)
                  if path.endswith("/metadata.json"))
    assert kept and kept[-1] >= known, (kept, known)


def test_bad_spec_is_rejected_by_the_api_server_with_the_field(cluster: RealCluster):
    job = cluster.trainingjob("e2e-bad", steps=10)
    job["spec"]["checkpoint"]["path"] = "s3://bucket/run"
    job["spec"]["replicas"] = 0
    result = cluster.kubectl("apply", "-f", "-", check=False,
                             stdin=json.dumps(job))
    assert "spec.replicas" in result
    assert "spec.checkpoint.path" in result
    assert cluster.job("e2e-bad") is None


def test_with_no_kueue_installed_a_queued_job_is_held_and_says_why(cluster: RealCluster,
                                                                    operator: InstalledOperator):
    """This cluster has no Kueue (its CRDs absent): jobs without the label run as every other
    test here shows; one labelled for a queue is held with the fix in its status, and runs
    once the label goes."""
    job = cluster.trainingjob("e2e-no-kueue", steps=6)
    job["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-queue"}
    cluster.apply(job)
    status = cluster.wait_phase("e2e-no-kueue", {"Queued"}, timeout=60)
    assert "Kueue, which is not installed" in status["message"], status
    assert "remove the label" in status["message"]
    assert not cluster.pods("e2e-no-kueue")
    cluster.kubectl("label", "tj", "e2e-no-kueue", "kueue.x-k8s.io/queue-name-")
    status = cluster.wait_phase("e2e-no-kueue", {"Succeeded"}, timeout=300)
    assert status["step"] == 6
    operator.assert_alive()
