"""Restart in place through `decide`: which pods a recovery keeps, the world each restarts
into, and the pods it recreates (in_place.py)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from tardigrade_contract import contract
from tardigrade_operator.api.types import Recovery, TrainingJobStatus
from tardigrade_operator.apply.kube import ClusterWriter
from tardigrade_operator.decision.plan import Plan
from tardigrade_operator.decision.recovery import carry, in_place, keepers, strategy
from tardigrade_operator.observation.job_memory import JobState
from tardigrade_operator.observation.observed import DecisionSettings
from tardigrade_operator.observation.pods import Outcome, PodView, classify, parse_pod

from tests.operator.fake_cluster import FakeCluster, iso, spec

NEW = "v1.36.0"
ON = DecisionSettings(restart_in_place=True)
IN_PLACE = contract.EXIT_RESTART_IN_PLACE
NOW = datetime(2026, 1, 1, tzinfo=UTC)


def running_gang(replicas: int = 3, versions: tuple[str, ...] = (NEW, NEW, NEW),
                 settings: DecisionSettings = ON) -> FakeCluster:
    cluster = FakeCluster(spec(replicas=replicas), settings=settings,
                          kubelet_versions={f"node-{i}": v for i, v in enumerate(versions)})
    cluster.reconcile()
    cluster.run_all()
    cluster.reconcile()
    assert cluster.status.phase == "Running"
    return cluster


def reclaimed_rank_1() -> tuple[FakeCluster, Plan]:
    """A running 3-rank gang that saved step 20 and trained to 30, then lost rank 1's host;
    the plan of the pass that recovered it."""
    cluster = running_gang()
    cluster.progress = contract.ProgressReport(step=30, checkpoint_step=20)
    cluster.reconcile()
    cluster.disrupt(cluster.pods["tiny-a1-1"])
    return cluster, cluster.reconcile()


def names(pods: list) -> list[str]:
    return sorted(p["metadata"]["name"] if isinstance(p, dict) else p[0] for p in pods)


def kept(plan: Plan) -> list[str]:
    """The pods a decision keeps: their ranks' requests carry a world."""
    return sorted(t.pod for t in plan.restart_in_place if t.world is not None)


def world_of(pod: dict) -> dict:
    return json.loads(pod["metadata"]["annotations"][contract.ANNOTATION_WORLD])


def restart(cluster: FakeCluster, name: str, attempt: int, step: int, saved: int) -> None:
    """What the kubelet shows once a kept trainer exited 77 and runs again."""
    message = contract.TerminationMessage(reason="RestartInPlace", step=step,
                                          checkpoint_step=saved, attempt=attempt).to_json()
    cluster.pods[name]["status"]["containerStatuses"] = [{
        "name": "trainer", "restartCount": 1, "state": {"running": {}},
        "lastState": {"terminated": {"exitCode": IN_PLACE, "message": message}}}]


def test_pods_carry_the_rule_world_and_key_only_when_switched_on():
    on = running_gang().pods["tiny-a1-0"]
    container = on["spec"]["containers"][0]
    assert keepers.rule_survived(on)
    env = {e["name"]: e for e in container["env"]}
    assert env[contract.ENV_WORLD]["valueFrom"]["fieldRef"]["fieldPath"] == \
        f"metadata.annotations['{contract.ANNOTATION_WORLD}']"
    # From the job's Secret, never a literal value (keys.py).
    assert env[contract.ENV_RESTART_KEY] == {"name": contract.ENV_RESTART_KEY, "valueFrom": {
        "secretKeyRef": {"name": "tiny-tardigrade-keys", "key": contract.SECRET_RESTART_KEY}}}
    assert parse_pod(on).restart_keyed
    assert contract.ENV_RESTART_IN_PLACE_DIR in env
    off = running_gang(settings=DecisionSettings()).pods["tiny-a1-0"]
    assert not keepers.rule_survived(off)
    assert contract.ENV_RESTART_KEY not in {e["name"] for e in off["spec"]["containers"][0]["env"]}
    assert not parse_pod(off).restart_keyed


