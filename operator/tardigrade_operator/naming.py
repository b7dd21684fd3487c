"""Names and labels of a TrainingJob's children: the one place that spells them."""

from __future__ import annotations

from tardigrade_operator.api import types

LABEL_JOB = f"{types.GROUP}/job"
LABEL_ATTEMPT = f"{types.GROUP}/attempt"
LABEL_RANK = f"{types.GROUP}/rank"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_NAME = "app.kubernetes.io/name"
MANAGED_BY = "tardigrade"
TRAINER_CONTAINER = "trainer"
# Keeps a finished pod (and its termination message: the step it saved) until the operator
# has recorded it, like the Job controller's tracking finalizer.
POD_FINALIZER = f"{types.GROUP}/gang-tracking"
COORDINATOR_PORT_NAME = "coordinator"
PROGRESS_PORT_NAME = "progress"
REPLICA_PORT_NAME = "replicas"


def service_name(job: str) -> str:
    """The headless Service that gives ranks stable DNS names."""
    return job


def keys_secret_name(job: str) -> str:
    """The Secret with the job's keys (keys.py). A job name is a DNS label (at most 63
    characters), so this stays well inside a Secret name's 253."""
    return f"{job}-tardigrade-keys"


def pod_name(job: str, attempt: int, rank: int) -> str:
    # The attempt is part of the name so a new gang never collides with the old one's
    # terminating pods; the name doubles as the pod's hostname.
    return f"{job}-a{attempt}-{rank}"


def pod_labels(job: str, attempt: int, rank: int) -> dict[str, str]:
    return {
        LABEL_NAME: "tardigrade-trainer",
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_JOB: job,
        LABEL_ATTEMPT: str(attempt),
        LABEL_RANK: str(rank),
    }


def job_selector(job: str) -> str:
    """Label selector of all pods of a job (published for the scale subresource)."""
    return f"{LABEL_JOB}={job}"


def coordinator_host(job: str, attempt: int) -> str:
    # <hostname>.<subdomain> resolves through the pod's DNS search path on any cluster domain.
    return f"{pod_name(job, attempt, 0)}.{service_name(job)}"
