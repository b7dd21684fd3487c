"""The TrainingJob API (tardigrade.dev/v1alpha1): the single source of truth.

The CRD in `crds/trainingjob.yaml` is generated from these models (`tardigrade crd`), the
operator parses objects with them, and the field reference in the docs is rendered from their
descriptions. Field names are camelCase on the wire, snake_case in Python.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    WithJsonSchema,
    field_validator,
)
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError
from tardigrade_contract import contract
from tardigrade_contract.boundedjson import nesting_depth

from tardigrade_operator.api import corev1, tpu_shapes
from tardigrade_operator.api.cel import CelRule, CelValidated

GROUP = "tardigrade.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "TrainingJob"
PLURAL = "trainingjobs"
SINGULAR = "trainingjob"
SHORT_NAMES = ("tj",)

# Pod names are `<job>-a<attempt>-<rank>` and must stay valid DNS labels (63 characters), so
# the job name leaves room for the suffix; it also names the headless Service (DNS-1035).
MAX_JOB_NAME_LENGTH = 45
JOB_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"

# Values GKE's node label cloud.google.com/gke-accelerator is known to take (GKE's GPU types,
# with xpk's src/xpk/core/system_characteristics.py for the newest: nvidia-b200, nvidia-gb200).
# Any `nvidia-` name is accepted, so a GPU newer than this list needs no new release; the list
# is for errors and the docs.
KNOWN_GPU_TYPES = (
    "nvidia-tesla-t4",
    "nvidia-tesla-v100",
    "nvidia-tesla-p100",
    "nvidia-tesla-p4",
    "nvidia-l4",
    "nvidia-tesla-a100",
    "nvidia-a100-80gb",
    "nvidia-h100-80gb",
    "nvidia-h100-mega-80gb",
    "nvidia-h200-141gb",
    "nvidia-b200",
    "nvidia-gb200",
)
# TPU types with 2D slice topologies ("2x4") and with 3D ones ("2x2x4"): tpu_shapes.py.
TPU_TYPES = tpu_shapes.TPU_TYPES
TPU_TYPES_2D = tuple(t.name for t in tpu_shapes.TPU_TYPES_TABLE if t.dims == 2)
TPU_TYPES_3D = tuple(t.name for t in tpu_shapes.TPU_TYPES_TABLE if t.dims == 3)

# The Kubernetes resource.Quantity schema, as the API server publishes it for core types.
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
_QUANTITY_RE = re.compile(QUANTITY_PATTERN)


def _validate_quantity(value: object) -> int | str:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and _QUANTITY_RE.match(value):
        return value
    raise PydanticCustomError(
        "quantity",
        "must be a Kubernetes quantity such as 4, 500m, 16Gi or 1.5 (got {value})",
        {"value": value},
    )


Quantity = Annotated[
    int | str,
    PlainValidator(_validate_quantity),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_PATTERN,
            "x-kubernetes-int-or-string": True,
        }
    ),
]
FreeForm = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]
Timestamp = Annotated[
    datetime, Field(strict=False), WithJsonSchema({"type": "string", "format": "date-time"})
]
# Kubernetes' label value syntax; empty is allowed.
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
_DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_QUALIFIED_NAME_RE = re.compile(
    rf"^({_DNS_SUBDOMAIN}/)?[A-Za-z0-9]([-A-Za-z0-9_.]{{0,61}}[A-Za-z0-9])?$"
)


def _validate_qualified_key(key: str) -> str:
    # Checked here and by the operator, not in the CRD: a CEL rule over map keys would blow the
    # API server's rule cost budget, and OpenAPI schemas for CRDs cannot constrain keys.
    if _QUALIFIED_NAME_RE.match(key) and len(key.rpartition("/")[0]) <= 253:
        return key
    raise PydanticCustomError(
        "qualified_name",
        "key '{key}' is not a valid Kubernetes label/annotation key: an optional DNS prefix "
        "and '/', then at most 63 letters, digits, '-', '_' or '.', starting and ending with a "
        "letter or digit (e.g. team or example.com/team)",
        {"key": key},
    )


QualifiedKey = Annotated[str, AfterValidator(_validate_qualified_key)]
LabelValue = Annotated[str, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]
LabelMap = Annotated[dict[QualifiedKey, LabelValue], Field(max_length=64)]
AnnotationMap = Annotated[dict[QualifiedKey, str], Field(max_length=64)]
# The operator's own labels and annotations live under this prefix.
RESERVED_PREFIX = "tardigrade.dev/"
# An image reference as container runtimes parse it: [registry[:port]/]path[:tag][@digest].
IMAGE_PATTERN = (
    r"^([a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?(\.[a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?)*"
    r"(:[0-9]+)?/)?[a-z0-9]+([._-]+[a-z0-9]+)*(/[a-z0-9]+([._-]+[a-z0-9]+)*)*"
    r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@[A-Za-z][A-Za-z0-9]*([-_+.][A-Za-z][A-Za-z0-9]*)*"
    r":[0-9a-fA-F]{32,})?$"
)
MAX_TRAINER_CONFIG_BYTES = 65536
# No CRD keyword bounds depth under x-kubernetes-preserve-unknown-fields (docs/RELIABILITY.md).
MAX_TRAINER_CONFIG_DEPTH = 100
# Pattern mismatches explained in words (the regex itself tells a user little).
PATTERN_HINTS = {
    LABEL_VALUE_PATTERN: "must be a Kubernetes label value: at most 63 letters, digits, '-', "
    "'_' or '.', starting and ending with a letter or digit (or empty)",
    IMAGE_PATTERN: "must be a container image reference such as ghcr.io/org/trainer:v1 or "
    "registry:5000/trainer@sha256:<digest> (lower-case path, no spaces or shell characters)",
}


def _publish_cel_rules(schema: dict[str, Any], model: type[BaseModel]) -> None:
    rules = getattr(model, "cel_rules", ())
    if rules:
        schema["x-kubernetes-validations"] = [rule.to_crd() for rule in rules]


class ApiModel(CelValidated):
    """camelCase on the wire; unknown fields are errors (the API server prunes or rejects them)."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        # The API server does not coerce "2" into 2 or "yes" into true; neither do we.
        strict=True,
        json_schema_extra=_publish_cel_rules,
    )


def nested(model: type[BaseModel], description: str) -> Any:
    """A sub-object that defaults to `{}` so the API server fills in its own defaults."""
    return Field(
        default_factory=model, description=description, json_schema_extra={"default": {}}
    )