def test_preemption_of_one_rank_keeps_the_others_and_recreates_only_it():
    cluster, plan = reclaimed_rank_1()

    assert cluster.status.attempt == 2 and cluster.status.restarts.preemptions == 1
    assert cluster.status.recoveries[-1].kept_pods == 2
    # The kept pods join attempt 2 by the recovery's record; their labels are patched only
    # once the gang runs again (a thousand patches would compete with the restarts).
    assert kept(plan) == ["tiny-a1-0", "tiny-a1-2"] and not plan.patch_pods
    assert cluster.pods["tiny-a1-0"]["metadata"]["labels"]["tardigrade.dev/attempt"] == "1"
    assert [n for n, _ in plan.delete_pods] == ["tiny-a1-1"]
    assert names(plan.create_pods) == ["tiny-a2-1"]
    assert world_of(plan.create_pods[0])["coordinatorAddress"] == "tiny-a1-0.tiny:8476"
    # Each kept rank is asked to restart into attempt 2; the lost one too,
    # so that it leaves once saved instead of waiting for a word that would never come.
    assert [(t.pod, t.url) for t in plan.restart_in_place] == [
        ("tiny-a1-0", "http://127.0.1.1:8477/restart-in-place?attempt=2"),
        ("tiny-a1-2", "http://127.0.1.3:8477/restart-in-place?attempt=2"),
        ("tiny-a1-1", "http://127.0.1.2:8477/restart-in-place?attempt=2")]
    # Each kept rank's request carries its new world; the one that goes gets none.
    worlds = {t.pod: t.world for t in plan.restart_in_place}
    for name in ("tiny-a1-0", "tiny-a1-2"):
        assert json.loads(worlds[name] or "") == {
            "attempt": 2, "numProcesses": 3, "processId": int(name[-1]),
            "coordinatorAddress": "tiny-a1-0.tiny:8476", "restoreStep": "20"}
    assert worlds["tiny-a1-1"] is None

    # The old trainers are still saving: the new gang is not running yet.
    cluster.pods["tiny-a2-1"]["spec"]["nodeName"] = "node-3"
    cluster.pods["tiny-a2-1"]["status"] = {
        "phase": "Running", "podIP": "127.0.1.4",
        "containerStatuses": [{"name": "trainer", "state": {"running": {}}}]}
    plan = cluster.reconcile()
    assert cluster.status.phase != "Running"
    assert cluster.status.recoveries[-1].restore_step is None
    # Still counted in attempt 2 (not garbage of attempt 1), and not patched yet.
    assert not plan.delete_pods and not plan.create_pods and not plan.patch_pods

    # Both saved step 31 as attempt 1 and were restarted by their kubelets.
    for name in ("tiny-a1-0", "tiny-a1-2"):
        restart(cluster, name, attempt=1, step=31, saved=31)
    cluster.advance(3)
    cluster.progress = contract.ProgressReport(step=32, checkpoint_step=31)
    plan = cluster.reconcile()
    assert cluster.status.phase == "Running"
    recovery = cluster.status.recoveries[-1]
    assert (recovery.restore_step, recovery.steps_lost) == (31, 0)
    assert recovery.downtime_seconds == 3
    assert not plan.create_pods and not plan.delete_pods
    # Running again: now the kept pods get their label and world, with the step restored.
    assert names(plan.patch_pods) == ["tiny-a1-0", "tiny-a1-2"]
    for name in ("tiny-a1-0", "tiny-a1-2"):
        pod = cluster.pods[name]
        assert pod["metadata"]["labels"]["tardigrade.dev/attempt"] == "2"
        assert world_of(pod) == {"attempt": 2, "numProcesses": 3,
                                 "processId": int(name[-1]),
                                 "coordinatorAddress": "tiny-a1-0.tiny:8476",
                                 "restoreStep": "31"}
    assert not cluster.reconcile().patch_pods


def test_a_node_with_an_old_kubelet_falls_back_to_recreation_for_its_rank():
    cluster = running_gang(versions=(NEW, NEW, "v1.33.0"))
    cluster.disrupt(cluster.pods["tiny-a1-1"])
    plan = cluster.reconcile()
    assert kept(plan) == ["tiny-a1-0"]
    assert sorted(n for n, _ in plan.delete_pods) == ["tiny-a1-1", "tiny-a1-2"]
    assert names(plan.create_pods) == ["tiny-a2-1", "tiny-a2-2"]


def test_a_pod_whose_rule_the_api_server_dropped_is_recreated():
    cluster = running_gang()
    container = cluster.pods["tiny-a1-2"]["spec"]["containers"][0]
    container.pop("restartPolicyRules")
    container.pop("restartPolicy")
    cluster.disrupt(cluster.pods["tiny-a1-1"])
    plan = cluster.reconcile()
    assert kept(plan) == ["tiny-a1-0"]
    assert names(plan.create_pods) == ["tiny-a2-1", "tiny-a2-2"]


