"""The generated CRD: checked in, structural, valid for a real API server."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import celpy
import kubernetes_validate
import pytest
import yaml
from tardigrade_operator.api.crd import build_crd, render_crd_yaml

from tests.conftest import CRD_FILE, REPO_ROOT

CRD = build_crd()
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]
VALUE_ONLY = {"type", "description", "default", "additionalProperties", "nullable",
              "x-kubernetes-preserve-unknown-fields", "properties", "items"}


def test_checked_in_crd_matches_the_models():
    assert CRD_FILE.read_text() == render_crd_yaml(), (
        "crds/trainingjob.yaml is stale: run `tardigrade crd -o crds/trainingjob.yaml`"
    )


def test_cli_prints_the_same_crd():
    env_path = ":".join(str(REPO_ROOT / d) for d in ("operator", "trainer_image", "local_cluster"))
    result = subprocess.run(
        [sys.executable, "-m", "tardigrade_operator.cli", "crd"],
        capture_output=True, text=True, check=True, env={"PYTHONPATH": env_path},
    )
    assert result.stdout == CRD_FILE.read_text()


def test_crd_is_a_valid_apiextensions_v1_object():
    # Validates against the published Kubernetes OpenAPI schema of CustomResourceDefinition.
    kubernetes_validate.validate(
        yaml.safe_load(CRD_FILE.read_text()), kubernetes_validate.latest_version(), strict=True
    )


def _walk(node: dict[str, Any], path: str = ""):
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural():
    problems = []
    for path, node in _walk(SCHEMA):
        special = node.get("x-kubernetes-int-or-string") or node.get(
            "x-kubernetes-preserve-unknown-fields"
        )
        if "type" not in node and not special:
            problems.append(f"{path}: no type")
        if "$ref" in node or "$defs" in node:
            problems.append(f"{path}: $ref")
        if "properties" in node and "additionalProperties" in node:
            problems.append(f"{path}: properties and additionalProperties together")
        if node.get("additionalProperties") is False:
            problems.append(f"{path}: additionalProperties false")
        for keyword in ("anyOf", "allOf", "oneOf"):
            for option in node.get(keyword, []):
                if node.get("x-kubernetes-int-or-string") and option in (
                    {"type": "integer"}, {"type": "string"}
                ):
                    continue
                if set(option) & VALUE_ONLY:
                    problems.append(f"{path}: {keyword} may only hold value validations")
        if node.get("type") == "null" or ("nullable" in node and not node["nullable"]):
            problems.append(f"{path}: null type")
    meta = SCHEMA["properties"]["metadata"]
    assert set(meta.get("properties", {})) <= {"name", "generateName"}
    assert problems == []


def test_every_cel_rule_compiles_and_names_a_real_field():
    env = celpy.Environment()
    rules = 0
    for _path, node in _walk(SCHEMA):
        for rule in node.get("x-kubernetes-validations", []):
            env.compile(rule["rule"])
            rules += 1
            assert rule["message"]
            field = rule.get("fieldPath")
            if field:
                target = node
                for part in field.lstrip(".").split("."):
                    target = target["properties"][part]
    assert rules >= 10


def test_defaults_enums_and_bounds_are_published():
    spec = SCHEMA["properties"]["spec"]["properties"]
    assert spec["replicas"]["minimum"] == 1
    assert spec["replicas"]["default"] == 1
    assert spec["accelerator"]["properties"]["kind"]["enum"] == ["cpu", "nvidia-gpu", "tpu"]
    assert spec["checkpoint"]["properties"]["interval"]["properties"]["seconds"][
        "exclusiveMinimum"
    ] is True
    assert spec["trainer"]["x-kubernetes-preserve-unknown-fields"] is True
    status = SCHEMA["properties"]["status"]["properties"]
    assert status["phase"]["enum"] == [
        "Pending", "Queued", "Running", "Restarting", "Resizing", "Suspended", "Succeeded",
        "Failed"
    ]
    assert set(status["restarts"]["properties"]) == {
        "preemptions", "failures", "resizes", "retries", "rejections", "migrations", "total",
        "consecutiveRetries", "consecutiveRejections",
    }


def test_names_subresources_and_printer_columns():
    names = CRD["spec"]["names"]
    assert (CRD["spec"]["group"], VERSION["name"]) == ("tardigrade.dev", "v1alpha1")
    assert (names["kind"], names["plural"], names["shortNames"]) == (
        "TrainingJob", "trainingjobs", ["tj"]
    )
    scale = VERSION["subresources"]["scale"]
    assert VERSION["subresources"]["status"] == {}
    for key in ("specReplicasPath", "statusReplicasPath", "labelSelectorPath"):
        _resolve(scale[key])
    columns = {c["name"]: c for c in VERSION["additionalPrinterColumns"]}
    assert {"Replicas", "Phase", "Step", "Checkpoint", "Restarts", "Age"} <= set(columns)
    for column in columns.values():
        if not column["jsonPath"].startswith(".metadata"):
            _resolve(column["jsonPath"])


def _resolve(json_path: str) -> dict[str, Any]:
    node = SCHEMA
    for part in json_path.lstrip(".").split("."):
        node = node["properties"][part]
    return node


@pytest.mark.parametrize("column", ["Phase", "Step"])
def test_printer_columns_point_at_status(column):
    columns = {c["name"]: c for c in VERSION["additionalPrinterColumns"]}
    assert columns[column]["jsonPath"].startswith(".status.")


def test_field_reference_is_generated_from_the_models():
    from tardigrade_operator.api.reference import render_reference

    text = (REPO_ROOT / "docs" / "reference.md").read_text()
    assert text == render_reference(), (
        "docs/reference.md is stale: run `tardigrade reference -o docs/reference.md`"
    )
    for field in ("spec.replicas", "spec.checkpoint.path", "spec.failurePolicy.maxPreemptions",
                  "status.recoveries[].stepsLost"):
        assert f"`{field}`" in text


def test_chart_ships_the_generated_crds():
    chart = REPO_ROOT / "charts" / "tardigrade"
    # The TrainingJob CRD is rendered from templates/crds.yaml so `helm upgrade` updates it;
    # a copy left in crds/ would be installed twice, and never upgraded.
    assert sorted(p.name for p in (chart / "crds").iterdir()) == ["kopf-peering.yaml"]
    assert (chart / "crds" / "kopf-peering.yaml").read_text() == (
        REPO_ROOT / "crds" / "kopf-peering.yaml").read_text()
    assert (chart / "files" / "crds" / "trainingjob.yaml").read_text() == CRD_FILE.read_text(), (
        "the chart's CRD is stale: run `tardigrade crd -o crds/trainingjob.yaml` and copy it to "
        "charts/tardigrade/files/crds/trainingjob.yaml"
    )
