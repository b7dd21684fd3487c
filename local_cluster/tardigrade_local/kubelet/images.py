"""Container images -> local programs.

There is no container runtime here, so an image names a program on this machine. A rule gives
the image's ENTRYPOINT and CMD; the pod's `command` and `args` override them exactly as a
container runtime does, so the same pod spec runs here and on GKE. Our shipped images run from
virtualenvs built from their Dockerfiles (`tardigrade_local.imagevenv`): their rule names the
venv's `bin/`, which comes first on the container's PATH as /usr/local/bin does in the image.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# An image reference: [registry/]repository[:tag][@digest].
_DIGEST = re.compile(r"@[A-Za-z0-9_+.-]+:[0-9a-fA-F]+$")
_TAG = re.compile(r":[\w][\w.-]{0,127}$")


@dataclasses.dataclass(frozen=True)
class ImageRule:
    """Images whose repository matches `pattern` (fnmatch) run `entrypoint` + `cmd`."""

    pattern: str
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...] = ()
    # The image's ENV: the pod's env overrides it.
    env: tuple[tuple[str, str], ...] = ()
    # The image's own programs (a virtualenv's bin/); None: the cluster's interpreter and the
    # checkout's sources (images that are not shipped, e.g. `local/python`).
    bin_dir: str | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ImageRule:
        return cls(
            pattern=str(data["pattern"]),
            entrypoint=tuple(str(x) for x in data.get("entrypoint", ())),
            cmd=tuple(str(x) for x in data.get("cmd", ())),
            env=tuple((str(k), str(v)) for k, v in (data.get("env") or {}).items()),
            bin_dir=str(data["bin_dir"]) if data.get("bin_dir") else None,
        )

    def to_dict(self) -> dict[str, Any]:
        return {"pattern": self.pattern, "entrypoint": list(self.entrypoint),
                "cmd": list(self.cmd), "env": dict(self.env), "bin_dir": self.bin_dir}

    def search_path(self, host_path: str) -> str:
        """The container's PATH: the image's programs first."""
        return os.pathsep.join([self.bin_dir, host_path]) if self.bin_dir else host_path


# Python images log unbuffered, so `kubectl logs` shows output as it happens.
_PY_ENV = (("PYTHONUNBUFFERED", "1"),)
# The shipped images (`*tardigrade-operator`, `*tardigrade-trainer`) are not here: their rules
# come from their Dockerfiles (`tardigrade_local.imagevenv.shipped_image_rules`).
DEFAULT_RULES: tuple[ImageRule, ...] = (
    # A bare Python for tests and small demos: command/args say what to run.
    ImageRule("local/python", (), ("python",), _PY_ENV),
    ImageRule("python", (), ("python3",), _PY_ENV),
    ImageRule("docker.io/library/python", (), ("python3",), _PY_ENV),
)

# Interpreter names a pod spec may use; they mean the image's interpreter, or for images
# without a venv the interpreter running the cluster, which has the project's dependencies.
_PYTHON_NAMES = re.compile(r"^(?:/usr(?:/local)?/bin/)?python(?:3(?:\.\d+)?)?$")


class ImagePullError(LookupError):
    """No rule maps this image: the local analogue of a failed pull."""


def repository(image: str) -> str:
    """The image reference without tag and digest (`docker.io/library/` is kept as written)."""
    ref = _DIGEST.sub("", image)
    last = ref.rsplit("/", 1)
    if len(last) == 2:
        return last[0] + "/" + _TAG.sub("", last[1])
    return _TAG.sub("", ref)


@dataclasses.dataclass(frozen=True)
class ImageMap:
    rules: tuple[ImageRule, ...] = DEFAULT_RULES
    python: str = sys.executable

    @classmethod
    def with_extra(cls, extra: Iterable[ImageRule]) -> ImageMap:
        """Extra rules take precedence over the defaults."""
        return cls(rules=(*extra, *DEFAULT_RULES))

    def resolve(self, image: str) -> ImageRule:
        repo = repository(image)
        for rule in self.rules:
            if fnmatch.fnmatchcase(repo, rule.pattern):
                return rule
        raise ImagePullError(
            f'Failed to pull image "{image}": no local program is mapped to repository '
            f'"{repo}" (add an image rule to the local cluster)'
        )

    def argv(self, image: str, command: Sequence[str] | None,
             args: Sequence[str] | None) -> list[str]:
        """The process argv, with Kubernetes' command/args override rules."""
        rule = self.resolve(image)
        if rule.bin_dir and not os.path.exists(os.path.join(rule.bin_dir, "python")):
            raise ImagePullError(
                f'Failed to pull image "{image}": its virtualenv {rule.bin_dir} is not built '
                "(run `python -m tardigrade_local.imagevenv` or scripts/setup)")
        if command:
            argv = [*command, *(args or ())]
        else:
            argv = [*rule.entrypoint, *(args if args else rule.cmd)]
        if not argv:
            raise ImagePullError(f'image "{image}" has no entrypoint and the pod gives no command')
        if _PYTHON_NAMES.match(argv[0]):
            argv[0] = os.path.join(rule.bin_dir, "python") if rule.bin_dir else self.python
        elif rule.bin_dir and "/" not in argv[0]:
            # Resolved against the image's PATH, not the kubelet's.
            own = os.path.join(rule.bin_dir, argv[0])
            argv[0] = own if os.path.exists(own) else argv[0]
        return argv
