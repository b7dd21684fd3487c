"""The operator's reading of a TrainingJob's spec, fuzzed: whatever a spec holds (any JSON
at any field, types the schema does not expect, numbers and strings at their edges, a trainer
config as deep as the API server stores), reading it ends in a spec or in field errors that
name the field, never in another exception (which would fail every reconcile pass of the
job, and only that job, forever, without telling its owner why)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from tardigrade_contract import boundedjson
from tardigrade_operator.api.parse import InvalidTrainingJob, parse_spec
from tardigrade_operator.decision import admission
from tardigrade_operator.rendering import tpu_layout
from tardigrade_operator.rendering.manifests import JobRef

from tests.conftest import EXAMPLES
from tests.fuzz import CHEAP, deep_json, json_values

pytestmark = pytest.mark.fuzz

BASE = yaml.safe_load((EXAMPLES / "trainingjob.yaml").read_text())["spec"]
JOB = JobRef(name="fuzzed", namespace="ml", uid="uid-1")


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, child in value.items():
            found += _paths(child, (*prefix, key))
    return found


PATHS = _paths(BASE) + [("podTemplate", k) for k in (
    "env", "volumes", "volumeMounts", "tolerations", "nodeSelector", "annotations", "labels",
    "securityContext", "affinity", "priorityClassName")] + [
    ("accelerator",), ("preemption",), ("networkPolicy",), ("suspend",), ("restartInPlace",),
    ("checkpoint", "initFrom"), ("maxReplicas",)]


def read(spec: dict[str, Any]) -> None:
    """What observation.observe.parsed_spec does with a job's spec."""
    try:
        parsed = parse_spec(spec)
    except InvalidTrainingJob as err:
        assert err.errors and all(e.field.startswith("spec") for e in err.errors)
        return
    for error in admission.review(JOB, parsed, admission.AdmissionPolicy()):
        assert str(error)
    tpu_layout.job_name_error(JOB.name, parsed)


@CHEAP
@given(st.lists(st.tuples(st.sampled_from(PATHS), json_values(8)), min_size=1, max_size=4))
def test_any_value_at_any_field_is_read_or_named(changes):
    spec = copy.deepcopy(BASE)
    for path, value in changes:
        target = spec
        for key in path[:-1]:
            if not isinstance(target.get(key), dict):
                target[key] = {}
            target = target[key]
        target[path[-1]] = value
    read(spec)


@CHEAP
@given(deep_json(min_depth=90))
def test_a_trainer_config_as_deep_as_the_api_server_stores_is_named(deep):
    text, depth = deep
    spec = copy.deepcopy(BASE)
    spec["trainer"] = {"deep": boundedjson.loads(text)}
    if depth + 1 <= 100:
        read(spec)
        return
    with pytest.raises(InvalidTrainingJob) as caught:
        parse_spec(spec)
    assert f"spec.trainer: the trainer config is nested {depth + 1} levels deep" in str(
        caught.value)
