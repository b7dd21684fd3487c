"""The TrainingJob CRD (crds/trainingjob.yaml) served by the local API server to real kubectl.

Its columns and bounds are read from the CRD itself.
"""

from __future__ import annotations

import copy

import pytest
import yaml
from api_helpers import REPO, Kubectl, find_kubectls, kubectl_ids, require_kubectls, running_server
from tardigrade_local.apiserver import validate_custom_resource

CRD_FILE = REPO / "crds" / "trainingjob.yaml"


def load_crd() -> dict:
    return yaml.safe_load(CRD_FILE.read_text())


def storage_version(crd: dict) -> dict:
    return next(v for v in crd["spec"]["versions"] if v.get("storage"))


def example_job(crd: dict) -> dict:
    """The repository's example, or a minimal object built from the schema's required fields."""
    for path in sorted((REPO / "examples").glob("*.yaml")) if (REPO / "examples").exists() else []:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "TrainingJob":
                doc["metadata"].pop("namespace", None)
                return doc
    raise AssertionError("no TrainingJob example in examples/")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("tj"), crd_paths=[CRD_FILE]) as (srv, kc):
        srv.kubeconfig = kc  # type: ignore[attr-defined]
        yield srv


@pytest.fixture(params=find_kubectls() or [None], ids=kubectl_ids())
def kubectl(request, server):
    require_kubectls()
    return Kubectl(request.param, server.kubeconfig)


def test_examples_validate_clean():
    crd = load_crd()
    job = example_job(crd)
    assert validate_custom_resource(crd, job) == []


def test_get_shows_the_crd_printer_columns(kubectl):
    crd = load_crd()
    job = example_job(crd)
    job["metadata"]["name"] = f"cols-{'old' if kubectl.old else 'new'}"
    kubectl.apply(job)
    header = kubectl("get", "tj", job["metadata"]["name"]).splitlines()[0].split()
    columns = [c["name"].upper() for c in storage_version(crd)["additionalPrinterColumns"]
               if not c.get("priority")]
    assert header == ["NAME", *columns]


def test_bad_trainingjob_gets_the_real_error_text(kubectl):
    crd = load_crd()
    spec_schema = storage_version(crd)["schema"]["openAPIV3Schema"]["properties"]["spec"]
    minimum = spec_schema["properties"]["replicas"]["minimum"]
    bad = copy.deepcopy(example_job(crd))
    bad["metadata"]["name"] = "bad"
    bad["spec"]["replicas"] = minimum - 1
    err = kubectl.fails("apply", "-f", "-", input=yaml.safe_dump(bad))
    assert 'The TrainingJob "bad" is invalid' in err
    assert (f"spec.replicas: Invalid value: {minimum - 1}: spec.replicas in body should be "
            f"greater than or equal to {minimum}") in err
