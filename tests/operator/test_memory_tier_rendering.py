"""spec.checkpoint.memoryTier: validated with the field named, rendered as a tmpfs volume, the
contract's variables, the replica port and a key from the job's Secret (docs/memory-tier.md)."""

from __future__ import annotations

import json
from typing import get_args

import pytest
from tardigrade_contract import contract
from tardigrade_operator.api import types
from tardigrade_operator.api.parse import InvalidTrainingJob, parse_spec
from tardigrade_operator.decision.admission import AdmissionPolicy, review
from tardigrade_operator.rendering.manifests import GangLaunch, build_pod

from tests.operator.fake_cluster import JOB, KEYS, pod_env, spec


def pod_of(memory_tier: dict | None, rank: int = 1) -> dict:
    checkpoint = {"path": "gs://bucket/tiny", "interval": {"steps": 100}}
    if memory_tier is not None:
        checkpoint["memoryTier"] = memory_tier
    parsed = parse_spec(spec(checkpoint=checkpoint))
    return build_pod(JOB, parsed, GangLaunch(attempt=3, replicas=2, restore_step="latest"), rank)


def test_the_memory_tier_is_a_memory_volume_the_trainer_is_told_about():
    pod = pod_of({"interval": 5, "sizeLimit": "8Gi"})
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["tardigrade-memory-tier"] == {
        "name": "tardigrade-memory-tier", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}}
    container = pod["spec"]["containers"][0]
    assert {"name": "tardigrade-memory-tier", "mountPath": contract.MEMORY_TIER_VOLUME_PATH} in \
        container["volumeMounts"]
    env = pod_env(pod)
    assert env[contract.ENV_MEMORY_TIER_DIR] == contract.MEMORY_TIER_VOLUME_PATH
    assert env[contract.ENV_MEMORY_TIER_INTERVAL] == "5"
    assert env[contract.ENV_MEMORY_TIER_REPLICAS] == "1"
    assert env[contract.ENV_REPLICA_PORT] == str(contract.DEFAULT_REPLICA_PORT)
    assert {"name": "replicas", "containerPort": contract.DEFAULT_REPLICA_PORT} in \
        container["ports"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]
            if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]}
    assert refs[contract.ENV_REPLICA_KEY] == {"name": "tiny-tardigrade-keys",
                                              "key": contract.SECRET_CACHE_KEY}
    assert not any(value in json.dumps(pod) for value in KEYS.data().values())
    # What the trainer reads back: the contract round-trips.
    back = contract.TrainerEnvironment.from_env({**env, contract.ENV_REPLICA_KEY: "k" * 43})
    assert (back.memory_tier_interval, back.memory_tier_replicas,
            back.memory_tier_dir) == (5, 1, contract.MEMORY_TIER_VOLUME_PATH)


def test_without_replicas_no_port_and_no_key_and_without_the_tier_nothing():
    pod = pod_of({"interval": 5, "replicas": 0})
    names = {e["name"] for e in pod["spec"]["containers"][0]["env"]}
    assert contract.ENV_REPLICA_KEY not in names and contract.ENV_MEMORY_TIER_INTERVAL in names
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "tardigrade-memory-tier")
    assert volume["emptyDir"] == {"medium": "Memory"}
    assert len(pod["spec"]["containers"][0]["ports"]) == 2
    plain = pod_of(None)
    assert "tardigrade-memory-tier" not in json.dumps(plain)
    assert not any(e["name"].startswith("TARDIGRADE_MEMORY_TIER")
                   for e in plain["spec"]["containers"][0]["env"])


