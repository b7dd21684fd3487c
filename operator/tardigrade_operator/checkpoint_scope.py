"""The admin rule that keeps each namespace's checkpoints under a prefix of its own.

One operator serves many teams, and a checkpoint path is where the trainer writes, restores
from, and deletes old checkpoints (retention). With the rule set (operator setting
TARDIGRADE_CHECKPOINT_PATH_PREFIX, chart value `checkpointPathPrefix`), e.g.
`gs://ml-checkpoints/{namespace}/`, a job may only use paths below its own namespace's prefix;
anything else fails the job before a pod starts. The CRD already refuses `..` and `.` path
segments, so a path that starts with the prefix stays below it.
"""

from __future__ import annotations

PLACEHOLDER = "{namespace}"


def check_prefix_template(template: str) -> str:
    """The template as given, or ValueError saying what a usable one looks like."""
    example = "e.g. gs://BUCKET/{namespace}/ or /mnt/ckpt/{namespace}/"
    if template.count(PLACEHOLDER) != 1:
        raise ValueError(f"checkpoint path prefix {template!r} must contain {PLACEHOLDER} "
                         f"exactly once, {example}")
    if not (template.startswith("gs://") or template.startswith("/")):
        raise ValueError(f"checkpoint path prefix {template!r} must be a gs:// URI or an "
                         f"absolute path, {example}")
    if not template.endswith("/"):
        raise ValueError(f"checkpoint path prefix {template!r} must end with '/' so that "
                         f"namespace a cannot use the prefix of namespace ab, {example}")
    return template


def refusal(path: str, namespace: str, template: str | None) -> str | None:
    """Why `path` is not allowed for a job in `namespace`; None when it is (or no rule)."""
    if not template:
        return None
    prefix = template.replace(PLACEHOLDER, namespace)
    if path.startswith(prefix) and len(path) > len(prefix):
        return None
    return (f"spec.checkpoint.path {path!r} is outside this namespace's checkpoint prefix: "
            f"the cluster admin allows jobs in namespace {namespace} only paths under "
            f"{prefix}, e.g. {prefix}JOB; change spec.checkpoint.path")
