"""The bad-input corpus against the generated CRD, as kube-apiserver enforces it (its
structural schema, its CEL rules, its limits), through `dryRun=All`."""

from __future__ import annotations

import pytest

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
