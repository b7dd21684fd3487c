"""The Argo CD health check (Lua), run under Lua 5.1 as Argo CD's gopher-lua runs it.

The cases in health_test.yaml follow Argo CD's resource_customizations layout; the scenario
test feeds the script statuses the operator's decide() writes now, so the two cannot drift.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from lupa import lua51
from tardigrade_contract import contract

from tests.conftest import REPO_ROOT
from tests.operator.fake_cluster import FakeCluster, spec

CHECK = REPO_ROOT / "docs" / "argocd" / "tardigrade.dev" / "TrainingJob"
SAVED = contract.EXIT_PREEMPTED_SAVED


def health(obj: dict[str, Any]) -> tuple[str, str]:
    lua = lua51.LuaRuntime()
    lua.globals().obj = lua.table_from(obj, recursive=True)
    result = lua.execute((CHECK / "health.lua").read_text())
    return result.status, result.message


def _cases() -> list[dict[str, Any]]:
    return yaml.safe_load((CHECK / "health_test.yaml").read_text())["tests"]


@pytest.mark.parametrize("case", _cases(), ids=lambda c: Path(c["inputPath"]).stem)
def test_argocd_style_cases(case):
    obj = yaml.safe_load((CHECK / case["inputPath"]).read_text())
    assert health(obj) == (case["healthStatus"]["status"], case["healthStatus"]["message"])


def _job(cluster: FakeCluster) -> dict[str, Any]:
    return {"apiVersion": "tardigrade.dev/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": "tiny", "namespace": "ml", "generation": cluster.generation},
            "spec": cluster.spec,
            "status": cluster.status.model_dump(by_alias=True, exclude_none=True, mode="json")}


def test_health_through_a_job_life_as_the_operator_writes_it():
    cluster = FakeCluster(spec())
    seen = []
    cluster.reconcile()
    seen.append(health(_job(cluster))[0])
    cluster.run_all()
    cluster.reconcile()
    seen.append(health(_job(cluster))[0])
    cluster.disrupt(cluster.attempt_pods()[0])
    cluster.reconcile()
    seen.append(health(_job(cluster))[0])
    cluster.terminate_all(SAVED, step=5, checkpoint=5)
    cluster.reconcile()
    cluster.run_all()
    cluster.reconcile()
    seen.append(health(_job(cluster))[0])
    cluster.spec["suspend"] = True
    cluster.generation += 1
    seen.append(health(_job(cluster))[0])  # not yet observed by the operator
    cluster.reconcile()
    cluster.terminate_all(SAVED, step=9, checkpoint=9)
    cluster.reconcile()
    seen.append(health(_job(cluster))[0])
    assert seen == ["Progressing", "Healthy", "Progressing", "Healthy", "Progressing",
                    "Suspended"]


def test_a_job_that_cannot_run_is_degraded_with_the_reason():
    cluster = FakeCluster(spec(replicas=0))
    cluster.reconcile()
    status, message = health(_job(cluster))
    assert status == "Degraded"
    assert message.startswith("InvalidSpec: ") and "spec.replicas" in message
