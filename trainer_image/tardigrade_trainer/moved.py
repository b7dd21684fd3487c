"""The old names of the modules that left this package, importable for one more release.

Up to 0.1 the SDK, the checkpoint library and the contract lived here
(`tardigrade_trainer.session`, `tardigrade_trainer.checkpoint.manager`, ...). Importing an old
name now gives the module under its new name, the same object rather than a copy (so
isinstance checks and monkeypatching act on the one module), with a DeprecationWarning naming
the new import. A meta path finder does this for every old name, submodules of the old
`checkpoint` package included, without a file per name; it imports nothing until an old name
is imported, so this package stays as cheap and jax-free as before.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence

PACKAGE = "tardigrade_trainer"
REMOVED_IN = "0.3.0"
_SDK = ("session", "distributed", "preemption", "checkpoint_backend", "orbax_backend",
        "restore_choice", "peerauth", "inplace", "metrics", "bearer", "phases", "logs",
        "attempts", "accelerator", "savestall")
# Old module name under this package -> its new name; a package's submodules follow it.
MOVED: dict[str, str] = {
    "contract": "tardigrade_contract.contract",
    "boundedjson": "tardigrade_contract.boundedjson",
    "checkpoint": "tardigrade_checkpoint",
    "coordination": "tardigrade_checkpoint.coordination",
    **{name: f"tardigrade_sdk.{name}" for name in _SDK},
}


def new_name(old: str) -> str | None:
    """`tardigrade_sdk.session` for `tardigrade_trainer.session`; None for a name that did not
    move."""
    head, dot, rest = old.removeprefix(PACKAGE + ".").partition(".")
    if not old.startswith(PACKAGE + ".") or head not in MOVED:
        return None
    return MOVED[head] + dot + rest


def _caller_stacklevel() -> int:
    """The stacklevel, as `warnings` counts it from `create_module`, of the code whose import
    named the old module: `warnings` itself skips the import system's frozen frames, so only
    `importlib.import_module`'s own frame is stepped over here."""
    frame, level = sys._getframe(2), 2
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename == importlib.__file__:
            level += 1
        elif not ("importlib" in filename and "_bootstrap" in filename):
            break
        frame = frame.f_back
    return level


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        warnings.warn(f"{self.old} moved: import {self.new} instead (the old name goes in "
                      f"tardigrade {REMOVED_IN})", DeprecationWarning,
                      stacklevel=_caller_stacklevel())
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system stamped the old name's spec on the module; it keeps its own, so
        # that reloads, pickles and `python -m` still see the new name.
        module.__spec__ = self.spec


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Answers for the old names only; every other import goes on to the next finder."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        new = new_name(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(fullname, new))


def install() -> None:
    """Put the finder first: once the old `checkpoint` alias is imported, its __path__ is the
    new package's folder, and the path finder would load a second copy of each submodule
    under its old name."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
