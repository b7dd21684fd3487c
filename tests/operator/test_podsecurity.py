"""The Pod Security checker against upstream's own fixtures, and the operator's pods against it.

The fixtures (tests/operator/podsecurity_fixtures, README there) are upstream's
pod-security-admission test data: `<level>/<version>/fail/*.yaml` must be refused at that level
and `pass/*.yaml` admitted. Agreement with them, not our reading of the docs, is the test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from tardigrade_operator.decision.podsecurity import check_pod
from tardigrade_operator.rendering.manifests import GangLaunch, JobRef, build_pod

from tests.conftest import EXAMPLES, load_yaml

FIXTURES = Path(__file__).parent / "podsecurity_fixtures"
CASES = sorted(FIXTURES.glob("*/v*/*/*.yaml"))


def test_fixtures_cover_both_levels_and_verdicts():
    kinds = {(p.parts[-4], p.parts[-2]) for p in CASES}
    assert kinds == {("baseline", "pass"), ("baseline", "fail"), ("restricted", "pass"),
                     ("restricted", "fail")}
    assert len(CASES) >= 20


@pytest.mark.parametrize("path", CASES, ids=lambda p: "/".join(p.parts[-4:]))
def test_checker_agrees_with_upstream_fixture(path: Path):
    level, verdict = path.parts[-4], path.parts[-2]
    violations = check_pod(yaml.safe_load(path.read_text()), level)  # type: ignore[arg-type]
    if verdict == "pass":
        assert violations == [], [str(v) for v in violations]
    else:
        assert violations, f"{path.name}: admitted at {level}, upstream refuses it"


def test_privileged_level_admits_anything():
    pod = yaml.safe_load((FIXTURES / "baseline/v1.24/fail/privileged0.yaml").read_text())
    assert check_pod(pod, "privileged") == []


def test_apparmor_field_is_checked_as_well_as_the_annotation():
    # Since 1.30 AppArmor is a field; upstream's appArmorProfile check reads both.
    pod = yaml.safe_load((FIXTURES / "restricted/v1.34/pass/sysctls0.yaml").read_text())
    pod["spec"]["securityContext"]["appArmorProfile"] = {"type": "Unconfined"}
    pod["spec"]["containers"][0]["securityContext"]["appArmorProfile"] = {"type": "Unconfined"}
    fields = {v.field for v in check_pod(pod, "baseline")}
    assert fields == {"spec.securityContext.appArmorProfile.type",
                      "spec.containers[0].securityContext.appArmorProfile.type"}


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_rendered_pods_of_the_examples_are_restricted_or_tpu_baseline(path: Path):
    from tardigrade_operator.api.parse import parse_trainingjob

    job = parse_trainingjob(load_yaml(path))
    tpu = job.spec.accelerator.kind == "tpu"
    for rank in range(job.spec.replicas):
        pod = build_pod(JobRef("tiny", "default", "uid-1"), job.spec,
                        GangLaunch(attempt=1, replicas=job.spec.replicas, restore_step="latest"),
                        rank)
        assert check_pod(pod, "baseline") == []
        # TPU pods run as root, as GKE's TPU samples do (manifests.runs_as_root): exactly what
        # restricted forbids of that, nothing else.
        assert {v.check for v in check_pod(pod, "restricted")} == (
            {"runAsNonRoot", "runAsUser", "capabilities"} if tpu else set())
