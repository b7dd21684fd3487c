"""A refusal that only says the API server has not caught up is told from a real error."""

from __future__ import annotations

import json

from kubernetes.client.exceptions import ApiException
from tardigrade_operator.apply import server_lag


def _refused(status: int, message: str) -> ApiException:
    err = ApiException(status=status, reason="Forbidden")
    err.body = json.dumps({"kind": "Status", "status": "Failure", "reason": "Forbidden",
                           "code": status, "message": message})
    return err


LAG = ('secrets "job-tardigrade-keys" is forbidden: cannot set blockOwnerDeletion in this case '
       'because cannot find RESTMapping for APIVersion tardigrade.dev/v1alpha1 Kind '
       'TrainingJob: no matches for kind "TrainingJob" in version "tardigrade.dev/v1alpha1"')


def test_the_admission_restmapper_lag_is_explained():
    why = server_lag.explain(_refused(403, LAG))
    assert why is not None and "30 s" in why


def test_other_refusals_and_errors_are_not():
    finalizers = ('secrets "job-tardigrade-keys" is forbidden: cannot set blockOwnerDeletion '
                  "if an ownerReference refers to a resource you can't set finalizers on")
    assert server_lag.explain(_refused(403, finalizers)) is None
    assert server_lag.explain(_refused(500, LAG)) is None
    assert server_lag.explain(ValueError(LAG)) is None
