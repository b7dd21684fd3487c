"""The node simulator: simulated nodes whose pods run without processes, as on kwok's nodes,
against the real control plane. For benches only (bench/: the control plane and the operator
at a scale of a thousand hosts on two cores), never for a test of behaviour: behaviour is
tested on real nodes (`realcluster.RealNodeCluster`, the real kubelet and containerd).

kwok's nodes cannot run what the benches need of a pod (a Tardigrade rank that forms a gang
with its peers, serves progress and restarts in place), so the simulator has its own node
agents (`host.py`), each a Node with its Lease and status, whose containers are simulated
(`simulated.py`, `simgang.py`)."""

from tardigrade_local.simulator.config import SimulatorSettings
from tardigrade_local.simulator.host import SimulatedHost

__all__ = ["SimulatedHost", "SimulatorSettings"]
