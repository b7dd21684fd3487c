"""The pods' gang-tracking finalizer: which pods still need it. Pure.

`naming.POD_FINALIZER` keeps a finished pod, and the step its termination message names, until
the job's reconcile pass has recorded it (`decide._release_recorded` drops it then). It is only
needed while the job lives: once the job is gone or being deleted the pod is released so the
garbage collector can take it, as the Job controller does for its tracking finalizer on pods
whose Job is gone or finished (`pkg/controller/job/job_controller.go`, `syncOrphanPod`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from tardigrade_operator import naming
from tardigrade_operator.api import types


def owner_uid(pod: Mapping[str, Any]) -> str | None:
    """uid of the TrainingJob that owns the pod (its ownerReference), if any."""
    for ref in (pod.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == types.KIND and ref.get("apiVersion") == types.API_VERSION:
            return str(ref.get("uid"))
    return None


def orphaned(pod: Mapping[str, Any], live_uids: Iterable[str]) -> bool:
    """The pod carries our finalizer but no live job of its name has its owner's uid."""
    finalizers = (pod.get("metadata") or {}).get("finalizers") or []
    return naming.POD_FINALIZER in finalizers and owner_uid(pod) not in set(live_uids)
