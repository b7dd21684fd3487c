"""A Kubernetes API server emulator for the local cluster (loopback, in memory)."""

from .crd_schema import FieldCause, default_and_prune, validate_custom_resource
from .server import ApiServer, write_kubeconfig

__all__ = ["ApiServer", "FieldCause", "default_and_prune",
           "validate_custom_resource", "write_kubeconfig"]
