"""GKE's part of the local cluster: what the cloud and GKE's own controllers do around the
nodes (spot reclaims and lost VMs, host maintenance, node pools and their autoscaler, queued
provisioning, TPU slice pools, deleting the Node of a VM that is gone), acting at the
boundary where GKE acts. Each module cites the GKE docs or upstream source it follows
(local_cluster/README.md says what is not modelled)."""
