"""The bad-input corpus against the generated CRD, as kube-apiserver enforces it (its
structural schema, its CEL rules, its limits), through `dryRun=All`."""

from __future__ import annotations

import pytest
from tardigrade_operator.api.parse import parse_trainingjob

from tests.conftest import EXAMPLES, bad_trainingjob_cases, load_yaml

CASES = [case for case in bad_trainingjob_cases() if case.get("crd", True)]


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_pass_the_crd_schema(path, shared_api):
    assert shared_api.validate(load_yaml(path)) == []


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_crd_schema_rejects_bad_input_naming_the_field(case, shared_api):
    causes = shared_api.validate(case["document"])
    assert causes, "accepted by the CRD schema"
    field = case["field"]
    assert any(c.field == field or field in c.message for c in causes), [str(c) for c in causes]


@pytest.mark.parametrize("when_busy", ["skip", "wait"])
def test_memory_tier_when_busy_values_pass_the_crd_schema_and_the_models(when_busy, shared_api):
    document = load_yaml(EXAMPLES / "trainingjob.yaml")
    document["spec"]["checkpoint"]["memoryTier"] = {"interval": 5, "whenBusy": when_busy}
    assert shared_api.validate(document) == []
    assert parse_trainingjob(document).spec.checkpoint.memory_tier.when_busy == when_busy
