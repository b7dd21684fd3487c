"""Each shipped image as a virtualenv, built from its Dockerfile and cached.

The local cluster runs the operator and trainer images from these virtualenvs, and the image
smoke tests import from them, so what runs locally is what `docker build` would install: the
wheel built from the sources the Dockerfile copies, with the extras its install line names.
A venv is rebuilt when its Dockerfile, the project's dependencies or the interpreter change;
when only our own sources change, only our wheel is reinstalled (`--no-deps`, seconds).
What a venv cannot reproduce (base image, USER, OS packages) is listed in docs/images.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path

from tardigrade_local.dockerfile import PROJECT, ImageRecipe, context_files, read_recipe
from tardigrade_local.kubelet.images import ImageRule

log = logging.getLogger(__name__)

# The images the local cluster runs; the GPU/TPU trainer images differ from the CPU one only
# in accelerator wheels that cannot install here (tests/test_images.py checks that).
SHIPPED_DOCKERFILES = ("operator/Dockerfile", "trainer_image/Dockerfile.cpu")
CACHE_ENV = "TARDIGRADE_IMAGE_CACHE"
STAMP = "stamp.json"
PIP_TIMEOUT_SECONDS = 900


class ImageBuildError(RuntimeError):
    pass


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def cache_root() -> Path:
    """Where the venvs live: $TARDIGRADE_IMAGE_CACHE, else .ci/cache/images in the checkout."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured) if configured else repo_root() / ".ci" / "cache" / "images"


def recipes(root: Path | None = None) -> list[ImageRecipe]:
    root = root or repo_root()
    return [read_recipe(root / path, root) for path in SHIPPED_DOCKERFILES]


@dataclasses.dataclass(frozen=True)
class ImageVenv:
    recipe: ImageRecipe
    root: Path

    @property
    def venv(self) -> Path:
        return self.root / "venv"

    @property
    def bin_dir(self) -> Path:
        return self.venv / "bin"

    @property
    def python(self) -> Path:
        return self.bin_dir / "python"

    def dependency_key(self) -> str:
        """Changes when the installed third-party packages could: the Dockerfile's base image,
        RUN lines, sources and extras (not its ENV, LABEL or comments), the project's
        dependencies and those of the extras the image installs, and the interpreter."""
        project = tomllib.loads((self.recipe.context / "pyproject.toml").read_text())
        extras = project["project"].get("optional-dependencies") or {}
        recipe = self.recipe
        relevant = {
            "image": [recipe.base, recipe.runs, recipe.sources, recipe.extras],
            "build-system": project.get("build-system"),
            "dependencies": project["project"].get("dependencies"),
            "extras": {name: extras.get(name) for name in self.recipe.extras},
            "requires-python": project["project"].get("requires-python"),
            "python": sys.version,
        }
        return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()

    def source_key(self) -> str:
        """Changes with any file the Dockerfile copies into the stage that builds our wheel."""
        digest = hashlib.sha256()
        for path, target in context_files(self.recipe):
            digest.update(target.encode() + b"\0" + path.read_bytes() + b"\0")
        return digest.hexdigest()

    def stamp(self) -> dict[str, str]:
        try:
            return dict(json.loads((self.root / STAMP).read_text()))
        except (OSError, ValueError):
            return {}

    def is_current(self) -> bool:
        stamp = self.stamp()
        return (self.python.exists() and stamp.get("dependencies") == self.dependency_key()
                and stamp.get("sources") == self.source_key())

    def rule(self) -> ImageRule:
        """The kubelet's rule for this image: ENTRYPOINT, CMD and ENV from the Dockerfile, its
        programs from the venv."""
        return ImageRule(f"*{self.recipe.title}", self.recipe.entrypoint, self.recipe.cmd,
                         self.recipe.env, bin_dir=str(self.bin_dir))


