"""Pure renderers: (job, attempt, replica count) -> the Service and Pod manifests."""

from __future__ import annotations

import dataclasses
from typing import Any

from tardigrade_contract import contract

from tardigrade_operator import naming
from tardigrade_operator.api import types
from tardigrade_operator.api.types import TrainingJobSpec
from tardigrade_operator.decision.maintenance import avoid_affinity
from tardigrade_operator.decision.recovery import keepers
from tardigrade_operator.rendering import slice_placement, tpu_layout
from tardigrade_operator.rendering.placement import placement_for

TERMINATION_MESSAGE_PATH = contract.DEFAULT_TERMINATION_LOG
TRAINER_UID = 1000
RENDEZVOUS_TOKEN_VOLUME = "tardigrade-rendezvous-token"
# The kubelet rewrites a projected token at 80% of its life; an hour is the TokenRequest
# default and well above the 10-minute minimum (pkg/apis/authentication/validation).
RENDEZVOUS_TOKEN_SECONDS = 3600
# Restart in place: where the trainer keeps the attempt it last ran (an emptyDir outlives
# the container, not the pod).
IN_PLACE_VOLUME = "tardigrade-in-place"
IN_PLACE_DIR = "/var/run/tardigrade.dev/in-place"
# The memory tier's volume (docs/memory-tier.md): a tmpfs emptyDir. It outlives the container
# (a restart in place keeps it), not the pod; hostPath, which would outlive the pod, is
# refused under Pod Security restricted.
MEMORY_TIER_VOLUME = "tardigrade-memory-tier"


