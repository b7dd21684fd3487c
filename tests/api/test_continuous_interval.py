"""spec.checkpoint.interval.continuous: the API's checks and the pods' environment (the
trainer's side: tests/trainer/test_continuous_saving.py)."""

from __future__ import annotations

import pytest
from tardigrade_contract import contract
from tardigrade_operator.api.parse import InvalidTrainingJob, parse_trainingjob
from tardigrade_operator.rendering.manifests import GangLaunch, JobRef, build_pod

from tests.conftest import EXAMPLES, load_yaml
from tests.operator.fake_cluster import pod_env


def _manifest(interval: dict) -> dict:
    manifest = load_yaml(EXAMPLES / "trainingjob.yaml")
    manifest["spec"]["checkpoint"]["interval"] = interval
    return manifest


def test_the_trainingjob_asks_for_continuous_saving_and_its_pods_get_the_budget():
    spec = parse_trainingjob(_manifest({"continuous": {"maxLoopFraction": 0.1}})).spec
    pod = build_pod(JobRef(name="gpt", namespace="ml", uid="0d3c"), spec,
                    GangLaunch(1, 2, "latest"), rank=0)
    env = contract.TrainerEnvironment.from_env(pod_env(pod))
    assert env.checkpoint_continuous_max_loop_fraction == 0.1
    assert env.checkpoint_interval_steps is None and env.checkpoint_interval_seconds is None
    default = parse_trainingjob(_manifest({"continuous": {}})).spec
    assert default.checkpoint.interval.continuous.max_loop_fraction == 0.05


@pytest.mark.parametrize(("interval", "names"), [
    ({"steps": 10, "continuous": {}}, "checkpoint.interval.continuous replaces steps and seconds"),
    ({"continuous": {"maxLoopFraction": 0.8}}, "maxLoopFraction"),
    ({"continuous": {"maxLoopFraction": 0}}, "maxLoopFraction"),
])
def test_a_continuous_interval_that_cannot_run_is_refused_naming_the_field(interval, names):
    with pytest.raises(InvalidTrainingJob, match=names):
        parse_trainingjob(_manifest(interval))