def test_a_trainer_that_restarts_in_process_is_kept_whatever_its_node_s_kubelet():
    in_process = DecisionSettings(restart_in_place=True, restart_in_process=True)
    cluster = running_gang(versions=(NEW, "v1.33.0", "v1.33.0"), settings=in_process)
    # And one whose rule the API server dropped: no kubelet restarts a trainer that execs.
    container = cluster.pods["tiny-a1-2"]["spec"]["containers"][0]
    container.pop("restartPolicyRules")
    container.pop("restartPolicy")
    cluster.disrupt(cluster.pods["tiny-a1-1"])
    plan = cluster.reconcile()
    assert kept(plan) == ["tiny-a1-0", "tiny-a1-2"]
    assert names(plan.create_pods) == ["tiny-a2-1"]
    # Should such a kept trainer exit 77 after all (no request came in time), its old
    # kubelet ends the pod: a save, so the next pass recovers again, recreating that rank,
    # and the budget of failures is untouched.
    cluster.pods["tiny-a1-2"]["status"] = {
        "phase": "Failed", "podIP": "127.0.1.3", "containerStatuses": [{
            "name": "trainer", "state": {"terminated": {
                "exitCode": IN_PLACE, "message": contract.TerminationMessage(
                    reason="RestartInPlace", step=31, checkpoint_step=31,
                    attempt=1).to_json()}}}]}
    plan = cluster.reconcile()
    assert cluster.status.attempt == 3 and cluster.status.recoveries[-1].cause == "Preemption"
    assert kept(plan) == ["tiny-a1-0"] and names(plan.create_pods) == ["tiny-a3-1", "tiny-a3-2"]
    assert cluster.status.restarts.failures == 0


def test_no_kept_pod_at_all_is_a_plain_recreation():
    cluster = running_gang(versions=("v1.33.0",) * 3)
    cluster.disrupt(cluster.pods["tiny-a1-1"])
    plan = cluster.reconcile()
    assert not kept(plan) and not plan.create_pods
    assert len(plan.delete_pods) == 3 and cluster.status.recoveries[-1].kept_pods is None


def test_a_gang_recreated_whole_tells_its_waiting_trainers_to_exit_at_once():
    # Rank 0 restarted in place a minute ago (back-off ahead), rank 1 is preempted: nothing
    # is kept. Both trainers wait after their save for the operator's word
    # (keepers.RELEASE_WAIT_SECONDS); without it they would hold the relaunch that long.
    cluster = running_gang(replicas=2)
    status = cluster.pods["tiny-a1-0"]["status"]["containerStatuses"][0]
    status["restartCount"] = 1
    status["lastState"] = {"terminated": {"exitCode": IN_PLACE,
                                          "finishedAt": iso(cluster.now - timedelta(minutes=1))}}
    cluster.disrupt(cluster.pods["tiny-a1-1"])
    plan = cluster.reconcile()
    assert not kept(plan) and sorted(n for n, _ in plan.delete_pods) == [
        "tiny-a1-0", "tiny-a1-1"]
    assert [(t.pod, t.url.rpartition("?")[2]) for t in plan.restart_in_place] == [
        ("tiny-a1-0", "attempt=2"), ("tiny-a1-1", "attempt=2")]


def test_grow_keeps_every_pod_and_asks_rank_0_to_restart():
    cluster = running_gang(replicas=2)
    cluster.spec["replicas"] = 3
    cluster.generation += 1
    plan = cluster.reconcile()
    assert cluster.status.recoveries[-1].cause == "Resize"
    assert kept(plan) == ["tiny-a1-0", "tiny-a1-1"]
    assert not plan.delete_pods
    assert names(plan.create_pods) == ["tiny-a2-2"]
    assert world_of(plan.create_pods[0])["numProcesses"] == 3
    # Nothing is deleted, so no SIGTERM tells the gang: the operator's requests do.
    assert [t.pod for t in plan.restart_in_place] == ["tiny-a1-0", "tiny-a1-1"]


def test_shrink_deletes_the_surplus_ranks_only():
    cluster = running_gang()
    cluster.spec["replicas"] = 2
    cluster.generation += 1
    plan = cluster.reconcile()
    assert kept(plan) == ["tiny-a1-0", "tiny-a1-1"]
    assert [n for n, _ in plan.delete_pods] == ["tiny-a1-2"]
    assert not plan.create_pods
    worlds = {t.pod: json.loads(t.world or "{}") for t in plan.restart_in_place}
    assert worlds["tiny-a1-1"]["numProcesses"] == 2 and not worlds["tiny-a1-2"]


def test_a_crash_still_recreates_the_gang():
    cluster = running_gang()
    cluster.terminate(cluster.pods["tiny-a1-1"], 1, "boom")
    plan = cluster.reconcile()
    assert not kept(plan) and cluster.status.recoveries[-1].cause == "Failure"


def test_exit_77_is_a_restart_while_the_pod_lives_and_a_save_once_it_ended():
    cluster = running_gang()
    pod = cluster.pods["tiny-a1-0"]
    pod["status"]["containerStatuses"] = [{"name": "trainer", "state": {
        "terminated": {"exitCode": IN_PLACE}}}]
    view = parse_pod(pod)
    assert view is not None and classify(view).outcome is Outcome.PENDING
    cluster.terminate(pod, IN_PLACE)
    view = parse_pod(pod)
    assert view is not None and classify(view).outcome is Outcome.PREEMPTED


