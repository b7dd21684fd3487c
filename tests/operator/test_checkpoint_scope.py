"""Checkpoint paths: what the API refuses outright, and the admin's per-namespace prefix."""

from __future__ import annotations

import pytest
from tardigrade_operator.api.parse import InvalidTrainingJob, parse_spec
from tardigrade_operator.config import OperatorConfig
from tardigrade_operator.observation.observed import DecisionSettings

from tests.operator.fake_cluster import FakeCluster, spec

PREFIX = "gs://ml-checkpoints/{namespace}/"  # the fake cluster's job lives in namespace "ml"


@pytest.mark.parametrize(("path", "says"), [
    ("gs://bucket/", "names a whole bucket"),
    ("gs://bucket/runs/../../other", "'..' segments"),
    ("/mnt/./ckpt", "'.' or '..' segments"),
    ("///", "may not be /"),
    ("/sys/fs/cgroup", "/proc, /sys or /dev"),
    ("/dev", "/proc, /sys or /dev"),
    ("/dev/shm/ckpt", "/proc, /sys or /dev"),
    ("gs://bucket/run\x00", "NUL"),
    ("/mnt/ckpt/run\x7f", "NUL or other control characters"),
])
def test_paths_outside_a_job_of_its_own_are_refused(path, says):
    with pytest.raises(InvalidTrainingJob) as info:
        parse_spec(spec(checkpoint={"path": path}))
    assert [e.field for e in info.value.errors] == ["spec.checkpoint.path"]
    assert says in info.value.errors[0].message


@pytest.mark.parametrize("path", ["gs://bucket/runs/a", "/mnt/ckpt/a", "/devices/ckpt",
                                  "/mnt/..ckpt/a", "gs://bucket/a..b/c"])
def test_ordinary_paths_pass(path):
    assert parse_spec(spec(checkpoint={"path": path})).checkpoint.path == path


def scoped(path: str, namespace_prefix: str | None = PREFIX, **overrides: object
           ) -> FakeCluster:
    checkpoint = {"path": path, **overrides.pop("checkpoint", {})}  # type: ignore[dict-item]
    return FakeCluster(spec(checkpoint=checkpoint, **overrides),
                       settings=DecisionSettings(checkpoint_path_prefix=namespace_prefix))


def refused_before_any_pod(cluster: FakeCluster) -> str:
    """The InvalidSpec message of a job that failed for its paths without a pod."""
    plan = cluster.reconcile()
    assert plan.create_pods == [] and plan.create_service is None
    assert cluster.status.phase == "Failed"
    condition = {c.type: c for c in cluster.status.conditions}["InvalidSpec"]
    assert (condition.status, condition.reason) == ("True", "CheckpointPathNotAllowed")
    return condition.message


@pytest.mark.parametrize("path", ["gs://ml-checkpoints/other-team/tiny",
                                  "gs://ml-checkpoints/mlx/tiny",  # not a prefix of "ml/"
                                  "gs://ml-checkpoints/ml/",
                                  "/mnt/ckpt/ml/tiny"])
def test_a_path_outside_the_namespace_prefix_fails_the_job_before_any_pod(path):
    cluster = scoped(path)
    plan = cluster.reconcile()
    assert plan.create_pods == [] and plan.create_service is None
    assert cluster.status.phase == "Failed"
    conditions = {c.type: c for c in cluster.status.conditions}
    assert conditions["InvalidSpec"].status == "True"
    assert conditions["InvalidSpec"].reason == "CheckpointPathNotAllowed"
    assert "only paths under gs://ml-checkpoints/ml/" in conditions["InvalidSpec"].message
    assert [e.reason for e in plan.events if e.type == "Warning"] == ["CheckpointPathNotAllowed"]


def test_a_path_inside_the_namespace_prefix_runs():
    cluster = scoped("gs://ml-checkpoints/ml/tiny")
    plan = cluster.reconcile()
    assert len(plan.create_pods) == 2 and cluster.status.phase == "Pending"
    assert scoped("gs://anywhere/tiny", None).reconcile().create_pods


OWN = "gs://ml-checkpoints/ml/tiny"


