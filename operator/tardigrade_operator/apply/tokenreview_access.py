"""TokenReview for the trainers that run, and no other ServiceAccount.

Rank 0 of a gang checks each peer's projected token with a TokenReview (trainer peerauth.py),
so the trainers' ServiceAccounts need `create tokenreviews`. TokenReview is cluster-scoped: a
RoleBinding cannot grant it, only a ClusterRoleBinding. In namespaced mode the chart knows the
namespaces and the accounts the admin allows (admission.serviceAccounts) and renders the
binding's subjects itself. Cluster-wide, the namespaces are not known in advance, so the chart
renders the binding without subjects and the operator adds a job's (namespace, account) to it
before it creates the job's pods (operator setting TARDIGRADE_TOKEN_REVIEW_BINDING).

What that needs is narrow: get and update of that one binding, and bind of its one role
(RBAC's escalation check asks it of whoever updates a binding), both by resourceName. A
binding's roleRef cannot change, so the most the grant allows is TokenReview for more
accounts. Subjects are only ever added: a namespace whose jobs are gone keeps its entry (it
lets that account ask whether a token is valid, no more); an admin may prune them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)

# Conflicting writers (another replica, helm) are rare; a few tries settle it.
UPDATE_TRIES = 5


def subject(namespace: str, account: str) -> dict[str, str]:
    return {"kind": "ServiceAccount", "name": account, "namespace": namespace}


def with_subject(binding: dict[str, Any], namespace: str, account: str
                 ) -> dict[str, Any] | None:
    """`binding` with the account added, or None when it is there already."""
    wanted = subject(namespace, account)
    subjects = list(binding.get("subjects") or [])
    if any({k: s.get(k) for k in wanted} == wanted for s in subjects):
        return None
    return {**binding, "subjects": [*subjects, wanted]}


def ensure(read: Callable[[], dict[str, Any]], replace: Callable[[dict[str, Any]], None],
           namespace: str, account: str) -> bool:
    """Make sure the binding (`read` it, `replace` it) lists the account; True when it had
    to be added. The replacement carries the resourceVersion read, so a concurrent change
    (409 Conflict) is read again, not lost."""
    for _ in range(UPDATE_TRIES):
        updated = with_subject(read(), namespace, account)
        if updated is None:
            return False
        try:
            replace(updated)
        except ApiException as err:
            if err.status == 409:
                continue
            raise
        log.info("TokenReview granted to ServiceAccount %s/%s", namespace, account)
        return True
    raise RuntimeError(f"the trainers' TokenReview binding kept changing: could not add "
                       f"{namespace}/{account} in {UPDATE_TRIES} tries")