@pytest.mark.parametrize("memory_tier", [False, True])
def test_a_pod_restarted_in_place_lately_is_recreated_to_escape_the_kubelet_back_off(
        memory_tier: bool):
    cluster = running_gang()
    if memory_tier:
        cluster.spec["checkpoint"]["memoryTier"] = {"interval": 5}
    for name, minutes_ago in (("tiny-a1-0", 11), ("tiny-a1-2", 2)):
        status = cluster.pods[name]["status"]["containerStatuses"][0]
        status["restartCount"] = 1
        finished = cluster.now - timedelta(minutes=minutes_ago)
        status["lastState"] = {"terminated": {"exitCode": IN_PLACE,
                                              "finishedAt": iso(finished)}}
    cluster.disrupt(cluster.pods["tiny-a1-1"])
    plan = cluster.reconcile()
    if memory_tier:
        # Its memory tier would go with its pod: the 10 s back-off is the smaller loss.
        assert kept(plan) == ["tiny-a1-0", "tiny-a1-2"]
        assert names(plan.create_pods) == ["tiny-a2-1"]
        return
    # Its next restart would wait 10 s of back-off; the one that ran 11 minutes has none.
    assert kept(plan) == ["tiny-a1-0"]
    assert names(plan.create_pods) == ["tiny-a2-1", "tiny-a2-2"]


def test_a_kept_rank_that_did_not_take_its_request_is_recreated_in_the_same_attempt():
    cluster, plan = reclaimed_rank_1()
    assert kept(plan) == ["tiny-a1-0", "tiny-a1-2"]
    # Rank 2's trainer answered nothing (or no to) its request; the rank that goes answered
    # nothing either, which needs no follow-up: its pod is being deleted.
    answers = {"tiny-a1-0": True, "tiny-a1-2": False, "tiny-a1-1": False}
    cluster.refused_restarts = in_place.refused(
        plan.restart_in_place, [answers[t.pod] for t in plan.restart_in_place])
    assert cluster.refused_restarts == {"tiny-a1-2"}

    plan = cluster.reconcile()
    # Without its world it would restart into attempt 1 again and be turned away: its rank
    # gets a new pod in attempt 2, rank 0's kept pod still its coordinator. One recovery.
    assert plan.delete_pods == [("tiny-a1-2", None)]
    assert names(plan.create_pods) == ["tiny-a2-2"]
    assert world_of(plan.create_pods[0]) == {
        "attempt": 2, "numProcesses": 3, "processId": 2,
        "coordinatorAddress": "tiny-a1-0.tiny:8476", "restoreStep": "20"}
    assert [e.reason for e in plan.events] == ["RestartInPlaceRefused"]
    assert "tiny-a1-2" in plan.events[0].message
    assert cluster.status.attempt == 2 and cluster.status.restarts.preemptions == 1

    # Its old pod saves with the gang while it terminates: neither gone nor recreated again.
    plan = cluster.reconcile()
    assert not plan.create_pods and not plan.delete_pods and not plan.events
    assert cluster.status.attempt == 2

    for name, rank in (("tiny-a2-1", 1), ("tiny-a2-2", 2)):
        cluster.pods[name]["spec"]["nodeName"] = f"node-{rank + 2}"
        cluster.pods[name]["status"] = {
            "phase": "Running", "podIP": f"127.0.2.{rank}",
            "containerStatuses": [{"name": "trainer", "state": {"running": {}}}]}
    cluster.terminate(cluster.pods["tiny-a1-2"], IN_PLACE, contract.TerminationMessage(
        reason="RestartInPlace", step=31, checkpoint_step=31, attempt=1).to_json())
    restart(cluster, "tiny-a1-0", attempt=1, step=31, saved=31)
    cluster.progress = contract.ProgressReport(step=32, checkpoint_step=31, attempt=2)
    plan = cluster.reconcile()
    assert cluster.status.phase == "Running" and cluster.status.attempt == 2
    assert cluster.status.restarts.preemptions == 1 and cluster.status.restarts.failures == 0
    assert names(plan.patch_pods) == ["tiny-a1-0"]


def test_a_kept_rank_0_that_did_not_take_its_request_is_asked_again_while_it_may_wait():
    # The other ranks' worlds name its pod as their coordinator: a new pod would have another
    # name. Its trainer waits 30 s after the gang's save for the word: it is asked again.
    cluster, first = reclaimed_rank_1()
    cluster.refused_restarts = frozenset({"tiny-a1-0"})
    cluster.advance(2)
    plan = cluster.reconcile()
    assert not plan.delete_pods and not plan.create_pods and not plan.events
    assert cluster.status.attempt == 2
    sent = {t.pod: t for t in first.restart_in_place}["tiny-a1-0"]
    assert plan.restart_in_place == [sent]  # the same url, key and world as the first time
    # Past the wait its trainer has stopped waiting: no more requests.
    cluster.advance(in_place.ASK_AGAIN_FOR.total_seconds())
    assert not cluster.reconcile().restart_in_place
    # Once it took one, nothing is asked again.
    cluster.now -= in_place.ASK_AGAIN_FOR
    cluster.refused_restarts = frozenset()
    assert not cluster.reconcile().restart_in_place


