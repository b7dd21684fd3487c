"""The chart's life cycle with the real helm against a local cluster of real nodes: `helm
upgrade` updates the TrainingJob CRD, and `helm uninstall` keeps it (and every TrainingJob).

No operator runs (replicaCount=0): these tests are about what helm does to the CRD. The
uninstall hook does run, as a pod of the registry's operator image on the real node; every
helm call, the old chart's included, points the chart at that image."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from tardigrade_local.realcluster import RealNodeCluster, plan_nodes

from tests.chart.test_helm import CHART, _helm
from tests.e2e.harness import NEEDS_REAL_NODES, Cluster, trainingjob, wait_for

pytestmark = [
    pytest.mark.slow,
    NEEDS_REAL_NODES,
]

OLD_CHART = Path(__file__).parent / "fixtures" / "tardigrade-0.1.0"
CRD = "trainingjobs.tardigrade.dev"
RELEASE, NAMESPACE = "tardigrade", "tardigrade-system"
# No operator: these tests are about what helm does to the CRD.
NO_OPERATOR = ("--set", "replicaCount=0")
HOOK = f"{RELEASE}-uninstall"


class HelmCluster(Cluster):
    """The control plane of a real-node cluster, and the helm values that point a chart at
    the registry's operator image."""

    def __init__(self, real: RealNodeCluster) -> None:
        # The chart grants trainers TokenReview itself.
        super().__init__(real.cluster, trainer_token_review=False)
        self.image_values = real.operator_image_values()
        self.operator_image = real.images["operator"]


def run_helm(cluster: HelmCluster, *args: str, check: bool = True
             ) -> subprocess.CompletedProcess:
    if args[0] in ("install", "upgrade"):
        args = (*args, *cluster.image_values)
    # The uninstall hook's pod pulls the operator image on a machine other runs share.
    result = subprocess.run([_helm(), *args], env=cluster.env, capture_output=True, text=True,
                            timeout=420)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def chart_with_new_field(tmp_path: Path) -> Path:
    """The current chart with one more (string) field in the TrainingJob spec schema, as the
    next API change would add."""
    chart = tmp_path / "tardigrade"
    shutil.copytree(CHART, chart)
    crd_file = chart / "files" / "crds" / "trainingjob.yaml"
    crd = yaml.safe_load(crd_file.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["properties"]["addedLater"] = {"type": "string"}
    crd_file.write_text(yaml.safe_dump(crd))
    return chart


def store_job(cluster: Cluster, name: str) -> dict[str, Any]:
    """Create a job that sets the new field (the client sends no field validation, so an
    older schema prunes it silently, as it does for any client) and read it back."""
    job = trainingjob(name, steps=3, replicas=1, addedLater="hello")
    cluster.custom.create_namespaced_custom_object(
        "tardigrade.dev", "v1alpha1", "default", "trainingjobs", job)
    return cluster.job(name) or {}


def crd_meta(cluster: Cluster) -> dict[str, Any]:
    return yaml.safe_load(cluster.kubectl("get", "crd", CRD, "-o", "yaml"))["metadata"]


def hook_started(cluster: HelmCluster) -> bool:
    """The kubelet reported the uninstall hook's container, of the registry's operator image,
    pulled and started (its pod is deleted once it succeeded; its events stay)."""
    events = cluster.core.list_namespaced_event(
        NAMESPACE, field_selector=f"involvedObject.name={HOOK}").items
    return any(e.reason == "Started" for e in events) and any(
        e.reason == "Pulled" and cluster.operator_image in (e.message or "") for e in events)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HelmCluster]:
    # The repository's CRDs are not preloaded: helm installs them, as on a real cluster. One
    # on-demand node, for the uninstall hook.
    with RealNodeCluster(tmp_path_factory.mktemp("upg"), plan_nodes(1, 0), gcs=False) as real:
        cluster = HelmCluster(real)
        cluster.kubectl("create", "namespace", NAMESPACE)
        yield cluster


def test_upgrade_from_a_crds_dir_install_updates_the_crd_and_uninstall_keeps_it(
        cluster: HelmCluster, tmp_path: Path):
    run_helm(cluster, "install", RELEASE, str(OLD_CHART), "-n", NAMESPACE, *NO_OPERATOR)
    assert "addedLater" not in store_job(cluster, "before")["spec"]
    # Helm installed it from crds/: Helm does not own it, so an upgrade that renders it from
    # templates refuses to take it over...
    refused = run_helm(cluster, "upgrade", RELEASE, str(CHART), "-n", NAMESPACE, *NO_OPERATOR,
                       check=False)
    assert refused.returncode != 0
    assert "meta.helm.sh/release-name" in refused.stderr, refused.stderr
    # ...until it is handed over, as docs/gke.md says.
    cluster.kubectl("label", "crd", CRD, "app.kubernetes.io/managed-by=Helm")
    cluster.kubectl("annotate", "crd", CRD, f"meta.helm.sh/release-name={RELEASE}",
                    f"meta.helm.sh/release-namespace={NAMESPACE}")
    run_helm(cluster, "upgrade", RELEASE, str(CHART), "-n", NAMESPACE, *NO_OPERATOR)
    assert crd_meta(cluster)["annotations"]["helm.sh/resource-policy"] == "keep"

    # From now on every upgrade carries the CRD as the models change.
    run_helm(cluster, "upgrade", RELEASE, str(chart_with_new_field(tmp_path)), "-n", NAMESPACE,
             *NO_OPERATOR)
    assert store_job(cluster, "after")["spec"]["addedLater"] == "hello"

    run_helm(cluster, "uninstall", RELEASE, "-n", NAMESPACE, "--timeout", "400s")
    # Its pre-delete hook ran on the node, from the registry's image.
    wait_for(lambda: hook_started(cluster), 60, "the uninstall hook's Started event",
             interval=1)
    assert crd_meta(cluster)["name"] == CRD
    assert {"before", "after"} <= {j["metadata"]["name"] for j in cluster.custom.
                                   list_namespaced_custom_object(
                                       "tardigrade.dev", "v1alpha1", "default",
                                       "trainingjobs")["items"]}

