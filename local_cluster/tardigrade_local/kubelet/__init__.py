"""A kubelet that runs pods as local processes, with a simple scheduler and pod GC."""

from tardigrade_local.kubelet.config import KubeletSettings, NodeConfig
from tardigrade_local.kubelet.host import KubeletHost
from tardigrade_local.kubelet.images import ImageMap, ImageRule

__all__ = ["ImageMap", "ImageRule", "KubeletHost", "KubeletSettings", "NodeConfig"]