@dataclasses.dataclass(frozen=True)
class JobRef:
    """Identity of the TrainingJob object that owns the children."""

    name: str
    namespace: str
    uid: str

    def owner_reference(self) -> dict[str, Any]:
        return {
            "apiVersion": types.API_VERSION,
            "kind": types.KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


@dataclasses.dataclass(frozen=True)
class GangLaunch:
    """One attempt of the gang: how many ranks, and which checkpoint they all restore."""

    attempt: int
    replicas: int
    restore_step: str  # contract.RESTORE_LATEST, RESTORE_NONE or a step number (the pin)
    # With a maintenance lead time, the gang keeps off nodes with host maintenance scheduled
    # before this epoch, and off these node pools (TPU slices: a pool goes whole).
    avoid_maintenance_until: int | None = None
    avoid_pools: tuple[str, ...] = ()
    rollback: types.RestoreRequest | None = None  # spec.checkpoint.restoreStep, once per id
    # Restart in place is on: the pods get the job's restart key, which rank 0 accepts restart
    # requests with (decision/recovery/in_place.py).
    restart_in_place: bool = False
    # With restart in place: kept trainers restart in process (contract.ENV_RESTART_IN_PROCESS).
    restart_in_process: bool = False
    # JAX's heartbeat timeout for the trainers (contract.ENV_HEARTBEAT_TIMEOUT_SECONDS); None:
    # JAX's default (decision/recovery/in_place.survivor_heartbeat_seconds).
    heartbeat_timeout_seconds: int | None = None


def build_service(job: JobRef) -> dict[str, Any]:
    """Headless Service: DNS names for the ranks, so rank 0 can be the JAX coordinator."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": naming.service_name(job.name),
            "namespace": job.namespace,
            "labels": {naming.LABEL_MANAGED_BY: naming.MANAGED_BY, naming.LABEL_JOB: job.name},
            "ownerReferences": [job.owner_reference()],
        },
        "spec": {
            "clusterIP": "None",
            "selector": {naming.LABEL_JOB: job.name},
            # Ranks must resolve each other before any of them is Ready.
            "publishNotReadyAddresses": True,
            "ports": [
                {"name": naming.COORDINATOR_PORT_NAME, "port": contract.DEFAULT_COORDINATOR_PORT,
                 "targetPort": contract.DEFAULT_COORDINATOR_PORT},
            ],
        },
    }


def trainer_environment(
    job: JobRef, spec: TrainingJobSpec, launch: GangLaunch, rank: int
) -> contract.TrainerEnvironment:
    checkpoint = spec.checkpoint
    return contract.TrainerEnvironment(
        job_name=job.name,
        namespace=job.namespace,
        attempt=launch.attempt,
        coordinator_address=(
            f"{naming.coordinator_host(job.name, launch.attempt)}:"
            f"{contract.DEFAULT_COORDINATOR_PORT}"
        ),
        num_processes=launch.replicas,
        process_id=rank,
        checkpoint_path=checkpoint.path,
        restore_step=launch.restore_step,
        job_uid=job.uid,
        rollback_step=launch.rollback.step if launch.rollback else None,
        rollback_request=launch.rollback.request if launch.rollback else None,
        init_from_path=checkpoint.init_from.path if checkpoint.init_from else None,
        init_from_step=checkpoint.init_from.step if checkpoint.init_from else None,
        checkpoint_interval_steps=checkpoint.interval.steps,
        checkpoint_interval_seconds=checkpoint.interval.seconds,
        checkpoint_continuous_max_loop_fraction=(
            checkpoint.interval.continuous.max_loop_fraction
            if checkpoint.interval.continuous is not None else None),
        checkpoint_keep_last=checkpoint.keep.last,
        checkpoint_keep_every=checkpoint.keep.every,
        save_on_preemption=checkpoint.save_on_preemption,
        progress_port=contract.DEFAULT_PROGRESS_PORT,
        trainer_config=spec.trainer,
        termination_log=TERMINATION_MESSAGE_PATH,
        rendezvous_token_file=contract.RENDEZVOUS_TOKEN_FILE,
        # The kubelet's node-shutdown kill takes the smaller of the two (nodeshutdown_manager.go,
        # podManager.killPods); a stop by the operator gives the whole pod grace.
        shutdown_window_seconds=min(spec.preemption.shutdown_window_seconds,
                                    spec.pod_template.termination_grace_period_seconds),
        restart_in_place_dir=IN_PLACE_DIR if launch.restart_in_place else None,
        # The job's keys come from its Secret (`key_env`), never as literal values.
        restart_key=None,
        progress_token=None,
        cache_key=None,
        restart_in_process=launch.restart_in_process and launch.restart_in_place,
        # The trainer refuses to run on another backend than the one asked for (a GPU or TPU
        # job never trains on the CPU).
        accelerator=spec.accelerator.kind,
        heartbeat_timeout_seconds=launch.heartbeat_timeout_seconds,
        **memory_tier_environment(checkpoint.memory_tier),
    )


def memory_tier_environment(memory: types.MemoryTierSpec | None) -> dict[str, Any]:
    """The memory tier's part of the contract (its key comes from the Secret: key_env)."""
    if memory is None:
        return {}
    return {"memory_tier_dir": contract.MEMORY_TIER_VOLUME_PATH,
            "memory_tier_interval": memory.interval,
            "memory_tier_replicas": memory.replicas,
            "memory_tier_when_busy": memory.when_busy}


def memory_tier_volume(memory: types.MemoryTierSpec) -> dict[str, Any]:
    empty_dir: dict[str, Any] = {"medium": "Memory"}
    if memory.size_limit is not None:
        empty_dir["sizeLimit"] = str(memory.size_limit)
    return {"name": MEMORY_TIER_VOLUME, "emptyDir": empty_dir}


def runs_as_root(spec: TrainingJobSpec) -> bool:
    """TPU pods run as root with the runtime's default capabilities, as GKE's TPU samples do:
    no GKE document or public sample shows libtpu opening the chips (/dev/vfio/*, /dev/accel*)
    as another user or with every capability dropped (docs/gke.md, "Pod Security"). That meets
    Pod Security baseline, not restricted. CPU and GPU pods meet restricted."""
    return spec.accelerator.kind == "tpu"


def pod_security(spec: TrainingJobSpec) -> dict[str, Any]:
    if runs_as_root(spec):
        return {"runAsUser": 0, "runAsGroup": 0, "seccompProfile": {"type": "RuntimeDefault"}}
    return {"runAsNonRoot": True, "runAsUser": TRAINER_UID, "runAsGroup": TRAINER_UID,
            "fsGroup": TRAINER_UID, "seccompProfile": {"type": "RuntimeDefault"}}


def container_security(spec: TrainingJobSpec) -> dict[str, Any]:
    if runs_as_root(spec):
        return {"allowPrivilegeEscalation": False}
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True}