# ---------------------------------------------------------------------------------- spec ---

# Typed, so that the API server stores nothing deeper than core/v1 defines (api/corev1.py).
_CORE_V1: dict[str, type[BaseModel]] = {}
Volume = corev1.typed_model("V1Volume", ApiModel, Quantity, _CORE_V1)
VolumeMount = corev1.typed_model("V1VolumeMount", ApiModel, Quantity, _CORE_V1)


_OBJECT_NAME = Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


class KeySelector(ApiModel):
    """A key of a ConfigMap or Secret in the job's namespace (core/v1 *KeySelector)."""

    name: str = _OBJECT_NAME
    key: str = Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")
    optional: bool | None = None


class ObjectFieldSelector(ApiModel):
    """A field of the pod (core/v1 ObjectFieldSelector), e.g. metadata.name."""

    api_version: str | None = Field(None, max_length=64)
    field_path: str = Field(min_length=1, max_length=256)


class ResourceFieldSelector(ApiModel):
    """A resource request or limit of a container (core/v1 ResourceFieldSelector)."""

    container_name: str | None = Field(None, max_length=63)
    resource: str = Field(min_length=1, max_length=253)
    divisor: Quantity | None = None


class EnvVarSource(ApiModel):
    """Where an environment variable's value comes from (core/v1 EnvVarSource). Typed, not
    free-form: the API server then stores nothing deeper than this schema."""

    config_map_key_ref: KeySelector | None = None
    secret_key_ref: KeySelector | None = None
    field_ref: ObjectFieldSelector | None = None
    resource_field_ref: ResourceFieldSelector | None = None

    cel_rules = (
        CelRule("(has(self.configMapKeyRef) ? 1 : 0) + (has(self.secretKeyRef) ? 1 : 0) + "
                "(has(self.fieldRef) ? 1 : 0) + (has(self.resourceFieldRef) ? 1 : 0) == 1",
                "env: valueFrom takes exactly one of configMapKeyRef, secretKeyRef, fieldRef "
                "or resourceFieldRef", ".configMapKeyRef"),
    )


class EnvVar(ApiModel):
    """An environment variable for the trainer container (same shape as a core/v1 EnvVar)."""

    name: str = Field(min_length=1, max_length=256, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$",
                      description="Variable name.")
    # Linux refuses to start a process with one environment string above 128 KiB.
    value: str | None = Field(None, max_length=32768, description="Literal value.")
    value_from: EnvVarSource | None = Field(
        None, description="A core/v1 EnvVarSource (secretKeyRef, configMapKeyRef, fieldRef...)."
    )

    cel_rules = (
        CelRule("!(has(self.value) && has(self.valueFrom))",
                "env: set either value or valueFrom, not both", ".valueFrom"),
        CelRule("!self.name.startsWith('TARDIGRADE_') && "
                "!(self.name in ['TPU_WORKER_ID', 'TPU_WORKER_HOSTNAMES'])",
                "env: TARDIGRADE_* (and, on TPU, TPU_WORKER_ID/TPU_WORKER_HOSTNAMES) are set by "
                "the operator for every rank; rename the variable, or set the value through the "
                "TrainingJob field it comes from", ".name"),
    )


class ResourceRequirements(ApiModel):
    """Per-replica compute resources of the trainer container (core/v1 shape)."""

    requests: dict[str, Quantity] = Field(
        default_factory=dict, description='Requested resources, e.g. {cpu: "4", memory: 16Gi}.'
    )
    limits: dict[str, Quantity] = Field(
        default_factory=dict,
        description="Resource limits. Accelerator limits (nvidia.com/gpu, google.com/tpu) are "
        "added from spec.accelerator; do not set them here.",
    )


def _slice_chips(topology: str) -> str:
    """CEL: the chips of one slice of `topology` ("AxB" or "AxBxC"), a product of its sides.
    The string functions (split) are cel-go's extended strings library, which every
    Kubernetes API server enables for CRD rules."""
    sides = f"{topology}.split('x')"
    return (f"int({sides}[0]) * int({sides}[1]) * "
            f"(size({sides}) == 3 ? int({sides}[2]) : 1)")


def _sliced_tpu(accel: str) -> str:
    """CEL: `accel` is a TPU with chips per host and a well-formed topology (the schema's
    pattern reports a malformed one; this keeps the arithmetic from failing on it)."""
    return (f"{accel}.kind == 'tpu' && has({accel}.count) && has({accel}.topology) && "
            f"{accel}.topology.matches('^[0-9]+x[0-9]+(x[0-9]+)?$')")


def _whole_slices_rule(field: str, why: str) -> CelRule:
    """spec.<field> hosts are a whole number of TPU slices: field * chips per host is a multiple
    of one slice's chips. Left to the count rule when the chips do not split into hosts."""
    chips = _slice_chips("self.accelerator.topology")
    accel = "self.accelerator"
    unset = "" if field == "replicas" else f"!has(self.{field}) || "
    # A static message: a messageExpression that prints the numbers needs string(int), whose
    # result kube-apiserver's cost estimator cannot bound, and the CRD is then refused
    # ("estimated messageExpression cost exceeds budget by factor of more than 100x").
    return CelRule(
        f"{unset}!({_sliced_tpu(accel)} && ({chips}) % {accel}.count == 0) || "
        f"self.{field} * {accel}.count % ({chips}) == 0",
        f"spec.{field} must be a whole number of TPU slices: it counts hosts ({why}), and one "
        f"slice is the chips of accelerator.topology / accelerator.count hosts (topology 4x4 "
        f"with count 4: 4 hosts); set spec.{field} to a multiple of that",
        f".{field}",
    )


_GPU_EXAMPLES = ", ".join(KNOWN_GPU_TYPES[-5:])


def _single_host_rule(field: str) -> CelRule:
    """A one-host TPU slice runs alone: GKE's Multislice joins multi-host slices only."""
    accel = "self.accelerator"
    chips = _slice_chips(f"{accel}.topology")
    unset = "" if field == "replicas" else f"!has(self.{field}) || "
    fix = (f"set spec.{field} to 1, or ask for a multi-host slice (count 4 with a topology of "
           "more than 4 chips, e.g. 2x4 as 2 hosts of 4 on v5e/v6e)")
    return CelRule(
        f"{unset}!({_sliced_tpu(accel)} && ({chips}) == {accel}.count) || self.{field} == 1",
        f"spec.{field} must be 1 for a single-host TPU slice (count equal to the chips of the "
        f"topology): GKE runs Multislice only on multi-host slices (\"Deploy TPU Multislices in "
        f"GKE\"); {fix}",
        f".{field}",
        # Strings only: kube-apiserver cannot bound the cost of string(int).
        message_expression=(
            f"'spec.{field} asks for several ' + {accel}.type + ' ' + {accel}.topology + "
            f"' slices of one host each, and GKE runs Multislice only on multi-host slices "
            f"(Deploy TPU Multislices in GKE); {fix}'"),
    )


