"""Where the local cluster keeps its state: the one layout every component agrees on.

Everything lives under one state directory (default `.tardigrade/local` in the current
directory) so that `tardigrade local down` can remove it in one step.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

DEFAULT_STATE_DIR = Path(".tardigrade") / "local"
ENV_STATE_DIR = "TARDIGRADE_LOCAL_STATE_DIR"


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """File names under one cluster's state directory."""

    root: Path

    @classmethod
    def default(cls) -> StateLayout:
        return cls(Path(os.environ.get(ENV_STATE_DIR) or DEFAULT_STATE_DIR).absolute())

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    @property
    def cluster_info(self) -> Path:
        """JSON written once the cluster is ready: pid, API URL, control URL, GCS URL."""
        return self.root / "cluster.json"

    @property
    def cluster_log(self) -> Path:
        return self.root / "cluster.log"

    @property
    def audit_log(self) -> Path:
        """The API server's authorization decisions, one JSON line each (apiserver/access.py)."""
        return self.root / "audit.log"

    @property
    def gcs_dir(self) -> Path:
        return self.root / "gcs"

    @property
    def pods_dir(self) -> Path:
        return self.root / "pods"

    @property
    def nodes_dir(self) -> Path:
        return self.root / "nodes"

    def node_root(self, node: str) -> Path:
        """The node's own root filesystem (its `/`): where its emptyDir and hostPath volumes
        live (`simulator/volumes.py`). Everything outside is shared by all nodes."""
        return self.nodes_dir / node

    def pod_dir(self, namespace: str, pod: str) -> Path:
        # `_` cannot occur in namespace or pod names (RFC 1123), so the split is unambiguous.
        return self.pods_dir / f"{namespace}_{pod}"

    def termination_log(self, namespace: str, pod: str, container: str) -> Path:
        """Where a simulated container's `terminationMessagePath` points on this machine."""
        return self.pod_dir(namespace, pod) / f"{container}.termination-log"


def project_python_path() -> list[str]:
    """Source folders of this checkout, so processes beside the cluster (the cluster's own,
    an operator, test subprocesses) import our packages without an install."""
    repo = Path(__file__).resolve().parents[2]
    return [str(repo / d) for d in ("local_cluster", "operator", "trainer_image")]
