"""The admin rule that keeps each namespace's checkpoints under a prefix of its own.

One operator serves many teams, and a checkpoint path is where the trainer writes, restores
from, and deletes old checkpoints (retention). With the rule set (operator setting
TARDIGRADE_CHECKPOINT_PATH_PREFIX, chart value `checkpointPathPrefix`), e.g.
`gs://ml-checkpoints/{namespace}/`, a job may only use paths below its own namespace's prefix;
anything else fails the job before a pod starts. The rule covers every place the operator
hands the trainer to read or write: the checkpoint path, the checkpoint a job starts from
(`initFrom.path`), and the compilation cache's location when the trainer config moves it
(`compilation_cache_dir`: its entries are programs the trainer runs, so it must not lie where
another namespace writes). The CRD refuses `..` and `.` segments in the checkpoint paths, so a
path that starts with the prefix stays below it; the free-form cache location gets the same
check here.
"""

from __future__ import annotations

import re

from tardigrade_operator.api.types import TrainingJobSpec

PLACEHOLDER = "{namespace}"
# The reference trainer's config key for the cache's location (tardigrade_trainer.config).
CACHE_DIR_KEY = "compilation_cache_dir"
_DOT_SEGMENT = re.compile(r"(^|/)\.\.?(/|$)")


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


def refusal(path: str, namespace: str, template: str | None,
            field: str = "spec.checkpoint.path") -> str | None:
    """Why `path` (the value of `field`) is not allowed for a job in `namespace`; None when it
    is (or no rule)."""
    if not template:
        return None
    prefix = template.replace(PLACEHOLDER, namespace)
    inside = path.startswith(prefix) and len(path) > len(prefix)
    if inside and not _DOT_SEGMENT.search(path):
        return None
    return (f"{field} {path!r} is outside this namespace's checkpoint prefix: the cluster "
            f"admin allows jobs in namespace {namespace} only paths under {prefix}, e.g. "
            f"{prefix}JOB (no '.' or '..' segments); change {field}")


def refusals(spec: TrainingJobSpec, namespace: str, template: str | None) -> list[str]:
    """Why each path the job would use is not allowed; empty when all are (or no rule)."""
    paths = [("spec.checkpoint.path", spec.checkpoint.path)]
    if spec.checkpoint.init_from is not None:
        paths.append(("spec.checkpoint.initFrom.path", spec.checkpoint.init_from.path))
    cache = spec.trainer.get(CACHE_DIR_KEY)
    if isinstance(cache, str):
        # A path or a gs:// URL; anything else the trainer itself refuses (ConfigError).
        paths.append((f"spec.trainer.{CACHE_DIR_KEY}", cache))
    found = (refusal(path, namespace, template, field) for field, path in paths)
    return [why for why in found if why is not None]