def test_a_gang_that_finished_before_its_ranks_restarted_in_place_succeeds():
    # A grow decided while the gang trained its last steps: the kept trainers end with 0
    # instead of 77, and the new rank 2 would wait for a coordinator that is gone.
    cluster = running_gang(replicas=2)
    cluster.spec["replicas"] = 3
    cluster.generation += 1
    cluster.reconcile()
    done = contract.TerminationMessage(reason="Succeeded", step=50, checkpoint_step=50,
                                       attempt=1).to_json()
    # Rank 1 alone tells nothing: it may leave before rank 0 has committed the final save.
    cluster.terminate(cluster.pods["tiny-a1-1"], 0, done)
    cluster.reconcile()
    assert cluster.status.phase == "Resizing"
    cluster.terminate(cluster.pods["tiny-a1-0"], 0, done)
    plan = cluster.reconcile()
    assert cluster.status.phase == "Succeeded" and cluster.status.restarts.failures == 0
    assert [e.reason for e in plan.events] == ["Completed"]
    assert "step 50" in (cluster.status.message or "")
    # Then the new rank is stopped.
    assert cluster.reconcile().delete_pods == [("tiny-a2-2", None)]


def test_the_operator_remembers_refusals_until_a_later_request_is_taken():
    state = JobState()
    # Ranks 0 and 2 refused: the next pass must act at once.
    both = frozenset({"j-a1-0", "j-a1-2"})
    assert state.in_place.answered(2, both, both)
    assert state.in_place.refused_in(2) == {"j-a1-0", "j-a1-2"}
    # Rank 0 asked again, refused again: nothing new to act on at once.
    assert not state.in_place.answered(2, frozenset({"j-a1-0"}), frozenset({"j-a1-0"}))
    # Then it took it.
    assert not state.in_place.answered(2, frozenset({"j-a1-0"}), frozenset())
    assert state.in_place.refused_in(2) == {"j-a1-2"}
    # A newer attempt forgets the older one's.
    assert state.in_place.refused_in(3) == frozenset()
    assert state.in_place.refused_in(2) == frozenset()


class _Answer:
    """An empty raw answer, as the client gives with `_preload_content=False`."""

    data = b""

    def release_conn(self) -> None:
        pass


class _RecordingCore:
    """The pod calls a ClusterWriter makes, in order."""

    def __init__(self, calls: list[tuple[str, str]]) -> None:
        self.calls = calls

    def patch_namespaced_pod(self, name: str, namespace: str, patch: dict,
                             **_options: object) -> _Answer:
        self.calls.append(("patch", name))
        return _Answer()

    def delete_namespaced_pod(self, name: str, namespace: str, body: object,
                              **_options: object) -> _Answer:
        self.calls.append(("delete", name))
        return _Answer()

    def create_namespaced_pod(self, namespace: str, pod: dict, **_options: object) -> _Answer:
        self.calls.append(("create", pod["metadata"]["name"]))
        return _Answer()


def test_the_writer_asks_the_ranks_after_the_deletes_and_patches_no_pod_meanwhile():
    cluster = running_gang()
    cluster.reconcile()
    cluster.disrupt(cluster.pods["tiny-a1-1"])
    plan = cluster.reconcile()
    calls: list[tuple[str, str]] = []
    writer = ClusterWriter.__new__(ClusterWriter)
    writer.core = _RecordingCore(calls)
    plan.status = cluster.status
    writer.apply("default", "tiny", cluster.status, plan,
                 ask_ranks=lambda: calls.append(("ask", "")))
    # The deleted pod's SIGTERM and the requests start the gang's save; the kept ranks take
    # their world from the requests. No pod patch competes with their restarts.
    assert calls == [("delete", "tiny-a1-1"), ("ask", ""), ("create", "tiny-a2-1")]