class AcceleratorSpec(ApiModel):
    """What each replica (host) runs on. Mapped to GKE node selectors and resource limits."""

    kind: Literal["cpu", "nvidia-gpu", "tpu"] = Field(
        "cpu", description="cpu, nvidia-gpu (GKE GPU node pool) or tpu (GKE TPU slice)."
    )
    type: str | None = Field(
        None, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="GKE accelerator name: for nvidia-gpu the cloud.google.com/gke-accelerator "
        f"value, any nvidia- name (known: {', '.join(KNOWN_GPU_TYPES)}); for tpu the "
        f"cloud.google.com/gke-tpu-accelerator value ({', '.join(TPU_TYPES)}).",
    )
    count: int | None = Field(
        None, ge=1, le=16,
        description="Accelerator chips per replica: GPUs per pod, or, for tpu (required), the "
        "TPU chips of one host, fixed by its machine type (4 on every multi-host slice; 1, 4 or "
        "8 on one-host v5e/v6e slices: a 2x4 slice is 2 hosts of 4 or one host of 8).",
    )
    # maxLength bounds the rules' estimated cost on a real server (split is priced by length).
    topology: str | None = Field(
        None, max_length=11, pattern=r"^[1-9][0-9]{0,2}x[1-9][0-9]{0,2}(x[1-9][0-9]{0,2})?$",
        description='TPU slice topology, "AxB" (v5e, v6e) or "AxBxC" (v4, v5p, tpu7x), one GKE '
        "offers for the type (docs/gke.md, TPU slices).",
    )

    cel_rules = (
        CelRule("self.kind != 'cpu' || "
                "(!has(self.type) && !has(self.count) && !has(self.topology))",
                "accelerator: kind cpu takes no type, count or topology", ".kind"),
        CelRule("self.kind != 'nvidia-gpu' || (has(self.type) && self.type.startsWith('nvidia-'))",
                "accelerator: kind nvidia-gpu needs type set to the GKE GPU name, the node label "
                f"cloud.google.com/gke-accelerator, which starts with nvidia- ({_GPU_EXAMPLES}, "
                "...)", ".type"),
        CelRule("self.kind != 'nvidia-gpu' || !has(self.topology)",
                "accelerator: topology applies to TPUs only", ".topology"),
        CelRule("self.kind != 'tpu' || (has(self.type) && self.type in "
                + repr(list(TPU_TYPES)).replace('"', "'") + ")",
                "accelerator: kind tpu needs type set to a GKE TPU type, the node label "
                f"cloud.google.com/gke-tpu-accelerator: one of {', '.join(TPU_TYPES)}", ".type"),
        CelRule("self.kind != 'tpu' || has(self.topology)",
                'accelerator: kind tpu needs topology, e.g. "2x4" or "2x2x4"', ".topology"),
        CelRule(
            "self.kind != 'tpu' || !has(self.type) || !has(self.topology) || "
            "(self.type in " + repr(list(TPU_TYPES_2D)).replace('"', "'") + ") == "
            "!self.topology.matches('^[0-9]+x[0-9]+x[0-9]+$')",
            "accelerator: tpu-v5-lite and tpu-v6e slices take a 2D topology (AxB); tpu-v4, "
            "tpu-v5p and tpu7x take a 3D topology (AxBxC)",
            ".topology",
        ),
        CelRule(
            tpu_shapes.cel_topology_rule("self"),
            "accelerator: topology is not a slice GKE offers for this TPU type (docs/gke.md, "
            "TPU slices, lists them)",
            ".topology",
            message_expression=(
                "'accelerator.topology ' + self.topology + ' is not a ' + self.type + ' slice "
                "GKE offers: use ' + " + tpu_shapes.cel_topology_choices("self")),
        ),
        CelRule(
            tpu_shapes.cel_count_rule("self"),
            "accelerator: kind tpu needs count, the TPU chips of one host, which the machine "
            "type fixes: 4 for every multi-host slice, 1, 4 or 8 for one-host v5e/v6e slices",
            ".count",
            # Strings only: kube-apiserver cannot bound the cost of string(int) (the count).
            message_expression=(
                "'accelerator.count ' + (has(self.count) ? 'does not fit' : 'is required for') "
                "+ ' a ' + self.type + ' ' + self.topology + ' slice: it is the TPU chips of one "
                "host, fixed by the machine type; set it to ' + "
                + tpu_shapes.cel_count_choices("self")),
        ),
    )

    def topology_chips(self) -> int | None:
        return None if self.topology is None else tpu_shapes.chips(self.topology)