def image_venv(recipe: ImageRecipe, root: Path | None = None) -> ImageVenv:
    return ImageVenv(recipe, (root or cache_root()) / recipe.name)


def shipped_image(name: str, root: Path | None = None) -> ImageVenv:
    """The venv of the shipped image called `name` ("operator", "trainer-cpu")."""
    return image_venv(next(r for r in recipes() if r.name == name), root)


def shipped_image_rules(root: Path | None = None) -> list[ImageRule]:
    """Kubelet rules for the shipped images (built or not: a missing venv fails the pull)."""
    return [image_venv(recipe, root).rule() for recipe in recipes()]


@contextlib.contextmanager
def _locked(path: Path, shared: bool = False) -> Iterator[None]:
    """One builder per venv across processes (tests and clusters may start together)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run(argv: list[str], what: str, cwd: Path | None = None) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, cwd=cwd,
                            timeout=PIP_TIMEOUT_SECONDS)
    if result.returncode != 0:
        raise ImageBuildError(f"{what} failed ({' '.join(argv)}):\n{result.stderr[-3000:]}")


def _build_wheel(image: ImageVenv, out: Path) -> Path:
    """`pip wheel --no-deps .` over exactly the files the Dockerfile copies."""
    with tempfile.TemporaryDirectory(prefix=f"{image.recipe.name}-context-") as tmp:
        stage = Path(tmp) / "src"
        for path, target in context_files(image.recipe):
            (stage / target).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, stage / target)
        _run([str(image.python), "-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir",
              str(out), str(stage)], f"building the {PROJECT} wheel for {image.recipe.name}")
    wheels = sorted(out.glob("*.whl"))
    if len(wheels) != 1:
        raise ImageBuildError(f"expected one wheel in {out}, found {wheels}")
    return wheels[0]


@contextlib.contextmanager
def in_use(image: ImageVenv) -> Iterator[None]:
    """Hold off other processes' rebuilds and reinstalls while a short command runs from the
    venv (pip's reinstall removes our package before it writes the new one). Pods of a running
    local cluster take no such lock: a source change made while they run reaches their next
    imports."""
    with _locked(image.root.with_suffix(".lock"), shared=True):
        yield


def ensure(image: ImageVenv) -> bool:
    """Make the venv current; True when something was (re)installed."""
    with _locked(image.root.with_suffix(".lock")):
        if image.is_current():
            return False
        dependencies, sources = image.dependency_key(), image.source_key()
        full = not image.python.exists() or image.stamp().get("dependencies") != dependencies
        log.warning("image %s: %s", image.recipe.name,
                    "building its virtualenv (about a minute)" if full
                    else "reinstalling the project wheel")
        if full:
            shutil.rmtree(image.root, ignore_errors=True)
            image.root.mkdir(parents=True)
            _run([sys.executable, "-m", "venv", str(image.venv)], "creating the venv")
        (image.root / STAMP).unlink(missing_ok=True)
        with tempfile.TemporaryDirectory(prefix=f"{image.recipe.name}-wheel-") as out:
            wheel = _build_wheel(image, Path(out))
            extras = ",".join(image.recipe.extras)
            install = [str(image.python), "-m", "pip", "install", "-q"]
            if full:
                install.append(f"{wheel}[{extras}]")
            else:
                install += ["--no-deps", "--force-reinstall", str(wheel)]
            _run(install, f"installing {wheel.name}[{extras}] into {image.venv}")
        (image.root / STAMP).write_text(json.dumps({"dependencies": dependencies,
                                                    "sources": sources}))
        return True


def ensure_all(root: Path | None = None) -> list[ImageVenv]:
    images = [image_venv(recipe, root) for recipe in recipes()]
    for image in images:
        ensure(image)
    return images


def main() -> None:
    """`python -m tardigrade_local.imagevenv`: build or refresh every shipped image's venv."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for image in ensure_all():
        print(f"{image.recipe.name}: {image.venv}")


if __name__ == "__main__":
    main()
