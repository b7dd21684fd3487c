"""Node agents that run pods as local processes (or simulated), against the real API."""

from tardigrade_local.kubelet.config import KubeletSettings
from tardigrade_local.kubelet.host import KubeletHost
from tardigrade_local.kubelet.images import ImageMap, ImageRule

__all__ = ["ImageMap", "ImageRule", "KubeletHost", "KubeletSettings"]
