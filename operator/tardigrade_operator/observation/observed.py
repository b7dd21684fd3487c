"""What the decision looks at: one job as observed in one pass (observe.py builds it), and the
operator's settings for the decision. Plain data."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import datetime, timedelta

from tardigrade_contract import contract

from tardigrade_operator.api.types import TrainingJobSpec, TrainingJobStatus
from tardigrade_operator.decision import queueing
from tardigrade_operator.decision.queue_name_rule import QueueNameRule
from tardigrade_operator.observation.autoscaling import ScaleUpSignal
from tardigrade_operator.observation.gang import Gang
from tardigrade_operator.observation.pods import ServiceView
from tardigrade_operator.rendering.keys import JobKeys
from tardigrade_operator.rendering.manifests import JobRef
from tardigrade_operator.rendering.netpolicy import NetworkPeers


@dataclasses.dataclass(frozen=True)
class DecisionSettings:
    unschedulable_timeout: timedelta = timedelta(seconds=60)
    grow_back_after: timedelta = timedelta(minutes=5)
    # A rank whose node has not been Ready this long (from the Ready condition's last
    # transition, itself the node monitor grace period after the last heartbeat) while the
    # gang made no progress for as long is lost; shorter outages (kubelet restart, partition)
    # are ridden out. See nodeloss.py.
    node_lost_after: timedelta = timedelta(seconds=60)
    # How long a scale-up the autoscaler announced (TriggeredScaleUp) holds off shrinking: the
    # cluster autoscaler itself gives a node group --max-node-provision-time (15 min) to deliver.
    scale_up_wait: timedelta = timedelta(minutes=15)
    # How long a new job waits for the garbage collector to delete the Service of a previous
    # job of the same name before it reports the name as taken.
    previous_service_wait: timedelta = timedelta(seconds=120)
    # Admin rule: jobs may only checkpoint below this prefix, "{namespace}" filled in
    # (checkpoint_scope.py); None allows any path the CRD accepts.
    checkpoint_path_prefix: str | None = None
    # Who besides the gang may reach its pods; None: the operator renders no NetworkPolicy.
    network_peers: NetworkPeers | None = None
    # Keep healthy pods on a recovery and restart their trainers in place
    # (decision/recovery/in_place.py); off: every recovery recreates the whole gang.
    restart_in_place: bool = False
    # A kept trainer restarts by replacing its own process, not through its kubelet
    # (contract.ENV_RESTART_IN_PROCESS).
    restart_in_process: bool = False
    # Where jobs must carry Kueue's queue label (queue_name_rule.py); off by default.
    queue_name_rule: QueueNameRule = dataclasses.field(default_factory=QueueNameRule)


@dataclasses.dataclass(frozen=True)
class Observed:
    """Everything the decision may look at. Built by observe.py from the cluster."""

    job: JobRef
    generation: int
    spec: TrainingJobSpec | None
    spec_error: str | None
    status: TrainingJobStatus
    # The pods labelled with the job's name, sorted into this job's gang (gang.py).
    gang: Gang
    service: ServiceView | None  # the Service with the job's name, if one exists
    now: datetime
    progress: contract.ProgressReport | None = None  # from rank 0 of the current attempt
    # Why rank 0's answer was not a report: it broke the contract (contract.MalformedReport).
    progress_error: str | None = None
    nodes_ready: Mapping[str, bool] | None = None
    # Node name -> when its Ready condition left True (lastTransitionTime), for nodes not Ready.
    nodes_not_ready_since: Mapping[str, datetime] = dataclasses.field(default_factory=dict)
    # Nodes whose kubelet is shutting them down (pods.nodes_shutting_down).
    nodes_shutting_down: frozenset[str] = frozenset()
    settings: DecisionSettings = DecisionSettings()
    # Why the API server refused a pod or service rendered from this generation of the spec.
    rejected: str | None = None
    # Pod name -> the node autoscaler's newest verdict on it (autoscaling.newest_signals), for
    # the current gang's unschedulable pods.
    scale_up: Mapping[str, ScaleUpSignal] = dataclasses.field(default_factory=dict)
    # Node name -> when GKE scheduled host maintenance on it (maintenance.scheduled_nodes).
    nodes_maintenance: Mapping[str, datetime] = dataclasses.field(default_factory=dict)
    # Node name -> its GKE node pool (slices.NODE_POOL_LABEL); None when nodes are not watched.
    node_pools: Mapping[str, str] | None = None
    # Node name -> status.nodeInfo.kubeletVersion, "" where the Node shows its kubelet ignores
    # restart rules (keepers.rules_kubelet_version); restart in place needs 1.35 or later.
    kubelet_versions: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # The Secret with the job's keys' name (naming.keys_secret_name), whoever made it; None:
    # there is none.
    keys_secret: ServiceView | None = None
    # The values to make that Secret with when there is none (keys.py: those the operator
    # knows for this job, else fresh ones); None: make none.
    new_keys: JobKeys | None = None
    # Whether the job's NetworkPolicy exists; None: not watched, so it is made with the Service.
    network_policy: bool | None = None
    # Kept pods of the current attempt whose trainers did not take the operator's restart
    # request (in_place.refused): their ranks are recreated.
    refused_restarts: frozenset[str] = frozenset()
    # Kueue's hold on a job labelled kueue.x-k8s.io/queue-name (queueing.py), or on one the
    # admin requires to carry it (queue_name_rule.py); None: no label, none required.
    queue: queueing.QueueGate | None = None
    # The job's metadata.creationTimestamp: where its goodput account (goodput.py) starts;
    # None: not known (the first pass's time stands in).
    created: datetime | None = None