class Toleration(ApiModel):
    """A core/v1 Toleration."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


GKE_SPOT_LABEL = "cloud.google.com/gke-spot"


class SpotSpec(ApiModel):
    """Run on spot (preemptible) capacity: select spot nodes and tolerate their taint."""

    enabled: bool = Field(False, description="Schedule onto spot nodes.")
    node_selector: dict[QualifiedKey, LabelValue] = Field(
        default_factory=lambda: {GKE_SPOT_LABEL: "true"},
        description="Node labels that select spot nodes (GKE: cloud.google.com/gke-spot).",
        json_schema_extra={"default": {GKE_SPOT_LABEL: "true"}},
    )
    tolerations: list[Toleration] = Field(
        default_factory=lambda: [
            Toleration(key=GKE_SPOT_LABEL, operator="Equal", value="true", effect="NoSchedule")
        ],
        max_length=64,
        description="Tolerations for the spot node taint.",
        json_schema_extra={"default": [{"key": GKE_SPOT_LABEL, "operator": "Equal",
                                        "value": "true", "effect": "NoSchedule"}]},
    )


class PodTemplateOverride(ApiModel):
    """Additions to every trainer pod."""

    node_selector: dict[QualifiedKey, LabelValue] = Field(
        default_factory=dict, description="Extra node labels.")
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64)
    service_account_name: str | None = Field(
        None, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="ServiceAccount of the pods (for Workload Identity access to the bucket).",
    )
    volumes: list[Volume] = Field(  # type: ignore[valid-type]
        default_factory=list, max_length=64, description="core/v1 Volumes added to the pod.")
    volume_mounts: list[VolumeMount] = Field(  # type: ignore[valid-type]
        default_factory=list, max_length=64,
        description="core/v1 VolumeMounts added to the trainer container.",
    )
    annotations: AnnotationMap = Field(default_factory=dict)
    labels: LabelMap = Field(default_factory=dict)
    priority_class_name: str | None = Field(
        None, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    termination_grace_period_seconds: int = Field(
        30, ge=1, le=3600,
        description="Time between SIGTERM and SIGKILL when the operator stops the gang (resize, "
        "suspend, relaunch); the trainer saves a checkpoint inside it. On a node shutdown the "
        "kubelet gives less: the smaller of this and the node's shutdown grace for regular pods "
        "(spec.preemption.shutdownWindowSeconds).",
    )

    @field_validator("labels", "annotations")
    @classmethod
    def _not_ours(cls, value: dict[str, str]) -> dict[str, str]:
        reserved = sorted(k for k in value if k.startswith(RESERVED_PREFIX))
        if reserved:
            raise PydanticCustomError(
                "reserved_key",
                "keys under " + RESERVED_PREFIX + " are set by the operator (job, attempt, rank) "
                "and would mislead it: rename {keys}",
                {"keys": ", ".join(reserved)},
            )
        return value


class ContinuousSaving(ApiModel):
    """Continuous saving: the next save starts as soon as the last one is done."""

    max_loop_fraction: float = Field(
        contract.DEFAULT_CONTINUOUS_MAX_LOOP_FRACTION, gt=0,
        le=contract.MAX_CONTINUOUS_MAX_LOOP_FRACTION,
        description="The share of the training loop's time saves may hold it: a save that held "
        "the loop for b seconds lets the next one start b / maxLoopFraction seconds after it "
        "started, at the earliest (0.05: a 0.2 s snapshot, a save every 4 s at most).")


class CheckpointInterval(ApiModel):
    """When to save: every N steps and/or S seconds (whichever comes first), or
    continuously."""

    steps: int | None = Field(None, ge=1, description="Save every this many steps.")
    seconds: float | None = Field(None, gt=0, description="Save at least this often.")
    continuous: ContinuousSaving | None = Field(
        None, description="Save continuously (Orbax's continuous checkpointing): a save "
        "starts as soon as the last one committed, within a budget of the loop's time. "
        "Replaces steps and seconds.")

    cel_rules = (
        CelRule("has(self.steps) || has(self.seconds) || has(self.continuous)",
                "checkpoint.interval: set steps, seconds (or both), or continuous", ".steps"),
        CelRule("!has(self.continuous) || !(has(self.steps) || has(self.seconds))",
                "checkpoint.interval.continuous replaces steps and seconds: a continuous save "
                "starts as soon as the last one is done; remove steps and seconds, or "
                "continuous", ".continuous"),
    )


class KeepPolicy(ApiModel):
    """Which committed checkpoints to keep. The newest committed one is always kept."""

    last: int = Field(
        contract.DEFAULT_CHECKPOINT_KEEP_LAST, ge=1, le=1000,
        description="Keep the newest N committed checkpoints.")
    every: int | None = Field(
        None, ge=1, description="Also keep every checkpoint whose step is a multiple of this."
    )


class MemoryTierSpec(ApiModel):
    """Snapshots in host memory, replicated to peers: a rank lost without notice loses at most
    `interval` steps when the gang restarts in place (docs/memory-tier.md)."""

    interval: int = Field(
        ge=1, description="Every rank snapshots its own shards every this many steps into its "
        "pod's memory volume, and sends a copy to its peers.")
    replicas: int = Field(
        1, ge=0, le=8,
        description="How many other ranks (the next ones, in rank order) keep a copy of each "
        "rank's snapshot. 0: only the rank's own pod does, which survives a container restart "
        "but not the loss of its pod.")
    size_limit: Quantity | None = Field(
        None, description="The memory volume's size (an emptyDir with medium Memory: it counts "
        "against the pod's memory limit). It holds the newest 2 snapshots of the rank's own "
        "shards and of each rank it keeps replicas for: about 2 x (1 + replicas) x the state's "
        "bytes per host. Unset: no limit of its own.")
    # The values are the contract's (MEMORY_TIER_SKIP, MEMORY_TIER_WAIT): a Literal of plain
    # strings, so that the CRD schema gets an enum.
    when_busy: Literal["skip", "wait"] = Field(
        "skip", description="What a memory step does while the previous snapshot's commit "
        "(write and sends) still runs on some rank. skip: every rank skips that step's "
        "snapshot, at most 2 in a row, and the loop never waits. wait: the loop waits for the "
        "commit, which costs throughput whenever a commit outlasts the interval.")


class InitFrom(ApiModel):
    """Another job's checkpoint root to start from, read only."""

    path: str = Field(
        min_length=1, max_length=1024,
        description="The other job's spec.checkpoint.path (gs://BUCKET/PREFIX or an absolute "
        "path). Only read, never written or cleaned up.",
    )
    step: int | None = Field(
        None, ge=0, description="Committed step to start from; unset: the newest of that root's "
        "current line.")

    cel_rules = (
        CelRule(
            r"self.path.matches('^(gs://[a-z0-9][-a-z0-9_.]{1,220}[a-z0-9](/[^\\s]*)?|/[^\\s]*)$')",
            "checkpoint.initFrom.path must be gs://BUCKET/PREFIX or an absolute path",
            ".path",
        ),
    )