def test_a_second_recovery_before_the_labels_keeps_the_same_pods():
    # Rank 1 preempted (attempt 2, ranks 0 and 2 kept), then rank 2 preempted before the
    # gang ran again: rank 0, still labelled 1, is kept again and carried into attempt 3.
    cluster = running_gang()
    cluster.disrupt(cluster.pods["tiny-a1-1"])
    cluster.reconcile()
    cluster.pods["tiny-a2-1"]["spec"]["nodeName"] = "node-1"
    cluster.pods["tiny-a2-1"]["status"] = {
        "phase": "Running", "podIP": "127.0.1.4",
        "containerStatuses": [{"name": "trainer", "state": {"running": {}}}]}
    for name in ("tiny-a1-0", "tiny-a1-2"):
        restart(cluster, name, attempt=1, step=31, saved=31)
        # Long enough ago that the kubelet's back-off has expired (BACK_OFF_MEMORY).
        cluster.pods[name]["status"]["containerStatuses"][0]["lastState"]["terminated"][
            "finishedAt"] = iso(cluster.now - timedelta(minutes=11))
    cluster.disrupt(cluster.pods["tiny-a1-2"])
    plan = cluster.reconcile()
    assert cluster.status.attempt == 3 and cluster.status.restarts.preemptions == 2
    assert kept(plan) == ["tiny-a1-0", "tiny-a2-1"] and not plan.patch_pods
    assert [n for n, _ in plan.delete_pods] == ["tiny-a1-2"]
    assert names(plan.create_pods) == ["tiny-a3-2"]
    views = [v for v in (parse_pod(p) for p in cluster.pods.values()) if v is not None]
    gang = {p.name: p.rank for p in carry.carried(views, cluster.status)
            if p.attempt == 3}
    assert gang == {"tiny-a1-0": 0, "tiny-a2-1": 1, "tiny-a3-2": 2}


def _view(name: str, attempt: int, rank: int, deleting: bool = False) -> PodView:
    return PodView(name=name, attempt=attempt, rank=rank, phase="Running",
                   deletion_timestamp=NOW if deleting else None)


def _status(attempt: int, replicas: int, kept_into: tuple[int, ...]) -> TrainingJobStatus:
    return TrainingJobStatus(attempt=attempt, replicas=replicas, recoveries=[
        Recovery(cause="Preemption", time=NOW, attempt=a, kept_pods=1 if a in kept_into
                 else None) for a in range(2, attempt + 1)])


def test_carried_pods_are_the_kept_ones_only():
    status = _status(attempt=3, replicas=3, kept_into=(2, 3))
    pods = [_view("j-a1-0", 1, 0),  # kept twice, never relabelled
            _view("j-a2-1", 2, 1),  # created in attempt 2, kept into 3
            _view("j-a1-1", 1, 1, deleting=True),  # the rank 1 lost at attempt 2
            _view("j-a1-2", 1, 2),  # recreated at attempt 3 (its delete not seen yet)
            _view("j-a3-2", 3, 2),
            _view("j-a1-3", 1, 3)]  # beyond the world (a shrink)
    attempts = {p.name: (p.attempt, p.label_attempt)
                for p in carry.carried(pods, status)}
    assert attempts == {"j-a1-0": (3, 1), "j-a2-1": (3, 2), "j-a1-1": (1, None),
                        "j-a1-2": (1, None), "j-a3-2": (3, None), "j-a1-3": (1, None)}


def test_a_recreation_breaks_the_chain():
    # Attempt 2 kept pods, attempt 3 recreated the gang: an attempt-1 pod is garbage.
    status = _status(attempt=3, replicas=2, kept_into=(2,))
    pods = carry.carried([_view("j-a1-0", 1, 0), _view("j-a2-1", 2, 1)], status)
    assert [p.attempt for p in pods] == [1, 2]


def test_late_labels_are_sent_once_while_the_index_catches_up():
    state = JobState()
    patches = [("j-a1-0", {}), ("j-a1-1", {})]
    present = {"j-a1-0", "j-a1-1"}
    assert state.in_place.unsent(patches, 2, present) == patches
    state.in_place.sent(patches, 2)
    # The next passes still see the old labels (the patches' events are on their way).
    assert state.in_place.unsent(patches, 2, present) == []
    # A later attempt's labels are new; a pod gone is forgotten.
    assert state.in_place.unsent(patches, 3, present) == patches
    assert state.in_place.unsent(patches[:1], 2, {"j-a1-0"}) == []
    assert state.in_place.labelled == {"j-a1-0": 2}


def test_carried_views_are_reused_between_passes_and_forgotten_with_their_pods():
    status = _status(attempt=2, replicas=2, kept_into=(2,))
    pods = [_view("j-a1-0", 1, 0), _view("j-a1-1", 1, 1)]
    memo: carry.CarryMemo = {}
    first = carry.carried(pods, status, memo)
    again = carry.carried(pods, status, memo)
    assert all(a is b for a, b in zip(first, again, strict=True))
    changed = [_view("j-a1-0", 1, 0, deleting=True), pods[1]]
    assert carry.carried(changed, status, memo)[0].attempt == 1
    carry.carried(pods[1:], status, memo)
    assert set(memo) == {"j-a1-1"}


