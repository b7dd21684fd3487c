"""The status write is conditional on the resourceVersion the decision was made on."""

from __future__ import annotations

import kubernetes
import pytest
import yaml
from tardigrade_operator.api.types import TrainingJobStatus
from tardigrade_operator.apply.kube import ClusterWriter, StaleStatus
from tardigrade_operator.decision.plan import Plan

from tests.conftest import EXAMPLES


@pytest.fixture
def writer(shared_api):
    namespace = shared_api.new_namespace("status")
    job = yaml.safe_load((EXAMPLES / "trainingjob.yaml").read_text())
    kubernetes.client.CustomObjectsApi(shared_api.api).create_namespaced_custom_object(
        "tardigrade.dev", "v1alpha1", namespace, "trainingjobs", job)
    return ClusterWriter(shared_api.api), namespace


def counted(preemptions: int) -> TrainingJobStatus:
    status = TrainingJobStatus(attempt=preemptions + 1)
    status.restarts.preemptions = status.restarts.total = preemptions
    return status


def test_a_plan_decided_on_a_stale_status_is_refused(writer):
    writer, ns = writer
    read = writer.read_job(ns, "tiny-gpt")["metadata"]["resourceVersion"]
    written = writer.apply(ns, "tiny-gpt", TrainingJobStatus(), Plan(counted(1)), read)
    assert written is not None and int(written) > int(read)
    # Our answer was lost and the watch is behind: deciding again on the status read before
    # the write would count the same preemption a second time.
    with pytest.raises(StaleStatus):
        writer.apply(ns, "tiny-gpt", TrainingJobStatus(), Plan(counted(2)), read)
    job = writer.read_job(ns, "tiny-gpt")
    assert job["status"]["restarts"]["preemptions"] == 1
    assert job["metadata"]["resourceVersion"] == written
    writer.apply(ns, "tiny-gpt", counted(1), Plan(counted(2)), written)
    assert writer.read_job(ns, "tiny-gpt")["status"]["restarts"]["preemptions"] == 2
