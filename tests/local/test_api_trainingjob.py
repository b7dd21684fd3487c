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


def multislice_job(name: str) -> dict:
    """examples/gke-tpu-multislice.yaml: 2 slices of TPU v5e 2x4, 2 hosts of 4 chips each."""
    job = yaml.safe_load((REPO / "examples" / "gke-tpu-multislice.yaml").read_text())
    job["metadata"] = {"name": name}
    return job


def test_tpu_job_of_partial_slices_is_refused_naming_the_field_and_fix(kubectl):
    name = f"partial-{'old' if kubectl.old else 'new'}"
    bad = multislice_job(name)
    bad["spec"]["replicas"] = 3
    err = kubectl.fails("apply", "-f", "-", input=yaml.safe_dump(bad))
    assert f'The TrainingJob "{name}" is invalid' in err
    assert ('spec.replicas: Invalid value: "object": spec.replicas (3) is not a whole number of '
            'TPU slices: it counts hosts (so does kubectl scale --replicas), and one 2x4 slice '
            'is 2 hosts of 4 chips; set spec.replicas to a multiple of 2') in err
    bad["spec"].update(replicas=4, minReplicas=1)
    err = kubectl.fails("apply", "-f", "-", input=yaml.safe_dump(bad))
    assert "spec.minReplicas (1) is not a whole number of TPU slices" in err
    assert "set spec.minReplicas to a multiple of 2" in err


def test_kubectl_scale_counts_hosts_in_whole_slices(kubectl):
    name = f"scaled-{'old' if kubectl.old else 'new'}"
    job = multislice_job(name)
    job["spec"].update(minReplicas=2, maxReplicas=6)
    kubectl.apply(job)
    # /scale reads and writes spec.replicas: hosts, 2 a slice here.
    scale = kubectl.get_json("tj", name) if kubectl.old else yaml.safe_load(
        kubectl("get", "tj", name, "--subresource=scale", "-o", "yaml"))
    assert scale["spec"]["replicas"] == 4
    err = kubectl.fails("scale", "tj", name, "--replicas=5")
    assert "spec.replicas (5) is not a whole number of TPU slices" in err
    assert "set spec.replicas to a multiple of 2" in err
    assert kubectl("get", "tj", name, "-o", "jsonpath={.spec.replicas}") == "4"
    kubectl("scale", "tj", name, "--replicas=6")  # a third slice
    assert kubectl("get", "tj", name, "-o", "jsonpath={.spec.replicas}") == "6"
    kubectl("scale", "tj", name, "--replicas=2")  # down to one slice, minReplicas
    assert kubectl("get", "tj", name, "-o", "jsonpath={.spec.replicas}") == "2"
