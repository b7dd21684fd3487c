"""The job's keys (keys.py): one Secret per job, owned by it, read by its pods through
secretKeyRef only; made again when missing; never taken over from someone else."""

from __future__ import annotations

import base64
import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from kubernetes.client.exceptions import ApiException
from tardigrade_contract import contract
from tardigrade_operator import handlers
from tardigrade_operator.apply.kube import ClusterWriter, KeysSecretTaken
from tardigrade_operator.decision.decide import decide
from tardigrade_operator.observation import observe
from tardigrade_operator.observation.job_memory import JobState
from tardigrade_operator.observation.observed import DecisionSettings
from tardigrade_operator.observation.pods import PodView, parse_pod
from tardigrade_operator.observation.progress import fetch_progress
from tardigrade_operator.rendering import keys
from tardigrade_operator.rendering.manifests import JobRef
from tardigrade_operator.rendering.netpolicy import NetworkPeers

from tests.operator.fake_cluster import JOB, KEYS, FakeCluster, spec

SECRET = "tiny-tardigrade-keys"
PEERS = NetworkPeers(operator_namespace="tardigrade-system",
                     operator_pod_labels={"app.kubernetes.io/name": "tardigrade-operator"})


def running(settings: DecisionSettings | None = None) -> FakeCluster:
    cluster = FakeCluster(spec(), settings=settings or DecisionSettings())
    cluster.reconcile()
    cluster.run_all()
    cluster.reconcile()
    assert cluster.status.phase == "Running"
    return cluster


def decoded(secret: dict[str, Any]) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


def test_the_secret_holds_three_keys_and_is_owned_by_the_job():
    secret = keys.build_keys_secret(JOB, KEYS)
    assert secret["kind"] == "Secret" and secret["type"] == "Opaque"
    assert secret["metadata"]["name"] == SECRET and secret["metadata"]["namespace"] == "ml"
    assert secret["metadata"]["labels"] == {"app.kubernetes.io/managed-by": "tardigrade",
                                            "tardigrade.dev/job": "tiny"}
    assert secret["metadata"]["ownerReferences"] == [{
        "apiVersion": "tardigrade.dev/v1alpha1", "kind": "TrainingJob", "name": "tiny",
        "uid": "uid-1", "controller": True, "blockOwnerDeletion": True}]
    assert decoded(secret) == {contract.SECRET_RESTART_KEY: KEYS.restart_key,
                               contract.SECRET_PROGRESS_TOKEN: KEYS.progress_token,
                               contract.SECRET_CACHE_KEY: KEYS.cache_key}
    assert keys.read_keys(secret) == KEYS


def test_fresh_keys_are_random_and_never_printed():
    one, two = keys.JobKeys.fresh(), keys.JobKeys.fresh()
    assert len({*one.data().values(), *two.data().values()}) == 6
    assert all(len(v) >= 43 for v in one.data().values())  # 32 bytes, URL-safe base64
    assert one.restart_key not in repr(one) and one.restart_key not in f"{one}"


@pytest.mark.parametrize("data", [
    {}, {"restart-key": "cg==", "progress-token": "cA=="},
    {"restart-key": "cg==", "progress-token": "cA==", "cache-key": ""},
    {"restart-key": "cg==", "progress-token": "cA==", "cache-key": "not base64!"},
    {"restart-key": "cg==", "progress-token": "cA==", "cache-key": 7},
], ids=["empty", "a key missing", "a key empty", "not base64", "not a string"])
def test_a_secret_that_cannot_serve_the_pods_yields_no_keys(data):
    assert keys.read_keys({"data": data}) is None


@pytest.mark.parametrize("in_place", [True, False])
def test_pods_get_the_keys_by_secret_key_ref_and_never_as_values(in_place):
    cluster = FakeCluster(spec(), settings=DecisionSettings(restart_in_place=in_place))
    plan = cluster.reconcile()
    assert plan.create_keys_secret is not None and len(plan.create_pods) == 2
    for pod in plan.create_pods:
        text = json.dumps(pod)
        assert not any(value in text for value in KEYS.data().values())
        env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
        expected = {contract.ENV_PROGRESS_TOKEN: contract.SECRET_PROGRESS_TOKEN,
                    contract.ENV_CACHE_KEY: contract.SECRET_CACHE_KEY}
        if in_place:
            expected[contract.ENV_RESTART_KEY] = contract.SECRET_RESTART_KEY
        for name, key in expected.items():
            assert env[name] == {"name": name, "valueFrom": {
                "secretKeyRef": {"name": SECRET, "key": key}}}
        assert (contract.ENV_RESTART_KEY in env) is in_place
        assert parse_pod(pod).restart_keyed is in_place


