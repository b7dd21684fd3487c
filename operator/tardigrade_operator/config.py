"""Operator settings, from the environment (the Helm chart sets these)."""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import timedelta
from typing import Any

from tardigrade_operator.decision import checkpoint_scope, grants
from tardigrade_operator.decision.admission import AdmissionPolicy
from tardigrade_operator.decision.pacing import PacingSettings
from tardigrade_operator.decision.queue_name_rule import ENV as QUEUE_NAME_ENV
from tardigrade_operator.decision.queue_name_rule import QueueNameRule
from tardigrade_operator.observation.observed import DecisionSettings
from tardigrade_operator.rendering.netpolicy import NetworkPeers

PACING_MODES = ("adaptive", "fixed")
# The decisions' and the loop's own defaults: one place for each number.
_DECIDE = DecisionSettings()
_PACE = PacingSettings()


@dataclasses.dataclass(frozen=True)
class OperatorConfig:
    # How often a job with something under way (a launch, a backoff, a teardown) is
    # reconciled even when no event comes; a settled job waits for events (pacing.py).
    resync_seconds: float = _PACE.busy_seconds
    progress_timeout_seconds: float = 1.0
    # The longest a settled job goes between reads of rank 0's progress (and passes).
    progress_max_interval_seconds: float = _PACE.progress_max_seconds
    # "fixed": every job passes every resync_seconds and reads progress each time, the loop
    # before event-driven pacing; only for measuring against it (bench/operator_scale.py).
    pacing: str = "adaptive"
    unschedulable_timeout_seconds: float = _DECIDE.unschedulable_timeout.total_seconds()
    grow_back_after_seconds: float = _DECIDE.grow_back_after.total_seconds()
    # How long a node scale-up the autoscaler announced for a rank holds off a shrink.
    scale_up_wait_seconds: float = _DECIDE.scale_up_wait.total_seconds()
    # A rank whose node is not Ready this long, with the gang making no progress, is lost.
    node_lost_after_seconds: float = _DECIDE.node_lost_after.total_seconds()
    # Node objects are cluster-scoped; a namespaced install may not be allowed to read them.
    watch_nodes: bool = True
    metrics_port: int = 9090
    # A leader that stops refreshing its peering entry this long is presumed dead.
    peering_lifetime_seconds: float = 60.0
    # Admin rule: each namespace's jobs checkpoint only below this prefix, e.g.
    # "gs://bucket/{namespace}/" (checkpoint_scope.py); None: any path the CRD accepts.
    checkpoint_path_prefix: str | None = None
    # What a TrainingJob's pods may do (admission.py); the chart's admission.* values.
    admission: AdmissionPolicy = dataclasses.field(default_factory=AdmissionPolicy)
    # A NetworkPolicy per job (netpolicy.py), unless a job opts out; None: none at all.
    network_peers: NetworkPeers | None = dataclasses.field(default_factory=NetworkPeers)
    # Keep healthy pods on a preemption or resize and restart their trainers in place
    # (decision/recovery/in_place.py); off by default: every recovery recreates the gang.
    restart_in_place: bool = False
    # With restart in place: a kept trainer restarts in a new child of its container's main
    # process instead of exiting for its kubelet to restart the container
    # (contract.ENV_RESTART_IN_PROCESS).
    restart_in_process: bool = False
    # Cluster-wide installs: the ClusterRoleBinding giving trainers TokenReview, to which the
    # operator adds each job's (namespace, ServiceAccount) (tokenreview_access.py); None: the
    # chart rendered its subjects (namespaced mode) or the admin manages it.
    token_review_binding: str | None = None
    # Where TrainingJobs must carry Kueue's queue label (queue_name_rule.py); the chart's
    # kueue.requireQueueName.
    queue_name_rule: QueueNameRule = dataclasses.field(default_factory=QueueNameRule)

    @classmethod
    def from_env(cls) -> OperatorConfig:
        def number(name: str, default: float) -> float:
            value = os.environ.get(name)
            if value in (None, ""):
                return default
            try:
                return float(value)
            except ValueError:
                raise SystemExit(f"{name}={value!r}: expected a number of seconds") from None

        return cls(
            resync_seconds=number("TARDIGRADE_RESYNC_SECONDS", cls.resync_seconds),
            progress_timeout_seconds=number("TARDIGRADE_PROGRESS_TIMEOUT_SECONDS",
                                            cls.progress_timeout_seconds),
            progress_max_interval_seconds=_positive(
                "TARDIGRADE_PROGRESS_MAX_INTERVAL_SECONDS",
                number("TARDIGRADE_PROGRESS_MAX_INTERVAL_SECONDS",
                       cls.progress_max_interval_seconds)),
            pacing=_pacing_mode(os.environ.get("TARDIGRADE_PACING") or cls.pacing),
            unschedulable_timeout_seconds=number("TARDIGRADE_UNSCHEDULABLE_TIMEOUT_SECONDS",
                                                 cls.unschedulable_timeout_seconds),
            grow_back_after_seconds=number("TARDIGRADE_GROW_BACK_AFTER_SECONDS",
                                           cls.grow_back_after_seconds),
            scale_up_wait_seconds=number("TARDIGRADE_SCALE_UP_WAIT_SECONDS",
                                         cls.scale_up_wait_seconds),
            node_lost_after_seconds=number("TARDIGRADE_NODE_LOST_AFTER_SECONDS",
                                           cls.node_lost_after_seconds),
            watch_nodes=os.environ.get("TARDIGRADE_WATCH_NODES", "true").lower() != "false",
            metrics_port=int(number("TARDIGRADE_METRICS_PORT", cls.metrics_port)),
            peering_lifetime_seconds=number("TARDIGRADE_PEERING_LIFETIME_SECONDS",
                                            cls.peering_lifetime_seconds),
            checkpoint_path_prefix=_prefix_template(
                os.environ.get("TARDIGRADE_CHECKPOINT_PATH_PREFIX", "")),
            admission=_admission_from_env(),
            network_peers=_network_peers_from_env(),
            restart_in_place=_flag("TARDIGRADE_RESTART_IN_PLACE"),
            restart_in_process=_flag("TARDIGRADE_RESTART_IN_PROCESS"),
            token_review_binding=os.environ.get("TARDIGRADE_TOKEN_REVIEW_BINDING") or None,
            queue_name_rule=_queue_name_rule_from_env(),
        )

    def pacing_settings(self) -> PacingSettings:
        return PacingSettings(
            busy_seconds=self.resync_seconds,
            progress_min_seconds=min(self.resync_seconds, self.progress_max_interval_seconds),
            progress_max_seconds=self.progress_max_interval_seconds,
            fixed=self.pacing == "fixed",
        )

    def decision_settings(self) -> DecisionSettings:
        return DecisionSettings(
            unschedulable_timeout=timedelta(seconds=self.unschedulable_timeout_seconds),
            grow_back_after=timedelta(seconds=self.grow_back_after_seconds),
            node_lost_after=timedelta(seconds=self.node_lost_after_seconds),
            scale_up_wait=timedelta(seconds=self.scale_up_wait_seconds),
            checkpoint_path_prefix=self.checkpoint_path_prefix,
            network_peers=self.network_peers,
            restart_in_place=self.restart_in_place,
            restart_in_process=self.restart_in_process,
            queue_name_rule=self.queue_name_rule,
        )


