"""API server refusals that only say the server has not caught up yet, told apart from real
errors so that a retried pass logs one line instead of a traceback."""

from __future__ import annotations

from kubernetes.client.exceptions import ApiException

# kube-apiserver's OwnerReferencesPermissionEnforcement maps an owner reference's kind with
# the admission RESTMapper, which reloads discovery every 30 s (k8s.io/kubernetes,
# pkg/kubeapiserver/admission/config.go: `discoveryRESTMapper.Reset` on a 30 s timer). For up
# to 30 s after the TrainingJob CRD is installed (`helm install`), creating an object owned by
# a TrainingJob with blockOwnerDeletion is refused with 403 and this text.
RESTMAPPER_LAG = "cannot find RESTMapping for APIVersion"


def explain(err: BaseException) -> str | None:
    """Why `err` is the server catching up, to be retried without alarm; None for anything
    else."""
    if isinstance(err, ApiException) and err.status == 403 and RESTMAPPER_LAG in str(
            err.body or ""):
        return ("the API server's admission does not know the owner's kind yet (it reloads "
                "its discovery every 30 s after a CRD is installed)")
    return None