def test_pods_tell_their_trainers_to_restart_in_process_only_when_switched_on():
    def env_of(cluster: FakeCluster) -> set[str]:
        return {e["name"] for e in cluster.pods["tiny-a1-0"]["spec"]["containers"][0]["env"]}

    in_process = DecisionSettings(restart_in_place=True, restart_in_process=True)
    assert contract.ENV_RESTART_IN_PROCESS in env_of(running_gang(settings=in_process))
    assert contract.ENV_RESTART_IN_PROCESS not in env_of(running_gang())
    # Without restart in place there is nothing to restart in process.
    alone = DecisionSettings(restart_in_process=True)
    assert contract.ENV_RESTART_IN_PROCESS not in env_of(running_gang(settings=alone))


def test_ranks_restarted_in_process_count_once_rank_0_reports_the_new_attempt():
    cluster = running_gang(settings=DecisionSettings(restart_in_place=True,
                                                     restart_in_process=True))
    cluster.progress = contract.ProgressReport(step=30, checkpoint_step=20, attempt=1)
    cluster.reconcile()
    cluster.disrupt(cluster.pods["tiny-a1-1"])
    cluster.reconcile()
    assert cluster.status.recoveries[-1].kept_pods == 2
    cluster.pods["tiny-a2-1"]["spec"]["nodeName"] = "node-3"
    cluster.pods["tiny-a2-1"]["status"] = {
        "phase": "Running", "podIP": "127.0.1.4",
        "containerStatuses": [{"name": "trainer", "state": {"running": {}}}]}
    # The old rank 0 still reports, saving step 31: its attempt is the old one, so the kept
    # pods, whose containers never restart, still count as starting.
    cluster.progress = contract.ProgressReport(step=31, checkpoint_step=31, attempt=1)
    plan = cluster.reconcile()
    assert cluster.status.phase == "Restarting" and not plan.patch_pods
    recovery = cluster.status.recoveries[-1]
    assert recovery.gang_formed_time is None and recovery.restore_step is None
    assert recovery.downtime_seconds is None

    # Every rank met in attempt 2 (rank 0 serves only then), restored from step 31.
    cluster.advance(2)
    cluster.progress = contract.ProgressReport(step=31, checkpoint_step=31, attempt=2,
                                               restore_step=31)
    plan = cluster.reconcile()
    recovery = cluster.status.recoveries[-1]
    assert cluster.status.phase == "Running"
    assert recovery.gang_formed_time == cluster.now
    assert (recovery.restore_step, recovery.steps_lost) == (31, 0)
    assert recovery.downtime_seconds is None  # not trained past the restore yet
    assert names(plan.patch_pods) == ["tiny-a1-0", "tiny-a1-2"]
    # Known from then on, also in passes that read no report.
    cluster.progress = None
    cluster.reconcile()
    assert cluster.status.phase == "Running"
    cluster.advance(1)
    cluster.progress = contract.ProgressReport(step=33, checkpoint_step=31, attempt=2,
                                               restore_step=31)
    cluster.reconcile()
    assert cluster.status.recoveries[-1].downtime_seconds == 3


def test_steps_trained_past_the_restore_of_a_gang_met_in_process_are_lost():
    recovery = Recovery(cause="Preemption", time=NOW, attempt=2, kept_pods=2)
    status = TrainingJobStatus(attempt=2, step=40, recoveries=[recovery])
    # A report of the old attempt says nothing about the new gang.
    strategy.note_gang_formed(
        status, contract.ProgressReport(step=40, attempt=1), NOW)
    assert recovery.gang_formed_time is None
    strategy.note_gang_formed(
        status, contract.ProgressReport(step=30, attempt=2, restore_step=30), NOW)
    assert (recovery.gang_formed_time, recovery.restore_step, recovery.steps_lost) == (
        NOW, 30, 10)
    # Recorded once: a later report changes nothing.
    strategy.note_gang_formed(
        status, contract.ProgressReport(step=35, attempt=2, restore_step=30),
        NOW + timedelta(seconds=5))
    assert recovery.gang_formed_time == NOW


