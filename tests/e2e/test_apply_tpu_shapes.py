"""`kubectl apply` against the cluster's API server with the CRD as shipped: TPU jobs GKE cannot
run are refused, naming the field and the fix; the examples still apply. Server-side dry run,
so nothing is stored and no operator is needed."""

from __future__ import annotations

import copy
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from tardigrade_local.cluster import LocalCluster

from tests.conftest import EXAMPLES, REPO_ROOT, load_yaml

pytestmark = pytest.mark.slow

KUBECTL = REPO_ROOT / ".ci" / "cache" / "kubectl"


@pytest.fixture(scope="module")
def kubeconfig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    if not KUBECTL.exists():
        pytest.skip("no kubectl in .ci/cache (scripts/setup installs it)")
    # No node: a server-side dry run needs the API server and the CRD only.
    with LocalCluster(tmp_path_factory.mktemp("apply") / "cluster", nodes=0,
                      with_gcs=False) as cluster:
        _kubectl(cluster.kubeconfig, ["create", "namespace", "ml"])
        yield cluster.kubeconfig


def _kubectl(kubeconfig: Path, args: list[str], stdin: str | None = None
             ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(KUBECTL), *args], input=stdin, capture_output=True, text=True,
                          env={**os.environ, "KUBECONFIG": str(kubeconfig)}, timeout=60)


def _apply(kubeconfig: Path, document: dict) -> subprocess.CompletedProcess[str]:
    return _kubectl(kubeconfig, ["apply", "--dry-run=server", "-f", "-"],
                    stdin=yaml.safe_dump(document))


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_the_examples_still_apply(kubeconfig, path):
    result = _apply(kubeconfig, load_yaml(path))
    assert result.returncode == 0, result.stderr
    assert "(server dry run)" in result.stdout


def _tpu_job(accelerator: dict, replicas: int = 2, **spec: int) -> dict:
    document = copy.deepcopy(load_yaml(EXAMPLES / "gke-tpu-v5e.yaml"))
    document["spec"].update(accelerator=accelerator, replicas=replicas, **spec)
    return document


V5E = {"kind": "tpu", "type": "tpu-v5-lite-podslice"}


@pytest.mark.parametrize(("document", "field", "fix"), [
    # count below the VM's chips: two ranks would share a VM, the hostnames list 4 hosts
    (_tpu_job({**V5E, "topology": "2x4", "count": 2}, replicas=4), "spec.accelerator.count",
     "set it to 4 (ct5lp-hightpu-4t, 2 hosts a slice) or 8 (ct5lp-hightpu-8t, 1 host a slice)"),
    (_tpu_job({**V5E, "topology": "2x4"}), "spec.accelerator.count",
     "accelerator.count is required"),
    (_tpu_job({**V5E, "topology": "3x3", "count": 1}, replicas=1), "spec.accelerator.topology",
     "use 1x1, 2x2, 2x4, 4x4, 4x8, 8x8, 8x16, 16x16"),
    (_tpu_job({"kind": "tpu", "type": "tpu-v5p-slice", "topology": "8x4x4", "count": 4},
              replicas=32), "spec.accelerator.topology", "A <= B <= C"),
    # two single-host slices: GKE's Multislice joins multi-host slices only
    (_tpu_job({**V5E, "topology": "2x4", "count": 8}), "spec.replicas",
     "set spec.replicas to 1, or ask for a multi-host slice"),
    (_tpu_job({**V5E, "topology": "2x4", "count": 4}, replicas=3), "spec.replicas",
     "whole number of TPU slices"),
], ids=["count-below-the-vm", "count-missing", "topology-not-offered", "v5p-sides-unordered",
        "multislice-of-single-hosts", "half-a-slice"])
def test_kubectl_apply_refuses_a_tpu_shape_gke_cannot_run(kubeconfig, document, field, fix):
    result = _apply(kubeconfig, document)
    assert result.returncode != 0, result.stdout
    assert field in result.stderr and fix in result.stderr, result.stderr