def test_a_literal_restart_key_does_not_count_as_the_job_s():
    """Only the job's Secret feeds a restart request: a pod whose env names the key by value
    (made by an older operator, or by hand) gets none."""
    cluster = FakeCluster(spec(), settings=DecisionSettings(restart_in_place=True))
    pod = cluster.reconcile().create_pods[0]
    for var in pod["spec"]["containers"][0]["env"]:
        if var["name"] == contract.ENV_RESTART_KEY:
            var.pop("valueFrom")
            var["value"] = "typed-in"
    assert not parse_pod(pod).restart_keyed


def test_the_secret_is_created_before_the_first_pod_and_only_once():
    cluster = FakeCluster(spec())
    plan = cluster.reconcile()
    assert plan.create_keys_secret == keys.build_keys_secret(JOB, KEYS) and plan.create_pods
    assert cluster.reconcile().create_keys_secret is None


def test_a_missing_secret_service_and_policy_are_made_again_on_the_next_pass():
    cluster = running(DecisionSettings(network_peers=PEERS))
    assert cluster.reconcile().create_network_policy is None
    cluster.keys_secret = cluster.service = cluster.network_policy = None
    plan = cluster.reconcile()
    # With the values the running pods hold (those the operator knows: fake_cluster.KEYS).
    assert plan.create_keys_secret == keys.build_keys_secret(JOB, KEYS)
    assert plan.create_service is not None
    assert plan.create_network_policy["metadata"]["name"] == "tiny-gang"
    assert cluster.status.phase == "Running" and not plan.delete_pods and not plan.create_pods
    assert cluster.reconcile().create_network_policy is None


def test_only_the_policy_gone_is_made_again_alone():
    cluster = running(DecisionSettings(network_peers=PEERS))
    cluster.network_policy = None
    plan = cluster.reconcile()
    assert plan.create_network_policy is not None
    assert plan.create_service is None and plan.create_keys_secret is None


def _foreign(owner_refs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": SECRET, "namespace": "ml"}
    if owner_refs is not None:
        meta["ownerReferences"] = owner_refs
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta,
            "data": {"restart-key": "cg==", "progress-token": "cA==", "cache-key": "Yw=="}}


def test_someone_else_s_secret_of_that_name_fails_the_job_with_the_fix():
    cluster = FakeCluster(spec(), keys_secret=_foreign())
    plan = cluster.reconcile()
    assert plan.create_pods == [] and plan.create_keys_secret is None
    assert cluster.status.phase == "Failed"
    failed = next(c for c in cluster.status.conditions if c.type == "Failed")
    assert failed.reason == "SecretNameTaken"
    assert f"Secret ml/{SECRET}" in failed.message and "no owner" in failed.message
    assert f"kubectl delete secret -n ml {SECRET}" in failed.message


def test_a_secret_taken_mid_run_stops_the_gang():
    cluster = running()
    cluster.keys_secret = _foreign([{"apiVersion": "v1", "kind": "ConfigMap", "name": "x",
                                     "uid": "c-1"}])
    plan = cluster.reconcile()
    assert cluster.status.phase == "Failed"
    assert sorted(name for name, _ in plan.delete_pods) == ["tiny-a1-0", "tiny-a1-1"]


def test_a_previous_job_s_secret_is_waited_for():
    previous = keys.build_keys_secret(JobRef("tiny", "ml", "uid-0"), KEYS)
    cluster = FakeCluster(spec(), keys_secret=previous)
    plan = cluster.reconcile()
    assert plan.create_pods == [] and cluster.status.phase == "Pending"
    ready = next(c for c in cluster.status.conditions if c.type == "Ready")
    assert ready.reason == "WaitingForPreviousJob" and f"Secret ml/{SECRET}" in ready.message
    cluster.keys_secret = None  # the garbage collector deleted it
    plan = cluster.reconcile()
    assert plan.create_keys_secret is not None and len(plan.create_pods) == 2


# --- the handlers' side: reading the Secret, the token on progress polls -----------------


class SecretReader:
    """The observation's Secret reads (observe.ClusterReader), counted."""

    def __init__(self, secret: dict[str, Any] | None) -> None:
        self.secret, self.reads = secret, 0

    async def read_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        assert (namespace, name) == ("ml", SECRET)
        self.reads += 1
        return self.secret