class CheckpointSpec(ApiModel):
    """Where and when the trainer checkpoints."""

    path: str = Field(
        min_length=1, max_length=1024,
        description="gs://BUCKET/PREFIX (GCS through TensorStore) or an absolute path on a "
        "mounted volume. Immutable: the root records this job as its owner (see "
        "docs/checkpoint-format.md); to move, delete and re-create the job, or create a new one "
        "with initFrom.",
    )
    restore_step: int | None = Field(
        None, ge=0,
        description="Roll back: the next launch restores exactly this committed step and "
        "continues from it as a new line; the steps after it are abandoned (overwritten or "
        "deleted as the new line passes them). Applied once per value: to roll a running job "
        "back, set it while spec.suspend is true, then resume. A step that is not committed "
        "stops the job with reason CheckpointMissing.",
    )
    init_from: InitFrom | None = Field(
        None, description="Start from another job's checkpoint (read only) while this job's "
        "own root has no committed step; afterwards the job resumes from its own.")
    interval: CheckpointInterval = Field(
        default_factory=lambda: CheckpointInterval(steps=100),
        description="Save every N steps and/or every S seconds, or continuously.",
        json_schema_extra={"default": {"steps": 100}},
    )
    keep: KeepPolicy = nested(KeepPolicy, "Which checkpoints to keep.")
    save_on_preemption: bool = Field(
        True, description="On SIGTERM the gang agrees on a step and saves before exiting."
    )
    memory_tier: MemoryTierSpec | None = Field(
        None, description="Also snapshot to host memory (and to peers' memory) between "
        "checkpoints: a gang restarted in place resumes from the newest snapshot every rank "
        "still has, or can fetch, when it is newer than the newest checkpoint.")

    cel_rules = (
        CelRule(
            r"self.path.matches('^(gs://[a-z0-9][-a-z0-9_.]{1,220}[a-z0-9](/[^\\s]*)?|/[^\\s]*)$')",
            "checkpoint.path must be gs://BUCKET/PREFIX or an absolute path such as /mnt/ckpt; "
            "other schemes (s3://, file://) and relative paths are not supported",
            ".path",
        ),
        CelRule(
            r"!self.path.matches('[\\x00-\\x1f\\x7f]')",
            "checkpoint.path may not contain NUL or other control characters: remove them",
            ".path",
        ),
        CelRule(
            r"!self.path.matches('^gs://[^/]*/*$')",
            "checkpoint.path names a whole bucket: add a prefix for this job, e.g. "
            "gs://BUCKET/runs/JOB (retention deletes old checkpoints under the path, so a job "
            "needs a prefix of its own)",
            ".path",
        ),
        CelRule(
            r"!self.path.matches('(^|/)\\.\\.?(/|$)')",
            "checkpoint.path may not contain '.' or '..' segments: write the path they "
            "resolve to, e.g. gs://BUCKET/runs/JOB or /mnt/ckpt/JOB",
            ".path",
        ),
        CelRule(
            r"!self.path.matches('^/+((proc|sys|dev)(/.*)?)?$')",
            "checkpoint.path may not be / or lie under /proc, /sys or /dev: use a directory on "
            "a mounted volume, e.g. /mnt/ckpt/JOB",
            ".path",
        ),
        # A transition rule: the API server checks it on update only (pydantic skips it).
        CelRule("self.path == oldSelf.path",
                "checkpoint.path is immutable: the checkpoint root belongs to this job. Delete "
                "and re-create the job to use another path (start it from the old root with "
                "checkpoint.initFrom)", ".path"),
        CelRule("!has(self.memoryTier) || !has(self.interval.steps) || "
                "self.memoryTier.interval < self.interval.steps",
                "checkpoint.memoryTier.interval must be smaller than checkpoint.interval.steps: "
                "the memory tier is there to snapshot more often than the checkpoints",
                ".memoryTier.interval"),
        CelRule("!has(self.initFrom) || self.initFrom.path != self.path",
                "checkpoint.initFrom.path must differ from checkpoint.path: a job resumes from "
                "its own root by itself", ".initFrom.path"),
    )


class PreemptionSpec(ApiModel):
    """What the nodes give a rank when they go away."""

    shutdown_window_seconds: int = Field(
        contract.DEFAULT_SHUTDOWN_WINDOW_SECONDS, ge=1, le=3600,
        description="Seconds a rank has between SIGTERM and SIGKILL when its node shuts down: "
        "the kubelet's shutdown grace for regular pods (shutdownGracePeriod minus "
        "shutdownGracePeriodCriticalPods). GKE spot VMs get a 30 s notice of which regular "
        "pods get the first 15 s (the default; node pools that opt in to a 120 s notice give "
        "more). Neither the operator nor the trainer can see it, so it is set here; the "
        "trainer gets the smaller of it and podTemplate.terminationGracePeriodSeconds as its "
        "save-on-notice deadline.",
    )
    maintenance_lead_seconds: int = Field(
        1800, ge=0, le=604800,
        description="Move the gang this many seconds before host maintenance that GKE has "
        "scheduled on one of its nodes (node label cloud.google.com/scheduled-maintenance-time, "
        "GPU/TPU nodes, GKE 1.31.1-gke.2008000+): every rank saves on SIGTERM and the gang is "
        "relaunched on nodes with no maintenance before then (required node affinity on that "
        "label), counted as a Migration, not a preemption. 0: never; the maintenance then "
        "terminates the node with the gang on it.",
    )


class FailurePolicy(ApiModel):
    """How the operator treats failed ranks. Preemptions never use up maxRestarts."""

    max_restarts: int = Field(
        3, ge=0, le=1000, description="Gang restarts allowed after real failures (crashes)."
    )
    backoff_seconds: float = Field(
        10, ge=0, le=3600, description="Wait before the first restart after a failure; doubles."
    )
    max_backoff_seconds: float = Field(300, ge=0, le=86400, description="Cap of the backoff.")
    max_preemptions: int | None = Field(
        None, ge=0, description="Optional budget of preemption restarts (unset: unlimited)."
    )
    retryable_exit_codes: list[Annotated[int, Field(ge=1, le=255)]] = Field(
        default_factory=list, max_length=64,
        description="Exit codes that restart the gang without using maxRestarts (the "
        "trainer's own retryable codes, storage errors and peer timeouts, always are). They "
        "have their own budget, maxRetries, and backoff, retryBackoffSeconds.",
    )
    max_retries: int = Field(
        10, ge=0, le=1000,
        description="Restarts allowed after retryable exit codes in a row: the job fails "
        "(RetryBudgetExhausted) on the next one. The count starts over once a gang has run "
        "for backoffResetSeconds.",
    )
    retry_backoff_seconds: float = Field(
        10, ge=1, le=3600,
        description="Wait before relaunching after a retryable exit code; doubles with each "
        "one in a row, up to maxRetryBackoffSeconds (as the Job controller's pod failure "
        "backoff, 10 s to 10 min). Also paces relaunches after kubelet admission rejections "
        "(OutOfnvidia.com/gpu, NodeAffinity...), the first of which relaunches at once. At "
        "least 1 s: no spec can relaunch in a tight loop.",
    )
    max_retry_backoff_seconds: float = Field(
        600, ge=1, le=86400, description="Cap of the retry and admission-rejection backoff."
    )
    backoff_reset_seconds: float = Field(
        600, ge=1, le=86400,
        description="A gang that runs this long clears the retry and admission-rejection "
        "counts in a row (as the kubelet forgets a crash-loop backoff after 10 minutes).",
    )

    cel_rules = (
        CelRule("self.backoffSeconds <= self.maxBackoffSeconds",
                "failurePolicy.backoffSeconds must be <= failurePolicy.maxBackoffSeconds",
                ".backoffSeconds"),
        CelRule("self.retryBackoffSeconds <= self.maxRetryBackoffSeconds",
                "failurePolicy.retryBackoffSeconds must be <= "
                "failurePolicy.maxRetryBackoffSeconds", ".retryBackoffSeconds"),
    )


