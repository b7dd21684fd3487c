"""Pod-name resolution for processes beside the local cluster (tests, an operator process).

The implementation lives in the pod site directory (`kubelet/podsite/tardigrade_podnet.py`)
because pods, whose images do not contain `tardigrade_local`, load it from there. It is loaded
here under its own top-level name, so a process that has the site directory on PYTHONPATH
(`LocalCluster.client_env()`) and also imports this module patches the socket module once.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

MODULE = "tardigrade_podnet"


def _load() -> ModuleType:
    if MODULE in sys.modules:
        return sys.modules[MODULE]
    path = Path(__file__).resolve().parent / "kubelet" / "podsite" / f"{MODULE}.py"
    spec = importlib.util.spec_from_file_location(MODULE, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE] = module
    spec.loader.exec_module(module)
    return module


_podnet = _load()
ENV_HOSTS_FILE: str = _podnet.ENV_HOSTS_FILE
ENV_POD_IP: str = _podnet.ENV_POD_IP
install = _podnet.install
install_from_env = _podnet.install_from_env
lookup = _podnet.lookup