def build_pod(job: JobRef, spec: TrainingJobSpec, launch: GangLaunch, rank: int) -> dict[str, Any]:
    """The pod of one rank of one attempt."""
    name = naming.pod_name(job.name, launch.attempt, rank)
    placement = placement_for(spec)
    template = spec.pod_template
    env = [{"name": k, "value": v} for k, v in
           sorted(trainer_environment(job, spec, launch, rank).to_env().items())]
    env.append({"name": contract.ENV_POD_IP,
                "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}})
    env += _tpu_worker_env(job, spec, launch, rank)
    memory = spec.checkpoint.memory_tier
    env += key_env(job, launch.restart_in_place,
                   replicas=memory is not None and memory.replicas > 0)
    if launch.restart_in_place:
        # Resolved again at every container start from the kubelet's copy of the pod: a
        # trainer restarted in place reads the world the operator annotated it with.
        env.append({"name": contract.ENV_WORLD, "valueFrom": {"fieldRef": {
            "apiVersion": "v1",
            "fieldPath": f"metadata.annotations['{contract.ANNOTATION_WORLD}']"}}})
    env += [e.model_dump(by_alias=True, exclude_none=True) for e in spec.env]
    limits = {**spec.resources.limits, **placement.accelerator_limits}
    requests = {**spec.resources.requests, **placement.accelerator_limits}
    container: dict[str, Any] = {
        "name": naming.TRAINER_CONTAINER,
        "image": spec.image,
        "env": env,
        "resources": {k: v for k, v in (("requests", requests), ("limits", limits)) if v},
        "ports": [
            {"name": naming.COORDINATOR_PORT_NAME,
             "containerPort": contract.DEFAULT_COORDINATOR_PORT},
            {"name": naming.PROGRESS_PORT_NAME, "containerPort": contract.DEFAULT_PROGRESS_PORT},
            *([{"name": naming.REPLICA_PORT_NAME, "containerPort": contract.DEFAULT_REPLICA_PORT}]
              if memory is not None and memory.replicas > 0 else []),
        ],
        "terminationMessagePath": TERMINATION_MESSAGE_PATH,
        # Without a message from the trainer (e.g. a segfault) the last log lines explain it.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": container_security(spec),
    }
    if launch.restart_in_place:
        container.update(keepers.restart_rule())
    if spec.command is not None:
        container["command"] = list(spec.command)
    if spec.args is not None:
        container["args"] = list(spec.args)
    # The pod's identity at the rendezvous (trainer peerauth.py): a token only this pod's
    # kubelet can get, bound to the pod, for that audience alone. After the user's volumes, so
    # their indexes stay those of spec.podTemplate.volumes.
    container["volumeMounts"] = [
        *(m.model_dump(by_alias=True, exclude_none=True) for m in template.volume_mounts), {
            "name": RENDEZVOUS_TOKEN_VOLUME, "mountPath": contract.RENDEZVOUS_TOKEN_DIR,
            "readOnly": True}]
    if launch.restart_in_place:
        container["volumeMounts"].append({"name": IN_PLACE_VOLUME, "mountPath": IN_PLACE_DIR})
    if memory is not None:
        container["volumeMounts"].append({"name": MEMORY_TIER_VOLUME,
                                          "mountPath": contract.MEMORY_TIER_VOLUME_PATH})
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "hostname": name,
        "subdomain": naming.service_name(job.name),
        "terminationGracePeriodSeconds": template.termination_grace_period_seconds,
        "securityContext": pod_security(spec),
        "containers": [container],
    }
    optional = {
        "nodeSelector": placement.node_selector,
        "tolerations": placement.tolerations,
        "serviceAccountName": template.service_account_name,
        "priorityClassName": template.priority_class_name,
        "volumes": [*(v.model_dump(by_alias=True, exclude_none=True) for v in template.volumes), {
            "name": RENDEZVOUS_TOKEN_VOLUME,
            "projected": {"sources": [{"serviceAccountToken": {
                "audience": contract.RENDEZVOUS_AUDIENCE,
                "expirationSeconds": RENDEZVOUS_TOKEN_SECONDS,
                "path": contract.RENDEZVOUS_TOKEN_FILE.rpartition("/")[2]}}]},
        }, *([{"name": IN_PLACE_VOLUME, "emptyDir": {}}] if launch.restart_in_place else []),
            *([memory_tier_volume(memory)] if memory is not None else [])],
        "affinity": (avoid_affinity(launch.avoid_maintenance_until, launch.avoid_pools)
                     if launch.avoid_maintenance_until is not None else None),
    }
    pod_spec.update({k: v for k, v in optional.items() if v})
    slice_index = _slice_layout(spec, launch).slice_of(rank)
    if (affinity := slice_placement.slice_affinity(spec, job.name, launch.attempt, slice_index)):
        # Both kinds may apply: the maintenance rule is a node affinity, a slice's pod ones.
        pod_spec["affinity"] = {**(pod_spec.get("affinity") or {}), **affinity}
    labels = {**template.labels, **naming.pod_labels(job.name, launch.attempt, rank),
              **slice_placement.slice_labels(spec, job.name, launch.attempt, slice_index)}
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": job.namespace,
        "labels": labels,
        "ownerReferences": [job.owner_reference()],
        "finalizers": [naming.POD_FINALIZER],
    }
    if template.annotations:
        metadata["annotations"] = dict(template.annotations)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


