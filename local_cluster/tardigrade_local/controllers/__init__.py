"""Workload controllers of the local cluster: Deployment -> ReplicaSet -> Pods.

`deployment.py` and `replicaset.py` decide (pure functions of observed objects and the time);
`manager.py` observes and acts. See `manager.py` for what is simplified against upstream.
"""

from tardigrade_local.controllers.manager import WorkloadControllers

__all__ = ["WorkloadControllers"]
