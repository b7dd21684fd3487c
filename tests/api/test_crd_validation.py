"""The bad-input corpus against the generated CRD schema, as the API server enforces it."""

from __future__ import annotations

import pytest
import yaml
from tardigrade_local.apiserver import validate_custom_resource

from tests.conftest import CRD_FILE, EXAMPLES, bad_trainingjob_cases, load_yaml

CRD = yaml.safe_load(CRD_FILE.read_text())
CASES = [case for case in bad_trainingjob_cases() if case.get("crd", True)]


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_pass_the_crd_schema(path):
    assert validate_custom_resource(CRD, load_yaml(path)) == []


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_crd_schema_rejects_bad_input_naming_the_field(case):
    causes = validate_custom_resource(CRD, case["document"])
    assert causes, "accepted by the CRD schema"
    field = case["field"]
    assert any(c.field == field or field in c.message for c in causes), [str(c) for c in causes]