def _flag(name: str) -> bool:
    value = (os.environ.get(name) or "false").lower()
    if value not in ("true", "false"):
        raise SystemExit(f"{name}={value!r}: expected true or false")
    return value == "true"


def _positive(name: str, value: float) -> float:
    if value <= 0:
        raise SystemExit(f"{name}={value:g}: expected a number of seconds above 0 (a settled "
                         "job would otherwise be passed in a tight loop)")
    return value


def _pacing_mode(value: str) -> str:
    if value not in PACING_MODES:
        raise SystemExit(f"TARDIGRADE_PACING={value!r}: expected one of "
                         f"{', '.join(PACING_MODES)} (adaptive unless measuring the old loop)")
    return value


def _prefix_template(value: str) -> str | None:
    if not value:
        return None
    try:
        return checkpoint_scope.check_prefix_template(value)
    except ValueError as err:
        raise SystemExit(f"TARDIGRADE_CHECKPOINT_PATH_PREFIX: {err}") from None


def _admission_from_env() -> AdmissionPolicy:
    try:
        return AdmissionPolicy.parse(
            os.environ.get("TARDIGRADE_POD_SECURITY") or "baseline",
            os.environ.get("TARDIGRADE_ALLOW_SYSTEM_SCHEDULING") or "false",
            {env: os.environ.get(env) for env, _ in grants.SETTINGS.values()})
    except ValueError as err:
        raise SystemExit(str(err)) from None


def _queue_name_rule_from_env() -> QueueNameRule:
    try:
        return QueueNameRule.parse(os.environ.get(QUEUE_NAME_ENV))
    except ValueError as err:
        raise SystemExit(str(err)) from None


def _network_peers_from_env() -> NetworkPeers | None:
    if os.environ.get("TARDIGRADE_NETWORK_POLICY", "true").lower() == "false":
        return None
    return NetworkPeers(
        operator_namespace=os.environ.get("TARDIGRADE_OPERATOR_NAMESPACE") or None,
        operator_pod_labels=_json_env("TARDIGRADE_OPERATOR_POD_LABELS") or {},
        scraper_namespace_selector=_json_env("TARDIGRADE_METRICS_SCRAPER_NAMESPACE_SELECTOR"),
        scraper_pod_selector=_json_env("TARDIGRADE_METRICS_SCRAPER_POD_SELECTOR"),
    )


def _json_env(name: str) -> Any:
    """A JSON object from the environment (the chart renders selectors with toJson)."""
    value = os.environ.get(name)
    if not value:
        return None
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise SystemExit(f"{name}={value!r}: expected a JSON object, e.g. "
                         '{"matchLabels": {"app.kubernetes.io/name": "prometheus"}}')
    return parsed
