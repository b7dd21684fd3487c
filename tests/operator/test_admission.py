"""The admin's admission policy: TrainingJobs the schema accepts but the operator refuses."""

from __future__ import annotations

import json
from typing import Any

import pytest
from tardigrade_operator.api.parse import parse_trainingjob
from tardigrade_operator.decision.admission import AdmissionPolicy, review
from tardigrade_operator.decision.grants import SETTINGS
from tardigrade_operator.rendering.manifests import JobRef

from tests.conftest import EXAMPLES, corpus_cases, load_yaml

CASES = corpus_cases("forbidden_trainingjobs.yaml")
JOB = JobRef("tiny-gpt", "team-a", "uid-1")
# The corpus is refused by the strictest policy; the default (baseline) lets TPU pods run as
# root, as GKE's TPU samples do.
STRICT = AdmissionPolicy(pod_security="restricted")
DEFAULT = AdmissionPolicy()
# Chart value (under admission.) -> the operator setting the chart's deployment sets from it.
LISTS = {value.removeprefix("admission."): env for env, value in SETTINGS.values()}


def policy_from_chart_values(values: dict[str, Any]) -> AdmissionPolicy:
    """The policy an operator installed with these admission.* chart values runs under, read
    the way the operator reads its environment."""
    return AdmissionPolicy.parse(
        values.get("podSecurity", "baseline"),
        str(values.get("allowSystemScheduling", False)).lower(),
        {LISTS[k]: json.dumps(v) for k, v in values.items() if k in LISTS})


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_the_strict_policy_refuses_naming_the_field(case):
    spec = parse_trainingjob(case["document"]).spec  # the schema accepts it
    errors = review(JOB, spec, STRICT)
    matching = [e for e in errors if e.field == case["field"]]
    assert matching, [str(e) for e in errors]
    assert any(case["says"] in e.message for e in matching), [str(e) for e in matching]
    # Every message says who can allow it.
    assert all("ask the cluster admin" in e.message for e in errors)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_the_admin_can_allow_it(case):
    spec = parse_trainingjob(case["document"]).spec
    assert review(JOB, spec, policy_from_chart_values(case["allowed_at"])) == []


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_pass_the_default_policy_with_the_trainer_account_docs_gke_sets_up(path):
    assert DEFAULT.pod_security == "baseline"
    # The GKE examples run as the Workload Identity account `trainer` (docs/gke.md), which the
    # admin allows; nothing else in them needs more than the defaults.
    gke = policy_from_chart_values({"serviceAccounts": ["default", "trainer"]})
    assert review(JOB, parse_trainingjob(load_yaml(path)).spec, gke) == []


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_restricted_admits_cpu_and_gpu_pods_and_says_why_not_tpu(path):
    spec = parse_trainingjob(load_yaml(path)).spec
    errors = review(JOB, spec, policy_from_chart_values(
        {"podSecurity": "restricted", "serviceAccounts": ["default", "trainer"]}))
    if spec.accelerator.kind != "tpu":
        assert errors == []
        return
    # One error, on the field that makes the pod run as root, naming what to ask for.
    assert [e.field for e in errors] == ["spec.accelerator.kind"]
    assert "GKE's TPU samples" in errors[0].message
    assert "ask the cluster admin for baseline" in errors[0].message


@pytest.mark.parametrize(("level", "flag", "says"), [
    ("root", "false", "TARDIGRADE_POD_SECURITY='root': expected one of privileged, baseline"),
    ("restricted", "yes", "TARDIGRADE_ALLOW_SYSTEM_SCHEDULING='yes': expected true or false"),
])
def test_bad_settings_name_the_setting(level, flag, says):
    with pytest.raises(ValueError, match=says):
        AdmissionPolicy.parse(level, flag)


def test_the_operator_fails_a_forbidden_job_as_an_invalid_spec():
    from types import SimpleNamespace

    from tardigrade_operator.config import OperatorConfig
    from tardigrade_operator.observation import observe
    from tardigrade_operator.observation.job_memory import JobState

    case = next(c for c in CASES if c["name"] == "hostPath volume")
    memo = SimpleNamespace(config=OperatorConfig())
    meta = {"generation": 1, "uid": "uid-1"}
    spec, error = observe.parsed_spec(("team-a", "tiny-gpt"), meta, case["document"], memo.config,
                                        JobState())
    assert spec is None
    assert error is not None and "spec.podTemplate.volumes[0].hostPath" in error
    permissive = SimpleNamespace(config=OperatorConfig(admission=policy_from_chart_values(
        case["allowed_at"])))
    spec, error = observe.parsed_spec(("team-a", "tiny-gpt"), meta, case["document"],
                                        permissive.config, JobState())
    assert spec is not None and error is None