# The job's keys as the trainer's environment: (variable, key in the job's Secret). The
# restart key only where the trainer takes restart requests; the replica key only where ranks
# keep each other's memory snapshots. The replica key is the cache key's entry: the trainer
# derives its seal key and its bearer token from it (memory_tier.derived_keys), each under a
# label of its own, so neither the key nor anything that seals a cache entry crosses the
# network.
KEY_ENV = ((contract.ENV_PROGRESS_TOKEN, contract.SECRET_PROGRESS_TOKEN),
           (contract.ENV_CACHE_KEY, contract.SECRET_CACHE_KEY),
           (contract.ENV_RESTART_KEY, contract.SECRET_RESTART_KEY),
           (contract.ENV_REPLICA_KEY, contract.SECRET_CACHE_KEY))
# The variables key_env may add to a pod: the admission checks exempt these names only.
KEY_ENV_NAMES = frozenset(name for name, _ in KEY_ENV)


def key_env(job: JobRef, restart_in_place: bool, replicas: bool = False
            ) -> list[dict[str, Any]]:
    """The job's keys, from its Secret (keys.py): the kubelet resolves them at each container
    start, and the pod itself carries only the Secret's name."""
    wanted = {contract.ENV_RESTART_KEY: restart_in_place, contract.ENV_REPLICA_KEY: replicas}
    refs = [(name, key) for name, key in KEY_ENV if wanted.get(name, True)]
    secret = naming.keys_secret_name(job.name)
    return [{"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}
            for name, key in refs]


def build_gang(job: JobRef, spec: TrainingJobSpec, launch: GangLaunch) -> list[dict[str, Any]]:
    return [build_pod(job, spec, launch, rank) for rank in range(launch.replicas)]


def _slice_layout(spec: TrainingJobSpec, launch: GangLaunch) -> tpu_layout.SliceLayout:
    # A spec that is not whole slices is refused before launch; one slice of all hosts then.
    return (tpu_layout.layout_for(spec.accelerator, launch.replicas)
            or tpu_layout.SliceLayout(1, launch.replicas))


def _tpu_worker_env(
    job: JobRef, spec: TrainingJobSpec, launch: GangLaunch, rank: int
) -> list[dict[str, str]]:
    # GKE injects these only for Indexed Jobs; libtpu needs them to form a multi-host slice.
    if spec.accelerator.kind != "tpu":
        return []
    env = tpu_layout.tpu_environment(job.name, launch.attempt, _slice_layout(spec, launch), rank)
    return [{"name": k, "value": v} for k, v in env.items()]
