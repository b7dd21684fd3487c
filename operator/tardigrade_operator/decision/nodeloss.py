"""Ranks on nodes that stopped reporting: lost, merely suspect, or given up on. Pure.

What Kubernetes does when a VM stops without a shutdown (local_cluster/README.md, "Ungraceful
node loss", has the sources): the Node object stays; after the node monitor grace period (40 s
before 1.32, 50 s since) the node lifecycle controller sets Ready=Unknown and taints it
`node.kubernetes.io/unreachable:NoExecute`; its pods stay Running in the API; after their
toleration (300 s by default) the taint manager deletes them, and they stay Terminating until
the Node object is deleted or tainted `out-of-service`, because no kubelet confirms the kill.
The same Ready=False/Unknown is also what a kubelet restart or a short partition looks like,
and then the ranks keep training.

So a rank is lost when its node has been not Ready for `lost_after` *and* the gang stopped
making progress for as long (collectives need every rank: a dead rank stops rank 0's step);
before that it is only suspect. Waiting for Kubernetes to delete or fail those pods would
take minutes or forever, so a gang being torn down gives up on pods such nodes hold.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import datetime, timedelta

from tardigrade_operator.decision.plan import FORCE_DELETE_AFTER
from tardigrade_operator.observation.observed import Observed
from tardigrade_operator.observation.pods import PodView

# A node whose Ready condition carries no lastTransitionTime: no way to tell how long it has
# been down, so it counts as down for good (the behaviour before flaps were tolerated).
FOREVER = timedelta.max


@dataclasses.dataclass(frozen=True)
class NodeWatch:
    """The nodes as the operator's index shows them, and the gang's last sign of life."""

    ready: Mapping[str, bool] | None  # newest Node object of each name -> Ready is True
    not_ready_since: Mapping[str, datetime]  # Ready's lastTransitionTime, for nodes not Ready
    now: datetime
    lost_after: timedelta
    last_progress: datetime | None  # when rank 0's step was last seen advancing
    # A deleted pod whose node never confirmed the kill this long past its deadline.
    confirm_within: timedelta

    def down_for(self, pod: PodView) -> timedelta | None:
        """How long the pod's node has not been Ready; None when Ready or not in the index
        (a node newer than the index is not a lost one)."""
        if self.ready is None or not pod.node_name or self.ready.get(pod.node_name) is not False:
            return None
        since = self.not_ready_since.get(pod.node_name)
        return FOREVER if since is None else max(timedelta(0), self.now - since)

    def progressing(self) -> bool:
        return self.last_progress is not None and self.now - self.last_progress < self.lost_after

    def suspect(self, pod: PodView) -> bool:
        """On a node that is not Ready, not (yet) lost."""
        return pod.active and self.down_for(pod) is not None

    def lost(self, pod: PodView) -> bool:
        down = self.down_for(pod)
        return (pod.active and down is not None and down >= self.lost_after
                and not self.progressing())

    def given_up(self, pod: PodView) -> bool:
        """A pod of a gang being torn down that no kubelet will ever report as stopped: the
        relaunch does not wait for it, and its tracking finalizer is released."""
        if not pod.active:
            return False
        down = self.down_for(pod)
        if down is not None and down >= self.lost_after:
            return True
        # Deleted (by us, or by the taint manager) and never confirmed: without a kubelet the
        # pod stays Terminating for good. Only a node seen Ready is still trusted to report;
        # without node access (a namespaced install) this is the only sign there is.
        deadline = pod.deletion_timestamp
        trusted = self.ready is not None and self.ready.get(pod.node_name or "") is True
        return (not trusted and deadline is not None
                and self.now - deadline > self.confirm_within)

    def describe(self, pod: PodView) -> str:
        down = self.down_for(pod)
        seconds = ("(since when unknown)" if down is None or down == FOREVER
                   else f"for {down.total_seconds():.0f}s")
        if self.last_progress is None:
            quiet = "no progress reported"
        else:
            quiet = f"no progress for {(self.now - self.last_progress).total_seconds():.0f}s"
        return f"{pod.name}: node {pod.node_name} not ready {seconds}, {quiet}"


def node_watch(obs: Observed) -> NodeWatch:
    return NodeWatch(ready=obs.nodes_ready, not_ready_since=obs.nodes_not_ready_since,
                     now=obs.now, lost_after=obs.settings.node_lost_after,
                     last_progress=obs.status.last_progress_time,
                     confirm_within=FORCE_DELETE_AFTER)
