"""Custom resource schema enforcement as a pure function: the real server's rules and text."""

from __future__ import annotations

from typing import Any

import pytest
from api_helpers import widget, widget_crd
from tardigrade_local.apiserver import default_and_prune, validate_custom_resource

CRD = widget_crd()


def messages(obj, old=None, strict=True):
    return [str(c) for c in validate_custom_resource(CRD, obj, old=old, strict=strict)]


def test_valid_object_has_no_errors():
    assert messages(widget("w", replicas=3, port="http", labels={"a": "b"})) == []
    assert messages(widget("w", port=8080)) == []


def test_bounds_enum_required_and_types_use_the_real_text():
    obj = widget("w", replicas=0, policy="Sometimes")
    del obj["spec"]["image"]
    got = messages(obj)
    assert "spec.image: Required value" in got
    assert ('spec.policy: Unsupported value: "Sometimes": supported values: "Always", "Never"'
            in got)
    assert ("spec.replicas: Invalid value: 0: spec.replicas in body should be greater than or "
            "equal to 1") in got
    assert messages(widget("w", replicas="three")) == [
        'spec.replicas: Invalid value: "string": spec.replicas in body must be of type '
        'integer: "string"']
    assert messages(widget("w", maxReplicas=101)) == [
        "spec.maxReplicas: Invalid value: 101: spec.maxReplicas in body should be less than or "
        "equal to 100"]


def test_strings_arrays_maps_and_exclusive_bounds():
    assert messages(widget("w", image="")) == [
        'spec.image: Invalid value: "": spec.image in body should be at least 1 chars long']
    assert messages(widget("w", image="x" * 65)) == [
        "spec.image: Too long: may not be more than 64 bytes"]
    assert messages(widget("w", args=["a", "b", "c", "d"])) == [
        "spec.args: Too many: 4: must have at most 3 items"]
    assert messages(widget("w", labels={"k": "123456789"})) == [
        "spec.labels.k: Too long: may not be more than 8 bytes"]
    assert messages(widget("w", resources={"cpu": 0})) == [
        "spec.resources.cpu: Invalid value: 0: spec.resources.cpu in body should be greater "
        "than 0"]
    assert messages(widget("w", volumes=[{"name": "a"}, {"name": "a"}])) == [
        'spec.volumes[1]: Duplicate value: {"name":"a"}']
    assert messages(widget("w", port=True)) == [
        'spec.port: Invalid value: "boolean": spec.port in body must be of type '
        'integer,string: "boolean"']


def test_defaults_and_pruning():
    obj = widget("w", unknown=1, extra={"anything": {"goes": True}})
    obj["spec"]["labels"] = None
    out = default_and_prune(CRD, obj)
    assert out["spec"]["replicas"] == 1
    assert out["spec"]["policy"] == "Always"
    assert "unknown" not in out["spec"]
    assert "labels" not in out["spec"]  # nulls of non-nullable fields are dropped
    assert out["spec"]["extra"] == {"anything": {"goes": True}}
    assert out["metadata"]["name"] == "w"
    assert obj["spec"]["unknown"] == 1  # the input is not modified


def test_strict_reports_unknown_fields_and_lenient_prunes_them():
    obj = widget("w", foo=1)
    obj["metadata"]["bogus"] = "x"
    assert sorted(messages(obj)) == ['metadata.bogus: unknown field "metadata.bogus"',
                                     'spec.foo: unknown field "spec.foo"']
    assert messages(obj, strict=False) == []


def test_cel_rules_with_message_and_transition_rules():
    assert messages(widget("w", replicas=20)) == [
        'spec: Invalid value: "object": replicas must not exceed maxReplicas']
    old = widget("w", image="a")
    assert messages(widget("w", image="b"), old=old) == [
        'spec: Invalid value: "object": image is immutable']
    # Transition rules are skipped on create (no oldSelf).
    assert messages(widget("w", image="b")) == []


