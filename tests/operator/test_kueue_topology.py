"""Kueue's Topology Aware Scheduling for TrainingJobs, decided without a server (queueing.py):
`spec.topology` becomes the podSet's `topologyRequest`; a gang admitted with a
`topologyAssignment` is created behind Kueue's scheduling gate, marked the way Kueue's
ungater finds a Workload's pods, and held only where its pods cannot carry the assignment."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from tardigrade_operator import naming
from tardigrade_operator.api.parse import parse_spec
from tardigrade_operator.api.types import TrainingJobStatus
from tardigrade_operator.decision import queueing
from tardigrade_operator.decision.queueing import (
    Flavor,
    JobIdentity,
    ResizeWorkload,
    WorkloadCondition,
    gate_for,
)

from tests.operator.fake_cluster import JOB, FakeCluster, spec

IDENTITY = JobIdentity(JOB.name, JOB.namespace, JOB.uid)
FLAVORS = {"tas": Flavor({"cloud.google.com/gke-nodepool": "pool-a"}, [])}
NOW = datetime(2026, 1, 1, tzinfo=UTC)
BLOCK = "example.com/block"
HOST = "kubernetes.io/hostname"
TPU = {"kind": "tpu", "type": "tpu-v5-lite-podslice", "topology": "2x4", "count": 4}
# Two hosts of block b2, one pod each: Kueue's compact form, individual values with a prefix.
ASSIGNMENT = {"levels": [BLOCK, HOST], "slices": [{
    "domainCount": 2,
    "valuesPerLevel": [{"universal": "b2"},
                       {"individual": {"prefix": "node-", "roots": ["3", "4"]}}],
    "podCounts": {"universal": 1}}]}


def admitted(body: dict[str, Any], assignment: dict[str, Any] | None = ASSIGNMENT
             ) -> queueing.WorkloadView:
    """The Workload the operator made for `body`, as Kueue admits it through TAS."""
    workload = queueing.build_workload(IDENTITY, parse_spec(body), "team-queue",
                                       body["replicas"], None)
    workload["metadata"]["resourceVersion"] = "7"
    podset: dict[str, Any] = {"name": "trainers", "count": body["replicas"],
                              "flavors": {"cpu": "tas"}}
    if assignment is not None:
        podset["topologyAssignment"] = assignment
    workload["status"] = {
        "conditions": [{"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved"},
                       {"type": "Admitted", "status": "True", "reason": "Admitted"}],
        "admission": {"clusterQueue": "team", "podSetAssignments": [podset]}}
    return queueing.parse_workload(workload)


def launched(body: dict[str, Any], view: queueing.WorkloadView) -> list[dict[str, Any]]:
    cluster = FakeCluster(body, queue=gate_for("team-queue", view, FLAVORS, body["replicas"],
                                               spec=parse_spec(body)))
    return cluster.reconcile().create_pods


def test_spec_topology_becomes_the_podsets_topology_request():
    def request(**topology: Any) -> dict[str, Any] | None:
        body = spec(topology=topology) if topology != {"none": True} else spec()
        workload = queueing.build_workload(IDENTITY, parse_spec(body), "q", 2, None)
        return workload["spec"]["podSets"][0].get("topologyRequest")

    assert request(none=True) is None
    assert request(required=BLOCK) == {"required": BLOCK, "podIndexLabel": naming.LABEL_RANK}
    assert request(preferred=BLOCK) == {"preferred": BLOCK,
                                        "podIndexLabel": naming.LABEL_RANK}
    assert request() == {"unconstrained": True, "podIndexLabel": naming.LABEL_RANK}
    # A multi-host TPU slice keeps each slice in one node pool, whatever else it asks.
    tpu = parse_spec(spec(replicas=4, accelerator=TPU, topology={"required": BLOCK}))
    assert queueing.topology_request(tpu) == {
        "required": BLOCK, "podIndexLabel": naming.LABEL_RANK,
        "podSetSliceRequiredTopology": "cloud.google.com/gke-nodepool", "podSetSliceSize": 2}
    # The grow request asks through the same topology.
    grow = queueing.build_grow_workload(IDENTITY, tpu, gate_for(
        "team-queue", admitted(spec(replicas=4, accelerator=TPU, topology={"required": BLOCK}),
                               None),
        FLAVORS, 8, spec=tpu))
    assert grow["spec"]["podSets"][0]["topologyRequest"] == queueing.topology_request(tpu)


def test_a_topology_is_part_of_what_the_pods_ask_only_where_set():
    plain = parse_spec(spec())
    assert queueing.podset_hash(plain) == queueing.podset_hash(parse_spec(spec(topology=None)))
    required = parse_spec(spec(topology={"required": BLOCK}))
    preferred = parse_spec(spec(topology={"preferred": BLOCK}))
    assert len({queueing.podset_hash(s) for s in (plain, required, preferred)}) == 3
    # Queued (no quota held), a Workload made before the topology was asked for is updated.
    pending = queueing.parse_workload({
        **queueing.build_workload(IDENTITY, plain, "team-queue", 2, None),
        "status": {"conditions": [{"type": "QuotaReserved", "status": "False",
                                   "reason": "Pending"}]}})
    pending = queueing.WorkloadView(**{**pending.__dict__, "resource_version": "3"})
    the_gate = gate_for("team-queue", pending, FLAVORS, 2, spec=required)
    [action] = queueing.workload_actions(IDENTITY, required, TrainingJobStatus(phase="Queued"),
                                         the_gate, False, None, NOW)
    assert isinstance(action, ResizeWorkload)
    assert action.topology == queueing.topology_request(required)
    assert action.podset_hash == queueing.podset_hash(required)


def test_the_compact_topology_assignment_is_read_rank_by_rank():
    placed = queueing.parse_topology_assignment(ASSIGNMENT)
    assert placed.levels == (BLOCK, HOST)
    assert placed.domains == ((("b2", "node-3"), 1), (("b2", "node-4"), 1))
    assert placed.node_labels(1) == {BLOCK: "b2", HOST: "node-4"}
    assert placed.node_labels(2) is None
    counted = queueing.parse_topology_assignment({"levels": [HOST], "slices": [
        {"domainCount": 2, "valuesPerLevel": [{"individual": {"roots": ["a", "b"],
                                                              "suffix": "-x"}}],
         "podCounts": {"individual": [3, 1]}}]})
    assert counted.pods == 4
    assert [counted.node_labels(r) for r in range(4)] == [
        {HOST: "a-x"}, {HOST: "a-x"}, {HOST: "a-x"}, {HOST: "b-x"}]


def test_a_gang_admitted_through_tas_is_created_gated_for_kueues_ungater():
    body = spec(topology={"required": BLOCK})
    view = admitted(body)
    pods = launched(body, view)
    assert len(pods) == 2
    for pod in pods:
        meta = pod["metadata"]
        assert pod["spec"]["schedulingGates"] == [{"name": queueing.TOPOLOGY_GATE}]
        assert meta["annotations"][queueing.WORKLOAD_ANNOTATION] == view.name
        assert meta["annotations"][queueing.REQUIRED_TOPOLOGY] == BLOCK
        assert meta["labels"][queueing.PODSET_LABEL] == queueing.PODSET
        # The rank label the podSet's podIndexLabel names: Kueue orders ranks by it.
        assert naming.LABEL_RANK in meta["labels"]
        # The flavor's node labels as ever; the domain's come from Kueue's ungater.
        assert pod["spec"]["nodeSelector"]["cloud.google.com/gke-nodepool"] == "pool-a"
        assert HOST not in pod["spec"]["nodeSelector"]
    preferred = spec(topology={"preferred": BLOCK})
    [pod, _] = launched(preferred, admitted(preferred))
    assert pod["metadata"]["annotations"][queueing.PREFERRED_TOPOLOGY] == BLOCK
    # Kueue's implicit TAS (a flavor with a Topology, no topology asked): placed all the same.
    implicit = launched(spec(), admitted(spec()))
    assert implicit[0]["metadata"]["annotations"][queueing.UNCONSTRAINED_TOPOLOGY] == "true"
    assert implicit[0]["spec"]["schedulingGates"] == [{"name": queueing.TOPOLOGY_GATE}]
    # Without an assignment no gate: nothing would ever lift it.
    assert all("schedulingGates" not in p["spec"] for p in launched(body, admitted(body, None)))


def held(body: dict[str, Any], view: queueing.WorkloadView) -> FakeCluster:
    cluster = FakeCluster(body, queue=gate_for("team-queue", view, FLAVORS, body["replicas"],
                                               spec=parse_spec(body)))
    for _ in range(2):
        assert cluster.reconcile().create_pods == []
    assert cluster.status.phase == "Queued"
    assert cluster.status.conditions[-1].reason == "TopologyNotSupported"
    return cluster


def test_an_assignment_the_pods_cannot_carry_holds_the_launch():
    # The job pins a node the assignment does not name: the ungater would overwrite it.
    pinned = spec(topology={"required": BLOCK}, podTemplate={"nodeSelector": {HOST: "node-1"}})
    cluster = held(pinned, admitted(pinned))
    assert "kubernetes.io/hostname: 'node-1' vs 'node-3', 'node-4'" in cluster.status.message
    # The same key at the assigned value is no conflict.
    fits = {**ASSIGNMENT, "slices": [{**ASSIGNMENT["slices"][0], "domainCount": 1,
                                      "valuesPerLevel": [{"universal": "b2"},
                                                         {"universal": "node-1"}],
                                      "podCounts": {"universal": 2}}]}
    assert len(launched(pinned, admitted(pinned, fits))) == 2
    # Fewer pods placed than the gang runs: the rest would stay gated.
    body = spec(topology={"required": BLOCK})
    short = {**ASSIGNMENT, "slices": [{**ASSIGNMENT["slices"][0], "domainCount": 1,
                                       "valuesPerLevel": [{"universal": "b2"},
                                                          {"universal": "node-3"}]}]}
    cluster = held(body, admitted(body, short))
    assert "places 1 pods and the gang runs 2" in cluster.status.message


def test_a_running_tas_gang_is_not_stopped_by_the_hold():
    body = spec(topology={"required": BLOCK}, podTemplate={"nodeSelector": {HOST: "node-1"}})
    view = admitted(body)
    the_gate = gate_for("team-queue", view, FLAVORS, 2, spec=parse_spec(body), gang_active=True)
    assert the_gate.hold is None and the_gate.admitted
    assert view.conditions["Admitted"] == WorkloadCondition("True", "Admitted", "")
