"""What the operator tells the trainer about the checkpoint root: owner, pin, rollback, initFrom
(docs/checkpoint-format.md); and the immutable path, as the API server enforces it."""

from __future__ import annotations

import copy

import pytest
from pydantic import ValidationError
from tardigrade_contract import contract
from tardigrade_operator.api.types import TrainingJob

from tests.operator.fake_cluster import FakeCluster, pod_env, spec

SAVED = contract.EXIT_PREEMPTED_SAVED


def _running(cluster: FakeCluster) -> FakeCluster:
    cluster.reconcile()
    cluster.run_all()
    cluster.reconcile()
    return cluster


def _preempt_and_relaunch(cluster: FakeCluster, checkpoint: int | None) -> dict[str, str]:
    cluster.disrupt(cluster.attempt_pods()[0])
    cluster.reconcile()
    cluster.advance(5)
    cluster.terminate_all(SAVED, step=checkpoint or 0, checkpoint=checkpoint)
    plan = cluster.reconcile()
    assert plan.create_pods, "no relaunch"
    return pod_env(plan.create_pods[0])


def test_every_rank_learns_the_owner_and_the_initfrom_root():
    cluster = FakeCluster(spec(checkpoint={"path": "gs://bucket/tiny",
                                           "initFrom": {"path": "gs://bucket/base", "step": 7}}))
    env = pod_env(cluster.reconcile().create_pods[1])
    assert env[contract.ENV_JOB_UID] == "uid-1"
    assert env[contract.ENV_NAMESPACE] == "ml" and env[contract.ENV_JOB_NAME] == "tiny"
    assert (env[contract.ENV_INIT_FROM_PATH], env[contract.ENV_INIT_FROM_STEP]) == (
        "gs://bucket/base", "7")
    assert contract.ENV_ROLLBACK_STEP not in env


def test_a_restore_step_is_one_request_that_resets_the_pin():
    cluster = _running(FakeCluster(spec()))
    cluster.progress = contract.ProgressReport(step=300, checkpoint_step=300)
    cluster.reconcile()
    assert cluster.status.last_checkpoint.step == 300
    cluster.spec = spec(checkpoint={"path": "gs://bucket/tiny", "restoreStep": 100})
    env = _preempt_and_relaunch(cluster, checkpoint=300)
    # The abandoned line's 300 must not stay the floor of the line that restarts at 100.
    assert env[contract.ENV_RESTORE_STEP] == "100"
    assert env[contract.ENV_ROLLBACK_STEP] == "100"
    request = env[contract.ENV_ROLLBACK_REQUEST]
    assert request.startswith("uid-1/")  # a re-created job's requests never collide with these
    cluster.progress = None  # the new gang has not reported yet
    cluster.run_all()
    cluster.reconcile()
    cluster.progress = contract.ProgressReport(step=150, checkpoint_step=150)
    cluster.reconcile()
    env = _preempt_and_relaunch(cluster, checkpoint=150)
    # The same request again (the trainer applies it once), and the new line's pin.
    assert env[contract.ENV_RESTORE_STEP] == "150"
    assert env[contract.ENV_ROLLBACK_REQUEST] == request
    assert cluster.status.restore_request.step == 100


def _job(path: str) -> dict:
    return {"apiVersion": "tardigrade.dev/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": "tiny", "namespace": "ml"},
            "spec": spec(checkpoint={"path": path})}


def test_the_checkpoint_path_is_immutable_and_says_how_to_move(shared_api):
    old = _job("gs://bucket/tiny")
    moved = _job("gs://bucket/elsewhere")
    assert shared_api.validate(moved) == []  # a create has no old object
    causes = shared_api.validate(moved, old=old)
    assert [c.field for c in causes] == ["spec.checkpoint.path"]
    assert "immutable" in causes[0].message and "initFrom" in causes[0].message
    same = copy.deepcopy(old)
    same["spec"]["checkpoint"]["restoreStep"] = 5
    assert shared_api.validate(same, old=old) == []


def test_initfrom_must_name_another_root(shared_api):
    job = _job("gs://bucket/tiny")
    job["spec"]["checkpoint"]["initFrom"] = {"path": "gs://bucket/tiny"}
    with pytest.raises(ValidationError, match=r"initFrom\.path must differ"):
        TrainingJob.model_validate(job)
    assert [c.field for c in shared_api.validate(job)] == ["spec.checkpoint.initFrom.path"]


def test_a_missing_checkpoint_after_a_preemption_says_why_in_the_job_status():
    cluster = _running(FakeCluster(spec()))
    cluster.progress = contract.ProgressReport(step=30, checkpoint_step=30)
    cluster.reconcile()
    cluster.progress = None
    _preempt_and_relaunch(cluster, checkpoint=30)
    why = ("this launch must restore step 30 or newer (the newest checkpoint the operator saw "
           "committed) from gs://bucket/tiny, but it holds no committed step of its current line")
    message = contract.TerminationMessage(reason="CheckpointMissing", message=why).to_json()
    for pod in cluster.attempt_pods():
        cluster.terminate(pod, contract.EXIT_CHECKPOINT_CORRUPT, message)
    cluster.reconcile()
    assert cluster.status.phase == "Failed"
    condition = next(c for c in cluster.status.conditions if c.type == "Failed")
    assert condition.reason == "CannotRun"
    assert "(CheckpointMissing): " + why in condition.message