async def test_the_secret_is_read_once_per_recheck_interval_and_its_values_kept():
    reader = SecretReader(keys.build_keys_secret(JOB, KEYS))
    state = JobState()
    key = ("ml", "tiny")
    view, found = await observe.job_keys_of(key, "uid-1", state, reader, clock=100.0)
    assert view is not None and view.owner_uid == "uid-1" and found == KEYS
    await observe.job_keys_of(key, "uid-1", state, reader, clock=100.0 + keys.RECHECK_SECONDS / 2)
    assert reader.reads == 1
    # Deleted meanwhile: noticed at the next check, and made again with the same values.
    reader.secret = None
    view, found = await observe.job_keys_of(key, "uid-1", state, reader,
                                           clock=100.0 + keys.RECHECK_SECONDS)
    assert reader.reads == 2 and view is None and found == KEYS
    # A job re-created under the name (another uid) never gets the old job's values.
    view, found = await observe.job_keys_of(key, "uid-2", state, reader,
                                           clock=100.0 + keys.RECHECK_SECONDS)
    assert reader.reads == 3 and found is None


async def test_someone_else_s_secret_is_never_read_for_keys():
    reader = SecretReader(_foreign())
    view, found = await observe.job_keys_of(("ml", "tiny"), "uid-1", JobState(),
                                           reader, clock=0.0)
    assert view is not None and view.owner_uid is None and found is None


def test_the_policy_index_counts_only_the_job_s_own_policy():
    own = handlers.gang_policies(namespace="ml", name="tiny-gang", labels={
        "tardigrade.dev/job": "tiny"}, body={"metadata": {"name": "tiny-gang", "ownerReferences": [
            JOB.owner_reference()]}})
    index = {key: [view] for key, view in own.items()}
    assert observe.policy_present(("ml", "tiny"), "uid-1", index) is True
    assert observe.policy_present(("ml", "tiny"), "uid-2", index) is False
    assert observe.policy_present(("ml", "tiny"), "uid-1", {}) is False
    assert observe.policy_present(("ml", "tiny"), "uid-1", None) is None


async def _serve(handler: Any) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_get("/progress", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    # The fixed progress port on a loopback address of its own.
    address = "127.0.77.1"
    await web.TCPSite(runner, address, contract.DEFAULT_PROGRESS_PORT).start()
    return runner, address


async def test_progress_polls_carry_the_token_and_a_refusal_is_told_apart():
    seen: list[str | None] = []

    async def progress(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        if request.headers.get("Authorization") != f"Bearer {KEYS.progress_token}":
            return web.Response(status=401)
        return web.Response(text=contract.ProgressReport(step=7).to_json())

    runner, address = await _serve(progress)
    leader = PodView(name="tiny-a1-0", attempt=1, rank=0, phase="Running", pod_ip=address)
    try:
        async with aiohttp.ClientSession() as session:
            good = await fetch_progress(session, [leader], 5.0, token=KEYS.progress_token)
            stale = await fetch_progress(session, [leader], 5.0, token="old")
    finally:
        await runner.cleanup()
    assert good.report is not None and good.report.step == 7 and not good.refused
    assert stale.report is None and stale.refused
    assert seen == [f"Bearer {KEYS.progress_token}", "Bearer old"]


# --- the writer: a Secret that someone else made first stops the pass before any pod ------


class _Answer:
    def __init__(self, body: dict[str, Any]) -> None:
        self.data = json.dumps(body).encode()

    def release_conn(self) -> None:
        pass


class _Core:
    def __init__(self, existing: dict[str, Any]) -> None:
        self.existing, self.pods = existing, 0

    def create_namespaced_secret(self, namespace: str, body: dict[str, Any], **_: Any) -> Any:
        raise ApiException(status=409, reason="AlreadyExists")

    def read_namespaced_secret(self, name: str, namespace: str, **_: Any) -> _Answer:
        return _Answer(self.existing)

    def create_namespaced_pod(self, namespace: str, body: dict[str, Any], **_: Any) -> Any:
        self.pods += 1
        return _Answer(body)


@pytest.mark.parametrize(("existing", "taken"), [
    (keys.build_keys_secret(JOB, KEYS), False),
    (_foreign(), True),
], ids=["ours (an earlier create whose answer was lost)", "someone else's"])
def test_a_lost_race_for_the_secret_creates_no_pod(existing, taken):
    cluster = FakeCluster(spec())
    plan = decide(cluster.observe())
    writer = ClusterWriter.__new__(ClusterWriter)
    writer.core = _Core(existing)  # type: ignore[assignment]
    plan.create_service = None
    if taken:
        with pytest.raises(KeysSecretTaken):
            writer.apply("ml", "tiny", plan.status, plan)
        assert writer.core.pods == 0
    else:
        writer.apply("ml", "tiny", plan.status, plan)
        assert writer.core.pods == 2

