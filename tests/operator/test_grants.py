"""The admin's allow lists (grants.py): what of its namespace a TrainingJob's pods may use."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from tardigrade_contract import contract
from tardigrade_operator.api.parse import parse_trainingjob
from tardigrade_operator.config import OperatorConfig
from tardigrade_operator.decision import grants
from tardigrade_operator.decision.admission import AdmissionPolicy, review
from tardigrade_operator.decision.grants import DEFAULT_VOLUME_TYPES, VOLUME_TYPES, Grants
from tardigrade_operator.rendering.manifests import (
    IN_PLACE_VOLUME,
    RENDEZVOUS_TOKEN_VOLUME,
    GangLaunch,
    JobRef,
    build_pod,
)

from tests.conftest import EXAMPLES, load_yaml

JOB = JobRef("tiny-gpt", "team-a", "uid-1")
DEFAULT = AdmissionPolicy()


def job_with(**pod_template: Any) -> Any:
    document = load_yaml(EXAMPLES / "trainingjob.yaml")
    document["spec"]["podTemplate"].update(copy.deepcopy(pod_template))
    return parse_trainingjob(document).spec


def fields(errors: list[Any]) -> list[str]:
    return [e.field for e in errors]


# Every core/v1 volume source the kubernetes client knows, generated, not listed by hand: a
# source added to core/v1 is refused until an admin allows it.
REFUSED_BY_DEFAULT = sorted(set(VOLUME_TYPES) - set(DEFAULT_VOLUME_TYPES) - {"secret"})


def test_the_generated_list_holds_what_baseline_leaves_open():
    assert {"nfs", "iscsi", "cephfs", "glusterfs", "rbd", "hostPath", "image"} <= set(
        REFUSED_BY_DEFAULT)


@pytest.mark.parametrize("kind", REFUSED_BY_DEFAULT)
def test_every_volume_type_not_allowed_is_refused_naming_the_field_and_the_fix(kind):
    spec = job_with(volumes=[{"name": "scratch", "emptyDir": {}}, {"name": "data", kind: {}}])
    errors = [e for e in review(JOB, spec, DEFAULT) if "admission.volumeTypes" in e.message]
    assert fields(errors) == [f"spec.podTemplate.volumes[1].{kind}"]
    assert f"volume type {kind} is not allowed by the cluster admin" in errors[0].message
    assert f"ask the cluster admin to add {kind}" in errors[0].message
    # Allowed, the list rule has nothing more to say (Pod Security may: its own rule).
    allowing = AdmissionPolicy(pod_security="privileged",
                               grants=Grants(volume_types=(*DEFAULT_VOLUME_TYPES, kind)))
    assert review(JOB, spec, allowing) == []


def test_the_default_volume_types_render_and_pass():
    spec = job_with(volumes=[
        {"name": "scratch", "emptyDir": {"medium": "Memory"}},
        {"name": "config", "configMap": {"name": "trainer-config"}},
        {"name": "meta", "downwardAPI": {"items": [{"path": "labels",
                                                   "fieldRef": {"fieldPath": "metadata.labels"}}]}},
        {"name": "ident", "projected": {"sources": [
            {"serviceAccountToken": {"path": "token", "audience": "vault"}},
            {"configMap": {"name": "trainer-config"}}]}},
        {"name": "data", "persistentVolumeClaim": {"claimName": "datasets"}},
        {"name": "fast", "ephemeral": {"volumeClaimTemplate": {"spec": {
            "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "10Gi"}}}}}},
        {"name": "bucket", "csi": {"driver": "gcsfuse.csi.storage.gke.io",
                                   "volumeAttributes": {"bucketName": "datasets"}}},
    ])
    assert review(JOB, spec, DEFAULT) == []
    pod = build_pod(JOB, spec, GangLaunch(attempt=0, replicas=2, restore_step="latest"), 0)
    assert [v["name"] for v in pod["spec"]["volumes"]][:7] == [
        "scratch", "config", "meta", "ident", "data", "fast", "bucket"]


def test_an_empty_volume_type_list_refuses_even_scratch_space():
    spec = job_with(volumes=[{"name": "scratch", "emptyDir": {}}])
    errors = review(JOB, spec, AdmissionPolicy(grants=Grants(volume_types=())))
    assert fields(errors) == ["spec.podTemplate.volumes[0].emptyDir"]
    assert "admission.volumeTypes: none" in errors[0].message


def test_the_operators_own_volumes_pass_and_are_exempt_by_name_only():
    spec = job_with()
    pod = build_pod(JOB, spec, GangLaunch(attempt=0, replicas=2, restore_step="latest",
                                          restart_in_place=True), 0)
    names = {v["name"] for v in pod["spec"]["volumes"]}
    assert {RENDEZVOUS_TOKEN_VOLUME, IN_PLACE_VOLUME} <= names
    strict = Grants(volume_types=())  # not even the kinds the operator's own volumes are
    assert grants.review(spec, pod, strict) == []
    # A volume the operator does not name as its own is checked like a user's.
    pod["spec"]["volumes"].append({"name": "keys", "secret": {"secretName": "tiny-gpt-keys"}})
    errors = grants.review(spec, pod, Grants())
    assert fields(errors) == ["spec (the operator's volume keys).secret.secretName"]
    # A user volume that borrows the operator's name is still the user's, and checked.
    spec = job_with(volumes=[{"name": IN_PLACE_VOLUME, "secret": {"secretName": "db"}}])
    assert fields(review(JOB, spec, DEFAULT)) == [
        "spec.podTemplate.volumes[0].secret.secretName"]


def test_the_operators_own_secret_env_passes_by_name_and_nothing_else_does():
    spec = job_with()
    pod = build_pod(JOB, spec, GangLaunch(attempt=0, replicas=2, restore_step="latest"), 0)
    env = pod["spec"]["containers"][0]["env"]
    for name in sorted(grants.OPERATOR_SECRET_ENV):
        env.append({"name": name, "valueFrom": {"secretKeyRef": {"name": "tiny-gpt-keys",
                                                                 "key": "k"}}})
    assert grants.review(spec, pod, Grants()) == []
    env.append({"name": contract.ENV_JOB_NAME + "_EXTRA",
                "valueFrom": {"secretKeyRef": {"name": "tiny-gpt-keys", "key": "k"}}})
    assert fields(grants.review(spec, pod, Grants())) == [
        f"spec (the operator's variable {contract.ENV_JOB_NAME}_EXTRA)"]


@pytest.mark.parametrize(("volume", "field"), [
    ({"secret": {"secretName": "db"}}, "secret.secretName"),
    ({"projected": {"sources": [{"secret": {"name": "db"}}]}}, "projected.sources[0].secret.name"),
    ({"csi": {"driver": "gcsfuse.csi.storage.gke.io", "nodePublishSecretRef": {"name": "db"}}},
     "csi.nodePublishSecretRef.name"),
    ({"cephfs": {"monitors": ["m:6789"], "secretRef": {"name": "db"}}}, "cephfs.secretRef.name"),
    ({"iscsi": {"targetPortal": "p:3260", "iqn": "iqn.2001-04.com.example:x", "lun": 0,
                "secretRef": {"name": "db"}}}, "iscsi.secretRef.name"),
    ({"rbd": {"monitors": ["m"], "image": "i", "secretRef": {"name": "db"}}},
     "rbd.secretRef.name"),
    ({"flexVolume": {"driver": "x/y", "secretRef": {"name": "db"}}}, "flexVolume.secretRef.name"),
    ({"azureFile": {"secretName": "db", "shareName": "s"}}, "azureFile.secretName"),
    ({"scaleIO": {"gateway": "g", "system": "s", "secretRef": {"name": "db"}}},
     "scaleIO.secretRef.name"),
    ({"storageos": {"volumeName": "v", "secretRef": {"name": "db"}}}, "storageos.secretRef.name"),
])
def test_every_way_a_volume_names_a_secret_is_checked(volume, field):
    kind = next(iter(volume))
    spec = job_with(volumes=[{"name": "v", **volume}])
    types = (*DEFAULT_VOLUME_TYPES, kind) if kind != "secret" else DEFAULT_VOLUME_TYPES
    lenient = Grants(volume_types=types)
    errors = review(JOB, spec, AdmissionPolicy(pod_security="privileged", grants=lenient))
    assert fields(errors) == [f"spec.podTemplate.volumes[0].{field}"]
    assert "Secret db is not allowed by the cluster admin (admission.secrets: none)" in (
        errors[0].message)
    allowed = Grants(volume_types=types, secrets=("db",))
    assert review(JOB, spec, AdmissionPolicy(pod_security="privileged", grants=allowed)) == []


def test_an_unset_service_account_is_the_namespaces_default():
    spec = job_with()
    assert review(JOB, spec, DEFAULT) == []
    only_trainer = AdmissionPolicy(grants=Grants(service_accounts=("trainer",)))
    errors = review(JOB, spec, only_trainer)
    assert fields(errors) == ["spec.podTemplate.serviceAccountName"]
    assert "service account default (unset: the namespace's default)" in errors[0].message
    assert "use one of trainer" in errors[0].message
    assert review(JOB, job_with(serviceAccountName="trainer"), only_trainer) == []


def test_system_priority_classes_stay_with_allow_system_scheduling():
    spec = job_with(priorityClassName="system-cluster-critical")
    errors = review(JOB, spec, DEFAULT)
    assert fields(errors) == ["spec.podTemplate.priorityClassName"]
    assert "allowSystemScheduling" in errors[0].message
    assert review(JOB, spec, AdmissionPolicy(allow_system_scheduling=True)) == []


def test_the_lists_reach_the_operator_from_its_environment(monkeypatch):
    monkeypatch.setenv("TARDIGRADE_ALLOWED_SERVICE_ACCOUNTS", '["default", "trainer"]')
    monkeypatch.setenv("TARDIGRADE_ALLOWED_SECRETS", '["hf-token"]')
    monkeypatch.setenv("TARDIGRADE_ALLOWED_VOLUME_TYPES", '["emptyDir", "nfs"]')
    monkeypatch.setenv("TARDIGRADE_ALLOWED_CSI_DRIVERS", "[]")
    monkeypatch.setenv("TARDIGRADE_ALLOWED_PRIORITY_CLASSES", '["team-high"]')
    assert OperatorConfig.from_env().admission.grants == Grants(
        service_accounts=("default", "trainer"), secrets=("hf-token",),
        volume_types=("emptyDir", "nfs"), csi_drivers=(), priority_classes=("team-high",))


def test_unset_lists_keep_the_defaults(monkeypatch):
    for env, _ in grants.SETTINGS.values():
        monkeypatch.delenv(env, raising=False)
    assert OperatorConfig.from_env().admission.grants == Grants()
    assert Grants().service_accounts == ("default",) and Grants().secrets == ()
    assert Grants().csi_drivers == ("gcsfuse.csi.storage.gke.io",)


@pytest.mark.parametrize(("env", "value", "says"), [
    ("TARDIGRADE_ALLOWED_SECRETS", "hf-token", "expected a JSON list of names"),
    ("TARDIGRADE_ALLOWED_SECRETS", '{"a": 1}', "expected a JSON list of names"),
    ("TARDIGRADE_ALLOWED_SERVICE_ACCOUNTS", '["../admin"]', "not a Kubernetes object name"),
    ("TARDIGRADE_ALLOWED_VOLUME_TYPES", '["NFS"]', "'NFS' is not a core/v1 volume type"),
    ("TARDIGRADE_ALLOWED_VOLUME_TYPES", '["secret"]', "in admission.secrets instead"),
])
def test_a_bad_list_stops_the_operator_naming_the_setting_and_the_chart_value(
        monkeypatch, env, value, says):
    monkeypatch.setenv(env, value)
    with pytest.raises(SystemExit) as info:
        OperatorConfig.from_env()
    message = str(info.value)
    assert env in message and says in message
    chart_value = next(v for e, v in grants.SETTINGS.values() if e == env)
    assert chart_value in message