def test_cel_default_message_and_message_expression():
    crd = widget_crd()
    rules = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "x-kubernetes-validations"]
    rules.append({"rule": "self.replicas != 7"})
    rules.append({"rule": "self.replicas != 8",
                  "messageExpression": "'replicas may not be ' + string(self.replicas)"})
    got = [str(c) for c in validate_custom_resource(crd, widget("w", replicas=7))]
    assert got == ['spec: Invalid value: "object": failed rule: self.replicas != 7']
    got = [str(c) for c in validate_custom_resource(crd, widget("w", replicas=8))]
    assert got == ['spec: Invalid value: "object": replicas may not be 8']


def test_cel_is_skipped_when_types_are_wrong():
    got = messages(widget("w", replicas="many", maxReplicas=1))
    assert len(got) == 1 and "must be of type integer" in got[0]


def test_causes_carry_field_reason_and_message():
    (cause,) = validate_custom_resource(CRD, widget("w", replicas=0))
    assert cause.field == "spec.replicas"
    assert cause.reason == "FieldValueInvalid"
    assert cause.message == ("Invalid value: 0: spec.replicas in body should be greater than or "
                             "equal to 1")


def test_metadata_declared_in_the_schema_is_not_pruned():
    # Regression: a root schema with `metadata: {type: object}` (as generated CRDs have) made
    # metadata.namespace and labels look like unknown fields.
    crd = widget_crd()
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["metadata"] = {
        "type": "object"}
    obj = widget("w")
    obj["metadata"]["labels"] = {"a": "b"}
    assert validate_custom_resource(crd, obj) == []
    assert default_and_prune(crd, obj)["metadata"] == obj["metadata"]


def test_root_rules_see_metadata_name():
    crd = widget_crd()
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["x-kubernetes-validations"] = [
        {"rule": "size(self.metadata.name) <= 5", "message": "name too long",
         "fieldPath": ".metadata.name"},
        {"rule": "self.spec.replicas < 9", "message": "too many"}]
    got = [str(c) for c in validate_custom_resource(crd, widget("toolong", replicas=9))]
    # A rule on the root object without fieldPath reports the nil path, as the server does.
    assert got == ['metadata.name: Invalid value: "object": name too long',
                   '<nil>: Invalid value: "object": too many']


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The rules the API server interprets from now on, one entry per evaluation (its cache of
    outcomes emptied first)."""
    from tardigrade_local.apiserver import crd_schema

    crd_schema._evaluate.cache_clear()
    rules: list[str] = []
    program = crd_schema._program

    class Counting:
        def __init__(self, rule: str) -> None:
            self.rule, self.program = rule, program(rule)

        def evaluate(self, activation: Any) -> Any:
            rules.append(self.rule)
            return self.program.evaluate(activation)

    monkeypatch.setattr(crd_schema, "_program", Counting)
    return rules


def test_unchanged_values_are_not_interpreted_again(interpreted):
    """A status write re-checks the spec's rules on an unchanged spec: CEL is pure, so the
    outcome is reused, and the errors stay what a fresh evaluation gives."""
    old = widget("w", replicas=20)
    first = messages(widget("w", replicas=20), old=old)
    count = len(interpreted)
    assert count > 0
    new = widget("w", replicas=20)
    new["status"] = {"phase": "Running"}
    assert messages(new, old=old) == first == [
        'spec: Invalid value: "object": replicas must not exceed maxReplicas']
    assert len(interpreted) == count
    # A changed value is interpreted anew.
    assert messages(widget("w", replicas=3), old=old) == []
    assert len(interpreted) > count


def test_a_root_rule_is_not_interpreted_again_when_only_what_it_does_not_read_changed(
        interpreted):
    crd = widget_crd()
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["x-kubernetes-validations"] = [
        {"rule": "size(self.metadata.name) <= 5", "message": "name too long"},
        {"rule": "size(self) > 0", "message": "reads the whole object"}]
    for phase in ("A", "B"):
        obj = widget("toolong")
        obj["status"] = {"phase": phase}
        got = [str(c) for c in validate_custom_resource(crd, obj, old=widget("toolong"))]
        assert got == ['<nil>: Invalid value: "object": name too long']
    assert interpreted.count("size(self.metadata.name) <= 5") == 1
    assert interpreted.count("size(self) > 0") == 2  # self as a whole: the status is read