class NetworkPolicySpec(ApiModel):
    """Network isolation of the gang's pods."""

    enabled: bool = Field(
        True, description="Render a NetworkPolicy that lets in only the gang's own pods, the "
        "operator and the metrics scraper the cluster admin configured (if the operator's "
        "networkPolicy setting is on). Enforced only where the network plugin implements "
        "NetworkPolicy (GKE: Dataplane V2 or network policy enforcement).",
    )


class TopologySpec(ApiModel):
    """Where Kueue's Topology Aware Scheduling places the gang (a ResourceFlavor with
    spec.topologyName; docs/kueue.md, "Topology Aware Scheduling"). Levels are node label keys
    of the flavor's Topology (e.g. cloud.google.com/gce-topology-block, kubernetes.io/hostname)."""

    required: QualifiedKey | None = Field(
        None, max_length=63,
        description="Every rank in one domain of this level, or the gang is not admitted.")
    preferred: QualifiedKey | None = Field(
        None, max_length=63,
        description="One domain of this level if it fits, else the smallest spread above it.")

    cel_rules = (
        CelRule("!has(self.required) || !has(self.preferred)",
                "spec.topology takes required or preferred, not both: keep the one the gang "
                "needs", ".required"),
    )


class TrainingJobSpec(ApiModel):
    """The desired state of a TrainingJob."""

    replicas: int = Field(
        1, ge=1, le=4096,
        description="Number of hosts (one trainer pod each), the unit `kubectl scale "
        "--replicas` sets too. TPU: a whole number of slices, i.e. a multiple of one slice's "
        "hosts (topology chips / accelerator.count): 2 slices of 2x4 with count 4 are 4.")
    min_replicas: int | None = Field(
        None, ge=1, le=4096,
        description="Elastic lower bound: with capacity short, relaunch with fewer replicas.",
    )
    max_replicas: int | None = Field(None, ge=1, le=4096, description="Elastic upper bound.")
    image: str = Field(min_length=1, max_length=512, pattern=IMAGE_PATTERN,
                       description="Trainer container image, e.g. ghcr.io/org/trainer:v1.")
    command: list[Annotated[str, Field(max_length=32768)]] | None = Field(
        None, max_length=64, description="Container entrypoint.")
    args: list[Annotated[str, Field(max_length=32768)]] | None = Field(
        None, max_length=256, description="Container arguments.")
    env: list[EnvVar] = Field(default_factory=list, max_length=256)
    resources: ResourceRequirements = nested(ResourceRequirements, "Per-replica resources.")
    accelerator: AcceleratorSpec = nested(AcceleratorSpec, "Accelerator of each replica.")
    spot: SpotSpec = nested(SpotSpec, "Spot capacity.")
    pod_template: PodTemplateOverride = nested(
        PodTemplateOverride, "Node selectors, tolerations, volumes... added to every pod."
    )
    trainer: FreeForm = Field(
        default_factory=dict, description="Free-form trainer configuration, passed as JSON."
    )
    checkpoint: CheckpointSpec = Field(description="Checkpoint location and policy.")
    failure_policy: FailurePolicy = nested(FailurePolicy, "Restart budget and backoff.")
    preemption: PreemptionSpec = nested(
        PreemptionSpec, "The window a node shutdown gives the ranks to save.")
    suspend: bool = Field(False, description="Stop all pods (after a save) and keep the job.")
    network_policy: NetworkPolicySpec = nested(NetworkPolicySpec, "Network isolation.")
    topology: TopologySpec | None = Field(
        None, description="Under Kueue: ask its Topology Aware Scheduling to place the ranks "
        "(`{}`: any placement Kueue finds; a multi-host TPU slice always keeps each slice in one "
        "node pool, cloud.google.com/gke-nodepool).")

    cel_rules = (
        CelRule("!has(self.minReplicas) || self.minReplicas <= self.replicas",
                "spec.minReplicas must be <= spec.replicas", ".minReplicas"),
        CelRule("!has(self.maxReplicas) || self.replicas <= self.maxReplicas",
                "spec.replicas must be <= spec.maxReplicas", ".replicas"),
        CelRule("!has(self.minReplicas) || !has(self.maxReplicas) || "
                "self.minReplicas <= self.maxReplicas",
                "spec.minReplicas must be <= spec.maxReplicas", ".minReplicas"),
        # Replicas are hosts; several whole slices of the topology make a multislice job.
        _whole_slices_rule("replicas", "so does kubectl scale --replicas"),
        # A TPU job shrinks and grows by whole slices, so its bounds are whole slices too.
        _whole_slices_rule("minReplicas", "the job shrinks by whole slices"),
        _whole_slices_rule("maxReplicas", "the job grows by whole slices"),
        # One-host slices (v5e/v6e 1x1, 2x2, one-host 2x4; v4/v5p 2x2x1) cannot be joined.
        _single_host_rule("replicas"),
        _single_host_rule("maxReplicas"),
    )

    @field_validator("trainer")
    @classmethod
    def _trainer_fits_the_environment(cls, value: dict[str, Any]) -> dict[str, Any]:
        # Measured first, without recursion (a value cut out while decoding counts as the
        # levels it had: tardigrade_contract.boundedjson), before the size check recurses.
        depth = nesting_depth(value)
        if depth > MAX_TRAINER_CONFIG_DEPTH:
            raise PydanticCustomError(
                "trainer_depth",
                "the trainer config is nested {depth} levels deep; at most {limit} are "
                "accepted (every rank parses it, and Python's json stops near 1,000): flatten "
                "it, or put it in a ConfigMap or volume (podTemplate.volumes) and pass its path "
                "in spec.trainer",
                {"depth": depth, "limit": MAX_TRAINER_CONFIG_DEPTH},
            )
        # The config reaches every rank as one environment variable, and Linux refuses to start
        # a process with an environment string above 128 KiB. Not expressible in the CRD.
        size = len(json.dumps(value, separators=(",", ":")))
        if size > MAX_TRAINER_CONFIG_BYTES:
            raise PydanticCustomError(
                "trainer_size",
                "the trainer config is {size} bytes as JSON; at most {limit} fit in the "
                "container environment: put large settings in a ConfigMap or volume "
                "(podTemplate.volumes) and pass their path in spec.trainer",
                {"size": size, "limit": MAX_TRAINER_CONFIG_BYTES},
            )
        return value