@pytest.mark.parametrize(("when_busy", "rendered"), [
    (None, contract.MEMORY_TIER_SKIP),  # the default, rendered too
    ("skip", contract.MEMORY_TIER_SKIP),
    ("wait", contract.MEMORY_TIER_WAIT),
])
def test_when_busy_reaches_the_trainer(when_busy, rendered):
    memory_tier = {"interval": 5} if when_busy is None else {"interval": 5,
                                                             "whenBusy": when_busy}
    env = pod_env(pod_of(memory_tier))
    assert env[contract.ENV_MEMORY_TIER_WHEN_BUSY] == rendered
    back = contract.TrainerEnvironment.from_env({**env, contract.ENV_REPLICA_KEY: "k" * 43})
    assert back.memory_tier_when_busy == rendered


def test_when_busy_takes_the_contracts_values():
    annotation = types.MemoryTierSpec.model_fields["when_busy"].annotation
    assert get_args(annotation) == (contract.MEMORY_TIER_SKIP, contract.MEMORY_TIER_WAIT)


@pytest.mark.parametrize(("memory_tier", "field", "says"), [
    ({"interval": 5, "whenBusy": "sometimes"}, "spec.checkpoint.memoryTier.whenBusy",
     "'skip' or 'wait' (got 'sometimes')"),
    ({"interval": 5, "whenBusy": "Wait"}, "spec.checkpoint.memoryTier.whenBusy",
     "'skip' or 'wait'"),
    ({"interval": 5, "whenBusy": True}, "spec.checkpoint.memoryTier.whenBusy",
     "'skip' or 'wait'"),
    ({"interval": 0}, "spec.checkpoint.memoryTier.interval", "greater than or equal to 1"),
    ({"interval": 100}, "spec.checkpoint.memoryTier.interval",
     "must be smaller than checkpoint.interval.steps"),
    ({"interval": 5, "replicas": -1}, "spec.checkpoint.memoryTier.replicas", "greater than"),
    ({"interval": 5, "sizeLimit": "lots"}, "spec.checkpoint.memoryTier.sizeLimit", "quantity"),
    ({"replicas": 1}, "spec.checkpoint.memoryTier.interval", "required"),
])
def test_bad_memory_tier_names_the_field(memory_tier, field, says):
    with pytest.raises(InvalidTrainingJob) as info:
        pod_of(memory_tier)
    text = str(info.value)
    assert field in text and says.lower() in text.lower(), text


def test_the_trainer_refuses_replicas_without_a_key():
    env = {contract.ENV_NUM_PROCESSES: "2", contract.ENV_PROCESS_ID: "0",
           contract.ENV_CHECKPOINT_PATH: "/ckpt", contract.ENV_MEMORY_TIER_INTERVAL: "5",
           contract.ENV_MEMORY_TIER_DIR: "/mem"}
    with pytest.raises(contract.ContractError, match=contract.ENV_REPLICA_KEY):
        contract.TrainerEnvironment.from_env(env)
    with pytest.raises(contract.ContractError, match=contract.ENV_MEMORY_TIER_DIR):
        contract.TrainerEnvironment.from_env({**env, contract.ENV_MEMORY_TIER_DIR: "",
                                              contract.ENV_REPLICA_KEY: "k" * 43})


def test_the_memory_tier_passes_restricted_with_no_volume_or_secret_granted():
    # The tier's volume and key are the operator's own additions, exempt by name like the
    # restart-in-place folder; a tmpfs emptyDir is allowed under Pod Security restricted.
    parsed = parse_spec(spec(checkpoint={"path": "gs://bucket/tiny", "interval": {"steps": 100},
                                         "memoryTier": {"interval": 5, "sizeLimit": "4Gi"}}))
    policy = AdmissionPolicy.parse("restricted", "false",
                                   {"TARDIGRADE_ALLOWED_VOLUME_TYPES": json.dumps(["projected"])})
    assert review(JOB, parsed, policy) == []
    # A user's own memory volume gets no such pass.
    own = spec(checkpoint={"path": "gs://bucket/tiny"}, podTemplate={
        "volumes": [{"name": "scratch", "emptyDir": {"medium": "Memory"}}]})
    assert [e.field for e in review(JOB, parse_spec(own), policy)] == [
        "spec.podTemplate.volumes[0].emptyDir"]