def test_the_pod_that_set_a_recovery_off_never_counts_in_it_however_late_its_deletion_shows():
    """On a real cluster the kubelet reports a reclaimed pod Failed, with DisruptionTarget,
    only once its container is gone (`mergePodStatus`), and the operator's next pass can
    read its own recovery before it reads the deletion of that pod or the pod created for
    its rank. The old pod must not be carried into the new attempt as a kept one, where its
    failure would set off a second recovery."""
    cluster = running_gang()
    cluster.progress = contract.ProgressReport(step=30, checkpoint_step=20)
    cluster.reconcile()
    reclaimed = cluster.pods["tiny-a1-1"]
    cluster.disrupt(reclaimed)
    reclaimed["status"]["phase"] = "Failed"
    reclaimed["status"]["containerStatuses"] = [{
        "name": "trainer", "state": {"terminated": {"exitCode": 137, "reason": "Error"}}}]
    seen_before = json.loads(json.dumps(reclaimed))
    cluster.reconcile()
    assert cluster.status.attempt == 2 and cluster.status.recoveries[-1].kept_pods == 2
    assert cluster.status.recoveries[-1].recreated_ranks == "1"
    # The index lags: the reclaimed pod as it was, not yet deleting; its successor unseen.
    cluster.pods["tiny-a1-1"] = seen_before
    cluster.pods.pop("tiny-a2-1")
    plan = cluster.reconcile()
    assert cluster.status.attempt == 2 and cluster.status.restarts.preemptions == 1
    assert len(cluster.status.recoveries) == 1
    assert not plan.restart_in_place


def test_rank_ranges_round_trip():
    for ranks in ([], [3], [3, 5, 6, 7], [0, 1, 2, 4, 9, 10], list(range(1024))):
        text = carry.rank_ranges(ranks)
        assert carry.parse_rank_ranges(text) == set(ranks)
    assert carry.rank_ranges([7, 5, 6, 3]) == "3,5-7"


def _lose_node_of(cluster: FakeCluster, pod: str, down_seconds: float) -> str:
    node = cluster.pods[pod]["spec"]["nodeName"]
    cluster.nodes_ready = {n: n != node for n in cluster.kubelet_versions}
    cluster.nodes_not_ready_since = {node: cluster.now - timedelta(seconds=down_seconds)}
    return node


def test_the_kept_ranks_are_told_which_ranks_were_lost_without_notice():
    cluster = running_gang()
    cluster.progress = contract.ProgressReport(step=30, checkpoint_step=20)
    cluster.reconcile()
    # Rank 1's VM stopped: its node is Unknown past the operator's tolerance and rank 0's step
    # stopped advancing (its collective waits for rank 1).
    cluster.advance(ON.node_lost_after.total_seconds() + 1)
    _lose_node_of(cluster, "tiny-a1-1", ON.node_lost_after.total_seconds() + 1)
    plan = cluster.reconcile()
    assert plan.status.recoveries[-1].cause == "Preemption"
    assert kept(plan) == ["tiny-a1-0", "tiny-a1-2"]
    for trigger in plan.restart_in_place:
        assert trigger.url.endswith(f"?attempt=2&{contract.RESTART_LOST_RANKS_PARAM}=1")
    assert names(plan.create_pods) == ["tiny-a2-1"]


def test_a_taint_eviction_on_an_unready_node_is_a_loss_without_notice_but_a_reclaim_is_not():
    cluster = running_gang()
    # Evicted by the taint manager while its node is not Ready (its toleration ran out
    # before the operator's tolerance): lost, no notice.
    _lose_node_of(cluster, "tiny-a1-2", 5)
    cluster.disrupt(cluster.pods["tiny-a1-2"], reason=in_place.TAINT_EVICTION)
    plan = cluster.reconcile()
    assert kept(plan) == ["tiny-a1-0", "tiny-a1-1"]
    assert all(t.url.endswith(f"&{contract.RESTART_LOST_RANKS_PARAM}=2")
               for t in plan.restart_in_place)
    # A spot reclaim: the kubelet's SIGTERM reached the rank, which saves with the gang.
    _, plan = reclaimed_rank_1()
    assert plan.restart_in_place
    assert not any(contract.RESTART_LOST_RANKS_PARAM in t.url for t in plan.restart_in_place)


def test_survivors_outlive_jax_s_heartbeat_only_where_the_memory_tier_keeps_them():
    def heartbeat(settings: DecisionSettings, memory: bool) -> str | None:
        extra = {"checkpoint": {"path": "gs://bucket/tiny",
                                "memoryTier": {"interval": 5}}} if memory else {}
        cluster = FakeCluster(spec(replicas=2, **extra), settings=settings,
                              kubelet_versions={"node-0": NEW, "node-1": NEW})
        cluster.reconcile()
        env = {e["name"]: e.get("value") for e in
               cluster.pods["tiny-a1-0"]["spec"]["containers"][0]["env"]}
        return env.get(contract.ENV_HEARTBEAT_TIMEOUT_SECONDS)

    # The node monitor's grace (50 s), the operator's tolerance and a minute for its request.
    assert heartbeat(ON, memory=True) == str(50 + 60 + 60)
    slow = DecisionSettings(restart_in_place=True, node_lost_after=timedelta(seconds=600))
    assert heartbeat(slow, memory=True) == str(50 + 600 + 60)
    assert heartbeat(ON, memory=False) is None
    assert heartbeat(DecisionSettings(), memory=True) is None