# -------------------------------------------------------------------------------- status ---

Phase = Literal["Pending", "Queued", "Running", "Restarting", "Resizing", "Suspended", "Succeeded",
                "Failed"]
RecoveryCause = Literal["Preemption", "Retry", "Failure", "Resize", "Resume", "NodeRejected",
                        "Migration"]


# metav1.Condition's validation, as upstream declares it (apimachinery pkg/apis/meta/v1/types.go,
# type Condition), so tools that read conditions generically can rely on the shape.
CONDITION_TYPE_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"
)
CONDITION_REASON_PATTERN = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
# metav1.Condition's limits on reason and message (same file); the status message and each
# recovery's reason keep to them too, so one text fits wherever the operator writes it.
MAX_REASON_LENGTH = 1024
MAX_MESSAGE_LENGTH = 32768
# Why a progress report was ignored: a short error naming the field, never the report itself.
MAX_IGNORED_REPORT_LENGTH = 4096


class Condition(ApiModel):
    """A standard Kubernetes condition (metav1.Condition)."""

    type: str = Field(max_length=316, pattern=CONDITION_TYPE_PATTERN,
                      description="Condition type, CamelCase (see the conditions table).")
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(min_length=1, max_length=MAX_REASON_LENGTH,
                        pattern=CONDITION_REASON_PATTERN,
                        description="Why the condition last changed, CamelCase.")
    message: str = Field(max_length=MAX_MESSAGE_LENGTH,
                         description="Human-readable detail; may be empty.")
    last_transition_time: Timestamp = Field(
        description="When status last changed (not when reason or message did).")
    observed_generation: int | None = Field(
        None, ge=0, description="metadata.generation the condition was computed from.")


class RestoreRequest(ApiModel):
    """A spec.checkpoint.restoreStep the operator has passed on to the trainer."""

    step: int = Field(ge=0)
    request: str = Field(max_length=128,
                         description="Id the trainer applies it once under: <job uid>/a<attempt>.")


class CheckpointRef(ApiModel):
    """A committed checkpoint."""

    step: int = Field(ge=0)
    time: Timestamp | None = None
    path: str | None = None


class RestartCounts(ApiModel):
    """Gang restarts by cause."""

    preemptions: int = Field(0, ge=0)
    failures: int = Field(0, ge=0)
    resizes: int = Field(0, ge=0)
    retries: int = Field(0, ge=0, description="Restarts after exit codes marked retryable.")
    rejections: int = Field(
        0, ge=0, description="Relaunches after a kubelet refused to admit a pod (OutOf<resource>, "
        "NodeAffinity, NodeShutdown...): a placement problem, never charged to maxRestarts.")
    migrations: int = Field(
        0, ge=0, description="Planned relaunches off nodes with host maintenance scheduled "
        "(preemption.maintenanceLeadSeconds): neither a failure nor a preemption.")
    total: int = Field(0, ge=0, description="Sum of the above, for `kubectl get`.")
    consecutive_retries: int = Field(
        0, ge=0, description="Retries since a gang last ran for failurePolicy."
        "backoffResetSeconds: bounded by maxRetries, and sets the retry backoff.")
    consecutive_rejections: int = Field(
        0, ge=0, description="Admission rejections since a gang last ran for failurePolicy."
        "backoffResetSeconds: sets their backoff.")


class Recovery(ApiModel):
    """One relaunch of the gang."""

    cause: RecoveryCause
    time: Timestamp
    attempt: int = Field(ge=0, description="The attempt that was launched.")
    downtime_seconds: float | None = Field(
        None, ge=0, description="From the disruption until the new gang trained again."
    )
    steps_lost: int | None = Field(
        None, ge=0, description="Steps trained but not in the restored checkpoint."
    )
    from_replicas: int | None = Field(None, ge=0)
    to_replicas: int | None = Field(None, ge=0)
    restore_step: int | None = Field(None, ge=0, description="Checkpoint step restored.")
    kept_pods: int | None = Field(
        None, ge=0, description="Pods kept and restarted in place (the rest were recreated).")
    recreated_ranks: str | None = Field(
        None, max_length=16384, pattern=r"^[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*$",
        description="With keptPods: the ranks that got a new pod, as ranges (\"3,5-7\"); "
        "their old pods never count in the new attempt, however late the operator sees "
        "them deleted.")
    gang_formed_time: Timestamp | None = Field(
        None, description="When rank 0 first reported progress in this attempt: every rank "
        "had met in it, including kept ranks that restarted in process (no container "
        "restart shows that).")
    reason: str = Field("", max_length=MAX_REASON_LENGTH)


MAX_RECOVERY_HISTORY = 20


class QueueStatus(ApiModel):
    """Kueue admission of a job labelled kueue.x-k8s.io/queue-name (docs/kueue.md)."""

    local_queue: str = Field(max_length=253, description="The LocalQueue (the label's value).")
    workload: str | None = Field(None, max_length=253,
                                 description="The Workload the operator owns for the gang.")
    cluster_queue: str | None = Field(None, max_length=253,
                                      description="The ClusterQueue that admitted it.")
    admitted: bool = Field(False, description="Kueue admitted the gang (quota reserved).")
    admitted_replicas: int | None = Field(
        None, ge=0, description="The replicas the job holds quota for: the count Kueue "
        "admitted, less what a shrink handed back (reclaimablePods).")
    growing_to: int | None = Field(
        None, ge=0, description="A larger count asked for that waits in the queue while the "
        "gang trains at the admitted one.")
    message: str = Field("", max_length=MAX_MESSAGE_LENGTH,
                         description="Why the job waits, in Kueue's words.")


GoodputBucket = Literal["queued", "podStart", "acceleratorStart", "restore", "compile",
                        "checkpointStall", "lostSteps", "productive", "other"]


def _bucket(description: str) -> Any:
    return Field(0.0, ge=0, description=description)