@pytest.mark.parametrize("path", ["gs://ml-checkpoints/other-team/tiny",  # another namespace's
                                  "gs://ml-checkpoints/mlx/tiny",
                                  "gs://elsewhere/tiny", "/mnt/ckpt/ml/tiny"])
def test_a_job_cannot_start_from_another_namespaces_checkpoint(path):
    message = refused_before_any_pod(scoped(OWN, checkpoint={"initFrom": {"path": path}}))
    assert message.startswith(f"spec.checkpoint.initFrom.path {path!r} is outside")
    assert "change spec.checkpoint.initFrom.path" in message


def test_a_job_may_start_from_its_own_namespaces_checkpoints():
    cluster = scoped(OWN, checkpoint={"initFrom": {"path": "gs://ml-checkpoints/ml/base"}})
    assert len(cluster.reconcile().create_pods) == 2


@pytest.mark.parametrize("cache", ["gs://ml-checkpoints/other-team/cache",
                                   "gs://shared-cache/jax",
                                   "/tmp/jax-cache",  # a path, not under the prefix
                                   "relative/cache",
                                   "gs://ml-checkpoints/ml/../other-team/cache",
                                   "gs://ml-checkpoints/ml/./x"])
def test_the_compilation_cache_must_lie_under_the_prefix_too(cache):
    message = refused_before_any_pod(scoped(OWN, trainer={"compilation_cache_dir": cache}))
    assert message.startswith(f"spec.trainer.compilation_cache_dir {cache!r} is outside")
    assert "only paths under gs://ml-checkpoints/ml/" in message


@pytest.mark.parametrize("trainer", [{"compilation_cache_dir": "gs://ml-checkpoints/ml/cache"},
                                     {"compilation_cache_dir": None},  # the trainer's default
                                     {"compilation_cache_dir": 7},  # the trainer refuses it
                                     {}])
def test_a_cache_under_the_prefix_or_none_at_all_runs(trainer):
    assert len(scoped(OWN, trainer=trainer).reconcile().create_pods) == 2


def test_every_path_outside_is_named_at_once():
    cluster = scoped("gs://elsewhere/tiny", checkpoint={"initFrom": {"path": "gs://bkt/base"}},
                     trainer={"compilation_cache_dir": "gs://bkt/cache"})
    message = refused_before_any_pod(cluster)
    for field in ("spec.checkpoint.path", "spec.checkpoint.initFrom.path",
                  "spec.trainer.compilation_cache_dir"):
        assert f"change {field}" in message


def test_without_the_rule_any_path_runs():
    cluster = scoped("gs://anywhere/tiny", None, checkpoint={"initFrom": {"path": "/mnt/b"}},
                     trainer={"compilation_cache_dir": "/tmp/cache"})
    assert len(cluster.reconcile().create_pods) == 2


def test_the_rule_applies_to_running_jobs_too():
    cluster = scoped("gs://elsewhere/tiny", None)
    cluster.reconcile()
    cluster.run_all()
    cluster.reconcile()
    assert cluster.status.phase == "Running"
    cluster.settings = DecisionSettings(checkpoint_path_prefix=PREFIX)
    plan = cluster.reconcile()
    assert sorted(name for name, _ in plan.delete_pods) == ["tiny-a1-0", "tiny-a1-1"]
    assert cluster.status.phase == "Failed"


@pytest.mark.parametrize(("value", "says"), [
    ("gs://bucket/teams/", "must contain {namespace}"),
    ("gs://bucket/{namespace}", "must end with '/'"),
    ("bucket/{namespace}/", "gs:// URI or an absolute path"),
])
def test_a_bad_prefix_setting_stops_the_operator_naming_it(monkeypatch, value, says):
    monkeypatch.setenv("TARDIGRADE_CHECKPOINT_PATH_PREFIX", value)
    with pytest.raises(SystemExit, match="TARDIGRADE_CHECKPOINT_PATH_PREFIX") as info:
        OperatorConfig.from_env()
    assert says in str(info.value)


def test_the_prefix_setting_reaches_the_decisions(monkeypatch):
    monkeypatch.setenv("TARDIGRADE_CHECKPOINT_PATH_PREFIX", PREFIX)
    settings = OperatorConfig.from_env().decision_settings()
    assert settings.checkpoint_path_prefix == PREFIX
