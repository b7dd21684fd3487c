"""End to end on simulated nodes with restart in place on: the real operator (its image's
virtualenv) keeps 15 of 16 simulated ranks through a spot reclaim of one host. The kept pods
are counted in the new attempt by the recovery's record and get their label only once the
whole gang runs again (carry.carried, in_place.late_labels), so no pod write competes with
the kubelets' restarts."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3
from kubernetes import watch
from tardigrade_local.cluster import LocalCluster, simulated_nodes

from tests.e2e.harness import NAMESPACE, Cluster, OperatorProcess, running_operator, wait_for
from tests.e2e.test_simulated_gang import gang_job

pytestmark = pytest.mark.slow

RANKS = 16
NAME = "sim-gang"
IN_PLACE = 77


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("simgang-inplace")
    nodes = [dataclasses.replace(n, kubelet_version="v1.36.0",
                                 feature_gates={"ContainerRestartRules": True})
             for n in simulated_nodes(RANKS + 1, capacity={"cpu": "1"})]
    with LocalCluster(root / "cluster", nodes=nodes, with_gcs=False,
                      feature_gates="ContainerRestartRules=true") as local:
        yield Cluster(local)


@pytest.fixture(scope="module")
def operator(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[OperatorProcess]:
    with running_operator(cluster, tmp_path_factory.mktemp("operator"),
                          env={"TARDIGRADE_RESTART_IN_PLACE": "true"}) as process:
        yield process


def _labelled(pods: list[Any], attempt: int) -> list[Any]:
    return [p for p in pods if p.metadata.labels["tardigrade.dev/attempt"] == str(attempt)]


def _restarted(pod: Any) -> bool:
    status = (pod.status.container_statuses or [None])[0]
    last = status.last_state.terminated if status is not None and status.last_state else None
    return bool(status is not None and status.state.running and last is not None
                and last.exit_code == IN_PLACE)


class PodEvents:
    """The job's pod watch events from now on: (pod name, attempt label, restarted in place)."""

    def __init__(self, cluster: Cluster) -> None:
        listed = cluster.core.list_namespaced_pod(NAMESPACE,
                                                  label_selector=f"tardigrade.dev/job={NAME}")
        self.seen: list[tuple[str, str, bool]] = []
        self._stopped = False
        self._watch = watch.Watch()
        self._thread = threading.Thread(target=self._run, args=(
            cluster, listed.metadata.resource_version), daemon=True)
        self._thread.start()

    def _run(self, cluster: Cluster, version: str) -> None:
        try:
            for event in self._watch.stream(cluster.core.list_namespaced_pod, NAMESPACE,
                                            label_selector=f"tardigrade.dev/job={NAME}",
                                            resource_version=version, timeout_seconds=300):
                if event is None:  # the client yields None for a line that is not JSON:
                    if self._stopped:  # one cut short as stop() shuts the socket
                        return
                    raise AssertionError("an undecodable pod watch event")
                pod = event["object"]
                self.seen.append((pod.metadata.name,
                                  pod.metadata.labels["tardigrade.dev/attempt"],
                                  _restarted(pod)))
        except urllib3.exceptions.ProtocolError:
            if not self._stopped:  # the cluster closing the stream after the test is fine
                raise

    def stop(self) -> list[tuple[str, str, bool]]:
        self._stopped = True
        self._watch.stop()
        return list(self.seen)


def reclaim_last_rank(cluster: Cluster, checkpoints: Path) -> tuple[int, list[Any], PodEvents]:
    """Start the gang, wait until it trains, then reclaim the node of its last rank: the
    attempt, the pods the gang had and the pod events from just before the reclaim."""
    cluster.apply(gang_job(checkpoints))
    wait_for(lambda: (cluster.status(NAME).get("phase") == "Running"
                      and (cluster.status(NAME).get("step") or 0) > 0), 120, "a training gang")
    attempt = int(cluster.status(NAME)["attempt"])
    first = _labelled(cluster.pods(NAME), attempt)
    assert len(first) == RANKS
    victim = next(p for p in first if p.metadata.labels["tardigrade.dev/rank"] == str(RANKS - 1))
    events = PodEvents(cluster)
    cluster.local.preempt_node(victim.spec.node_name)
    return attempt, [p for p in first if p is not victim], events


def test_a_reclaimed_host_keeps_the_other_pods_and_labels_them_once_the_gang_runs(
        cluster: Cluster, operator: OperatorProcess, tmp_path: Path):
    attempt, kept_pods, events = reclaim_last_rank(cluster, tmp_path / "checkpoints")
    kept = {p.metadata.name for p in kept_pods}

    def kept_restarted() -> list[Any] | None:
        pods = {p.metadata.name: p for p in cluster.pods(NAME)}
        ranks = [pods[name] for name in kept if name in pods and _restarted(pods[name])]
        return ranks if len(ranks) == len(kept) else None

    restarted = wait_for(kept_restarted, 120, "every kept rank restarted in place")
    # Not one kept pod was written while its rank restarted: each still has its first
    # attempt's label when its container runs again, or was labelled after the whole gang ran.
    status = wait_for(lambda: (s := cluster.status(NAME)).get("phase") == "Running"
                      and s.get("attempt") == attempt + 1 and s, 120, "the job Running again")
    operator.assert_alive()
    recovery = status["recoveries"][-1]
    assert recovery["cause"] == "Preemption" and recovery["keptPods"] == RANKS - 1, recovery
    assert recovery["stepsLost"] == 0, recovery
    for pod in restarted:
        # The kept rank's own world came with the request, not with a pod patch.
        saved = json.loads(pod.status.container_statuses[0].last_state.terminated.message)
        assert saved["attempt"] == attempt, saved
    # Then every kept pod joins the new attempt by its label, with its world.
    labelled = wait_for(lambda: (pods := _labelled(cluster.pods(NAME), attempt + 1))
                        and len(pods) == RANKS and pods, 60, "every pod labelled anew")
    worlds = {p.metadata.name: json.loads(p.metadata.annotations["tardigrade.dev/world"])
              for p in labelled}
    assert {w["attempt"] for w in worlds.values()} == {attempt + 1}
    # The kept pods' worlds name the step the gang restored (the new pod's, the pin).
    assert {worlds[name]["restoreStep"] for name in kept} == {str(recovery["restoreStep"])}
    assert sorted(w["processId"] for w in worlds.values()) == list(range(RANKS))
    assert {p.metadata.name for p in labelled} >= kept
    assert (cluster.status(NAME).get("restarts") or {}).get("preemptions") == 1
    # No kept pod was written while the gang restarted: the first new label on a kept pod
    # comes after every kept pod's restart.
    seen = events.stop()
    restarts = [next(i for i, (name, _, restarted) in enumerate(seen)
                     if name == pod and restarted) for pod in kept]
    relabels = [i for i, (name, label, _) in enumerate(seen)
                if name in kept and label == str(attempt + 1)]
    assert relabels and min(relabels) > max(restarts), (restarts, relabels)