class GoodputSeconds(ApiModel):
    """The job's wall time, in seconds, split by where it went; the buckets add up to
    goodput.wallSeconds (docs/platform-tools.md, "Goodput")."""

    queued: float = _bucket("Waiting for capacity or admission: Pending or Queued (Kueue), "
                            "and pods not yet scheduled.")
    pod_start: float = _bucket("Pods scheduled until their containers run (image pull, "
                               "volumes, container start).")
    accelerator_start: float = _bucket("The trainer's start: process start until its devices "
                                       "are up and jax.distributed is initialised.")
    restore: float = _bucket("Restoring the checkpoint (or initialising a new state).")
    compile: float = _bucket("The step loop waiting for its compiled step.")
    checkpoint_stall: float = _bucket("The step loop blocked by checkpoint saves.")
    lost_steps: float = _bucket("Computing steps a disruption lost: steps past the checkpoint "
                                "the next attempt restored.")
    productive: float = _bucket("The step loop's time on steps that were kept.")
    other: float = _bucket("The rest: a disrupted gang stopping, backoff, the operator's "
                           "reaction time, a suspended job, trainer time outside its phases.")


class GoodputTrainerPhases(ApiModel):
    """The last phase seconds the current attempt's trainer reported (ProgressReport)."""

    attempt: int = Field(ge=0)
    accelerator_start: float = Field(0.0, ge=0)
    restore: float = Field(0.0, ge=0)
    compile: float = Field(0.0, ge=0)
    checkpoint_stall: float = Field(0.0, ge=0)
    train: float = Field(0.0, ge=0)


class Goodput(ApiModel):
    """The job's goodput account: its wall time since creation, split into buckets."""

    wall_seconds: float = Field(0.0, ge=0, description="From the job's creation to "
                                "accountedUntil (to its completion once it ended).")
    fraction: float = Field(0.0, ge=0, le=1, description="seconds.productive / wallSeconds.")
    seconds: GoodputSeconds = Field(default_factory=GoodputSeconds)
    accounted_until: Timestamp = Field(description="The time the account runs to; written "
                                       "with other status changes, at least every 5 minutes.")
    attempt: int = Field(0, ge=0, description="The attempt the account last saw.")
    current: GoodputBucket | None = Field(
        None, description="The bucket the time after accountedUntil goes to, as last observed "
        "(\"productive\": the trainer's report splits it); none once the job ended.")
    unexplained_seconds: float = Field(
        0.0, ge=0, description="Time of the running attempt its trainer has not yet accounted "
        "for (in acceleratorStart before its first report, in other after): its next report "
        "moves it into the phases it names.")
    trainer: GoodputTrainerPhases | None = Field(
        None, description="The current attempt trainer's last reported phase seconds.")
    seconds_per_step: float | None = Field(
        None, ge=0, description="The step loop's seconds per step, from the trainer's report: "
        "prices the steps a disruption loses.")


class TrainingJobStatus(ApiModel):
    """The observed state of a TrainingJob, written by the operator."""

    phase: Phase = "Pending"
    replicas: int = Field(0, ge=0, description="Replicas of the current attempt.")
    slices: int | None = Field(
        None, ge=0, description="TPU slices of the current attempt (replicas counts their "
        "hosts); unset for GPU and CPU jobs.")
    selector: str = Field("", description="Label selector of the pods (scale subresource).")
    attempt: int = Field(0, ge=0, description="Launch epoch: bumped on every gang relaunch.")
    observed_generation: int = Field(0, ge=0)
    step: int | None = Field(None, ge=0, description="Latest training step reported.")
    total_steps: int | None = Field(None, ge=0)
    loss: float | None = None
    last_checkpoint: CheckpointRef | None = None
    restore_request: RestoreRequest | None = Field(
        None, description="The rollback (spec.checkpoint.restoreStep) launches carry.")
    last_progress_time: Timestamp | None = Field(
        None, description="When rank 0's reported step was last seen advancing: a rank whose "
        "node stopped reporting is declared lost only once the gang stopped making progress.")
    ignored_progress_report: str | None = Field(
        None, max_length=MAX_IGNORED_REPORT_LENGTH,
        description="Why rank 0's progress reports are being ignored (one broke the "
        "operator-trainer contract, e.g. a step sent as a string); cleared by the next valid "
        "one. A Warning event MalformedProgressReport is posted once when it is set.")
    restarts: RestartCounts = Field(default_factory=RestartCounts)
    start_time: Timestamp | None = None
    completion_time: Timestamp | None = None
    conditions: list[Condition] = Field(
        default_factory=list, max_length=32,
        description="metav1.Conditions, one per type (Ready, Reconciling, Stalled...).",
        # A list-map keyed on type, as for core types: one entry per type, and server-side
        # apply merges entries by type instead of replacing the list.
        json_schema_extra={"x-kubernetes-list-type": "map",
                           "x-kubernetes-list-map-keys": ["type"]},
    )
    message: str = Field("", max_length=MAX_MESSAGE_LENGTH)
    recoveries: list[Recovery] = Field(default_factory=list, max_length=MAX_RECOVERY_HISTORY)
    queue: QueueStatus | None = Field(
        None, description="Kueue admission, for a job labelled kueue.x-k8s.io/queue-name.")
    goodput: Goodput | None = Field(
        None, description="Where the job's wall time went (queued, starting, restoring, "
        "compiling, saving, lost to disruptions, training): the goodput account.")


class ObjectMeta(BaseModel):
    """The part of metav1.ObjectMeta that the API checks; the rest passes through."""

    model_config = ConfigDict(extra="allow")

    name: str
    namespace: str | None = None


class TrainingJob(ApiModel):
    """A JAX training job that survives preemptions and resizes."""

    api_version: Literal["tardigrade.dev/v1alpha1"] = Field(API_VERSION)
    kind: Literal["TrainingJob"] = Field(KIND)
    metadata: ObjectMeta
    spec: TrainingJobSpec
    status: TrainingJobStatus | None = None

    cel_rules = (
        CelRule(
            f"self.metadata.name.matches('{JOB_NAME_PATTERN}') && "
            f"size(self.metadata.name) <= {MAX_JOB_NAME_LENGTH}",
            f"metadata.name must be a lowercase DNS label (a-z, 0-9, '-', starting with a "
            f"letter) of at most {MAX_JOB_NAME_LENGTH} characters: it names the pods and the "
            f"headless Service",
            ".metadata.name",
        ),
    )
