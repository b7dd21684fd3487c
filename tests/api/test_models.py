"""The pydantic models: examples parse, defaults fill in, bad input is explained per field."""

from __future__ import annotations

import pytest
from tardigrade_operator.api.parse import InvalidTrainingJob, parse_spec, parse_trainingjob
from tardigrade_operator.api.types import TrainingJobStatus

from tests.conftest import EXAMPLES, bad_trainingjob_cases, load_yaml

CASES = bad_trainingjob_cases()


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_parse(path):
    job = parse_trainingjob(load_yaml(path))
    assert job.spec.checkpoint.path
    assert job.spec.replicas >= 1


def test_defaults_are_filled_in(example_job):
    spec = parse_spec({"image": "trainer:1", "checkpoint": {"path": "/ckpt"}})
    assert spec.replicas == 1
    assert spec.accelerator.kind == "cpu"
    assert spec.checkpoint.interval.steps == 100
    assert spec.checkpoint.keep.last == 3
    assert spec.checkpoint.save_on_preemption is True
    assert spec.failure_policy.max_restarts == 3
    assert spec.failure_policy.max_preemptions is None
    assert spec.pod_template.termination_grace_period_seconds == 30
    # GKE spot: regular pods get 15 s of the 30 s notice (the rest is for system pods).
    assert spec.preemption.shutdown_window_seconds == 15
    assert spec.spot.enabled is False
    assert spec.spot.node_selector == {"cloud.google.com/gke-spot": "true"}


def test_wire_names_are_camel_case(example_job):
    job = parse_trainingjob(example_job)
    wire = job.model_dump(by_alias=True, exclude_none=True, mode="json")
    assert wire["spec"]["minReplicas"] == 1
    assert wire["spec"]["checkpoint"]["saveOnPreemption"] is True
    assert wire["spec"]["failurePolicy"]["backoffSeconds"] == 2
    # Round trip: what we write is what we read.
    assert parse_trainingjob(wire) == job


def test_status_round_trips_with_timestamps():
    status = TrainingJobStatus.model_validate(
        {
            "phase": "Running",
            "startTime": "2026-12-02T12:00:00Z",
            "lastCheckpoint": {"step": 40, "time": "2026-12-02T12:05:00Z", "path": "gs://b/x"},
            "recoveries": [
                {"cause": "Preemption", "time": "2026-12-02T12:06:00Z", "attempt": 1,
                 "downtimeSeconds": 12.5, "stepsLost": 0}
            ],
        }
    )
    wire = status.model_dump(by_alias=True, exclude_none=True, mode="json")
    assert wire["startTime"] == "2026-12-02T12:00:00Z"
    assert wire["recoveries"][0]["downtimeSeconds"] == 12.5
    assert TrainingJobStatus.model_validate(wire) == status


def test_status_rejects_unknown_phase():
    with pytest.raises(ValueError, match="phase"):
        TrainingJobStatus.model_validate({"phase": "Exploded"})


def test_corpus_is_large_enough():
    assert len(CASES) >= 25


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_bad_input_names_field_and_fix(case):
    with pytest.raises(InvalidTrainingJob) as info:
        parse_trainingjob(case["document"])
    errors = info.value.errors
    matching = [e for e in errors if e.field == case["field"]]
    assert matching, f"no error for {case['field']}: {[str(e) for e in errors]}"
    assert any(case["says"] in e.message for e in matching), [str(e) for e in matching]
    # The rendered exception text carries the field too, for CLI users.
    assert case["field"] in str(info.value)
