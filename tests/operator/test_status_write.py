"""The status write is conditional on the resourceVersion the decision was made on."""

from __future__ import annotations

import kubernetes
import pytest
import yaml
from tardigrade_operator.api.types import TrainingJobStatus
from tardigrade_operator.decide import Plan
from tardigrade_operator.kube import ClusterWriter, StaleStatus

from tests.conftest import CRD_FILE, EXAMPLES
from tests.local.api_helpers import running_server


@pytest.fixture
def writer(tmp_path):
    with running_server(tmp_path, crd_paths=[CRD_FILE]) as (_, kubeconfig):
        client = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        job = yaml.safe_load((EXAMPLES / "trainingjob.yaml").read_text())
        kubernetes.client.CustomObjectsApi(client).create_namespaced_custom_object(
            "tardigrade.dev", "v1alpha1", "default", "trainingjobs", job)
        yield ClusterWriter(client)


def counted(preemptions: int) -> TrainingJobStatus:
    status = TrainingJobStatus(attempt=preemptions + 1)
    status.restarts.preemptions = status.restarts.total = preemptions
    return status


def test_a_plan_decided_on_a_stale_status_is_refused(writer):
    read = writer.read_job("default", "tiny-gpt")["metadata"]["resourceVersion"]
    written = writer.apply("default", "tiny-gpt", TrainingJobStatus(), Plan(counted(1)), read)
    assert written is not None and int(written) > int(read)
    # Our answer was lost and the watch is behind: deciding again on the status read before
    # the write would count the same preemption a second time.
    with pytest.raises(StaleStatus):
        writer.apply("default", "tiny-gpt", TrainingJobStatus(), Plan(counted(2)), read)
    job = writer.read_job("default", "tiny-gpt")
    assert job["status"]["restarts"]["preemptions"] == 1
    assert job["metadata"]["resourceVersion"] == written
    writer.apply("default", "tiny-gpt", counted(1), Plan(counted(2)), written)
    assert writer.read_job("default", "tiny-gpt")["status"]["restarts"]["preemptions"] == 2
