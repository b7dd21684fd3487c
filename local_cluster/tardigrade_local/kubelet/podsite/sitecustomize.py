"""Loaded by every Python process the local kubelet starts (its directory is on PYTHONPATH).

Gives the process the pod network it would have in a real pod: see `tardigrade_podnet.py`
beside this file. Standard library only: shipped images run from venvs without our local
cluster package.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import os
import sys


def _chain() -> None:
    """Run the sitecustomize this one shadows, if the interpreter has one."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


if os.environ.get("TARDIGRADE_HOSTS_FILE"):
    # A pod whose own PYTHONPATH hides this directory still starts, without cluster names.
    with contextlib.suppress(ImportError):
        from tardigrade_podnet import install_from_env

        install_from_env()
_chain()
