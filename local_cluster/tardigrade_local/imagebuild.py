"""Build the shipped images for real, from their Dockerfiles, with buildah.

No Docker engine runs here and Docker Hub cannot be reached, so:
- the base image is made from Debian 12's packages (`mmdebstrap`: Python 3.11, pip, venv, on
  the `minbase` variant that `debian:bookworm-slim` also is), laid out as the Dockerfiles
  expect of `python:3.11-slim` (`python`, `pip` on PATH, pip free to install as root), and
  handed to the Dockerfiles through their `BASE_IMAGE` build argument;
- `buildah bud --isolation chroot` builds each Dockerfile unchanged (no daemon; RUN steps use
  the host's network to reach PyPI);
- images are stored by buildah under the cache root (~/.cache/tardigrade/containers), tagged
  with a key of everything that decides them (the Dockerfile, every file it copies after
  .dockerignore, the base image's id, the build arguments and buildah's version), so a second
  build with the same inputs is a lookup, and a changed source builds afresh;
- `push` copies a built image to a registry (`registry.py`), as a GKE user's images go to
  Artifact Registry.

`python -m tardigrade_local.imagebuild [operator trainer-cpu ...]` builds what is missing.
Only RUN steps differ from a Docker build, and only in what the machine gives them: this
machine reaches PyPI through a TLS-inspecting proxy, so the host's CA bundle is mounted (read
only) over the image's while RUN steps run; it is not part of the image.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TextIO

from tardigrade_local.dockerfile import (
    ImageRecipe,
    context_files,
    copied_files,
    parse_stages,
    read_recipe,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = {"operator": "operator/Dockerfile", "trainer-cpu": "trainer_image/Dockerfile.cpu",
               "trainer-tpu": "trainer_image/Dockerfile.tpu",
               "trainer-gpu": "trainer_image/Dockerfile.gpu"}
# Built by default (setup, tests). The GPU image is 3.2 GB of CUDA wheels: built only by name.
DEFAULT_IMAGES = ("operator", "trainer-cpu", "trainer-tpu")
BASE_ARG = "BASE_IMAGE"
# The Dockerfiles' default base, fully qualified (buildah resolves no short names unasked).
PUBLIC_BASE = "docker.io/library/python:3.11-slim"
REPOSITORY = "tardigrade-dev"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
BUILD_TIMEOUT_SECONDS = 3600
STORAGE_DRIVER_ENV = "TARDIGRADE_BUILDAH_DRIVER"

# The local base: what `python:3.11-slim` gives the Dockerfiles, from Debian 12's packages.
BASE_SUITE = "bookworm"
BASE_MIRRORS = ("deb http://deb.debian.org/debian bookworm main",
                "deb http://deb.debian.org/debian bookworm-updates main",
                "deb http://deb.debian.org/debian-security bookworm-security main")
BASE_PACKAGES = ("python3", "python3-venv", "python3-pip", "python-is-python3",
                 "ca-certificates", "netbase")
# python:3.11-slim lets pip install into the system interpreter as root; Debian 12 marks its
# interpreter externally managed (PEP 668), and PEP 668 leaves removing the marker to container
# images. pip then installs under /usr/local (bin/ on PATH), as there.
BASE_HOOKS = ('rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED',)
BASE_CONFIG = (("--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"),
               ("--env", "LANG=C.UTF-8"), ("--cmd", '["python3"]'),
               ("--label", "org.opencontainers.image.title=tardigrade-local-base"))
BASE_NAME = "localhost/tardigrade-base/python"
BUILD_NAME = "localhost/tardigrade-build"
KEEP_BUILDS = 3


class ImageBuildError(RuntimeError):
    pass


def cache_base() -> Path:
    """The cache root the Go builds use (gobuild.cache_root's parent)."""
    base = os.environ.get("TARDIGRADE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tardigrade")
    return Path(base)


def _storage_driver() -> str:
    return os.environ.get(STORAGE_DRIVER_ENV) or "overlay"


def buildah_argv(*args: str) -> list[str]:
    """buildah on our own storage, so no other user of the machine's store is touched."""
    containers = cache_base() / "containers"
    driver = _storage_driver()
    # One store per driver: containers/storage refuses a store made by another driver.
    suffix = "" if driver == "overlay" else f"-{driver}"
    return ["buildah", "--root", str(containers / f"storage{suffix}"), "--runroot",
            str(containers / f"run{suffix}"), "--storage-driver", driver, *args]


def _run(argv: Sequence[str], what: str, timeout: float = 600,
         **kwargs: object) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              **kwargs)  # type: ignore[call-overload]
    except FileNotFoundError as err:
        raise ImageBuildError(f"{what}: {argv[0]} is not installed (scripts/setup installs "
                              "buildah, mmdebstrap, skopeo and umoci from apt)") from err
    if done.returncode != 0:
        raise ImageBuildError(f"{what} failed (exit {done.returncode}): {' '.join(argv)}\n"
                              f"{(done.stderr or done.stdout)[-4000:]}")
    return done


def buildah(*args: str, what: str, timeout: float = 600) -> str:
    return _run(buildah_argv(*args), what, timeout).stdout


def image_id(reference: str) -> str | None:
    """The image's id (its config's digest) in our store, or None if it is not there."""
    done = subprocess.run(buildah_argv("inspect", "--type", "image", "--format",
                                       "{{.FromImageID}}", reference),
                          capture_output=True, text=True, timeout=120)
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else None


def image_config(reference: str) -> dict[str, object]:
    """The OCI image config (`config` of https://github.com/opencontainers/image-spec
    config.md): User, WorkingDir, Entrypoint, Cmd, Env, Labels."""
    out = buildah("inspect", "--type", "image", reference, what=f"inspecting {reference}")
    return dict(json.loads(out)["OCIv1"]["config"])


def _digest(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()[:16]


def _buildah_version() -> str:
    return _run(["buildah", "--version"], "buildah --version").stdout.strip()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One builder per cache entry across processes (two test runs may build at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# --- the base image -------------------------------------------------------------------------
def base_key() -> str:
    recipe = {"suite": BASE_SUITE, "mirrors": BASE_MIRRORS, "packages": BASE_PACKAGES,
              "hooks": BASE_HOOKS, "config": BASE_CONFIG, "variant": "minbase"}
    return _digest(json.dumps(recipe, sort_keys=True).encode())


def base_reference() -> str:
    return f"{BASE_NAME}:3.11-{BASE_SUITE}-{base_key()}"


def ensure_base(out: TextIO = sys.stderr) -> str:
    """Build the local base unless it is in the store; returns its reference. Debian's
    updates reach it only when its recipe changes (or the store is removed)."""
    reference = base_reference()
    if image_id(reference):
        return reference
    with _locked(cache_base() / "containers" / "base.lock"):
        if image_id(reference):
            return reference
        started = time.monotonic()
        print(f"imagebuild: making the base {reference} from Debian {BASE_SUITE} packages "
              "(about 2 minutes)", file=out, flush=True)
        with tempfile.TemporaryDirectory(prefix="tardigrade-base-") as tmp:
            rootfs = Path(tmp) / "rootfs.tar"
            _run(["mmdebstrap", "--variant=minbase", "--mode=root", "--format=tar",
                  f"--include={','.join(BASE_PACKAGES)}",
                  *[f"--customize-hook={hook}" for hook in BASE_HOOKS],
                  BASE_SUITE, str(rootfs), *BASE_MIRRORS], "mmdebstrap", timeout=1800)
            container = buildah("from", "scratch", what="buildah from scratch").strip()
            try:
                buildah("add", container, str(rootfs), "/", what="adding the root filesystem")
                config = [arg for pair in BASE_CONFIG for arg in pair]
                buildah("config", *config, container, what="configuring the base")
                buildah("commit", "--quiet", container, reference, what="committing the base")
            finally:
                subprocess.run(buildah_argv("rm", container), capture_output=True, timeout=120)
        print(f"imagebuild: base built in {time.monotonic() - started:.0f} s", file=out,
              flush=True)
    return reference


# --- the shipped images ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Image:
    """One shipped image as this machine builds it."""

    name: str
    recipe: ImageRecipe

    @property
    def dockerfile(self) -> Path:
        return self.recipe.dockerfile

    def all_copies(self) -> ImageRecipe:
        """The recipe with every stage's COPY from the context (not only the wheel stage's)."""
        stages = parse_stages(self.dockerfile.read_text(), str(self.dockerfile))
        copies = tuple(copy for stage in stages for copy in stage.context_copies)
        return dataclasses.replace(self.recipe, sources=copies)

    def key(self, base_id: str) -> str:
        files = [f"{target}\0".encode() + path.read_bytes()
                 for path, target in context_files(self.all_copies())]
        return _digest(self.dockerfile.read_bytes(), *files, base_id.encode(),
                       json.dumps(self.build_args(base_id)).encode(),
                       _buildah_version().encode(), _storage_driver().encode())

    def build_args(self, base: str) -> dict[str, str]:
        return {BASE_ARG: base}

    def local_reference(self, key: str) -> str:
        return f"{BUILD_NAME}/{self.name}:{key}"

    def tag(self, version: str) -> str:
        """As docs/images.md tags them: tardigrade-operator:0.1.0, tardigrade-trainer:0.1.0-cpu."""
        suffix = self.dockerfile.suffix.lstrip(".")
        return f"{version}-{suffix}" if suffix else version


def image(name: str, root: Path = REPO_ROOT) -> Image:
    if name not in DOCKERFILES:
        raise ImageBuildError(f"no image {name!r}; known: {sorted(DOCKERFILES)}")
    return Image(name, read_recipe(root / DOCKERFILES[name], root))


@dataclasses.dataclass(frozen=True)
class Built:
    image: Image
    reference: str  # in our buildah store
    image_id: str
    cached: bool
    seconds: float


def ensure_public_base(reference: str = PUBLIC_BASE, out: TextIO = sys.stderr) -> str:
    """Pull the Dockerfiles' own base (`python:3.11-slim` from Docker Hub) into our store, so
    that a build for shipping uses what `docker build` would; returns the reference. Pulled
    each time: the tag moves with Python's patch releases, and the image key follows it."""
    print(f"imagebuild: pulling the base {reference}", file=out, flush=True)
    buildah("pull", "--quiet", f"docker://{reference}", what=f"pulling the base {reference} "
            "(a machine without Docker Hub builds on the local base instead)", timeout=1800)
    return reference


def build(name: str, out: TextIO = sys.stderr, root: Path = REPO_ROOT,
          base: str | None = None) -> Built:
    """Build `name` from its Dockerfile unless an image with the same inputs is stored.
    `base`: the base image, already in our store (`ensure_public_base`); default the local
    base made from Debian's packages (`ensure_base`)."""
    started = time.monotonic()
    img = image(name, root)
    base = base or ensure_base(out)
    base_id = image_id(base)
    if base_id is None:
        raise ImageBuildError(f"the base image {base} is not in the store")
    key = img.key(base_id)
    reference = img.local_reference(key)
    found = image_id(reference)
    if found:
        return Built(img, reference, found, True, time.monotonic() - started)
    with _locked(cache_base() / "containers" / f"{name}-{key}.lock"):
        found = image_id(reference)
        if found:
            return Built(img, reference, found, True, time.monotonic() - started)
        print(f"imagebuild: building {name} from {img.dockerfile.relative_to(root)} "
              f"(key {key})", file=out, flush=True)
        found = _bud(name, img.dockerfile, root, reference, img.build_args(base))
    seconds = time.monotonic() - started
    print(f"imagebuild: {name} built in {seconds:.0f} s", file=out, flush=True)
    prune(name)
    return Built(img, reference, found, False, seconds)


def _bud(name: str, dockerfile: Path, root: Path, reference: str,
         build_args: dict[str, str]) -> str:
    """`buildah bud` of `dockerfile` with `root` as the context, tagged `reference`; returns
    the image id."""
    args = [arg for k, v in build_args.items() for arg in ("--build-arg", f"{k}={v}")]
    volumes = (["--volume", f"{HOST_CA_BUNDLE}:{HOST_CA_BUNDLE}:ro"]
               if HOST_CA_BUNDLE.is_file() else [])
    buildah("bud", "--isolation", "chroot", "--network", "host", "--pull-never",
            "--layers=false", "--quiet", *volumes, *args, "-f", str(dockerfile),
            "-t", reference, str(root), what=f"building {name}",
            timeout=BUILD_TIMEOUT_SECONDS)
    found = image_id(reference)
    if found is None:
        raise ImageBuildError(f"buildah built {name} but {reference} is not in the store")
    return found


# --- images made from ours (test images) ----------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DerivedBuilt:
    """An image whose Dockerfile starts FROM one of our built images (`build_derived`)."""

    name: str
    reference: str  # in our buildah store
    image_id: str
    key: str
    cached: bool
    seconds: float


def build_derived(name: str, dockerfile: Path, base: Built, out: TextIO = sys.stderr,
                  root: Path = REPO_ROOT) -> DerivedBuilt:
    """Build `dockerfile` (context `root`) on top of `base`, handed to it through its
    `BASE_IMAGE` build argument as for the shipped images (the base is in our store, so
    nothing is pulled), unless an image with the same inputs is stored: the Dockerfile, the
    files it copies (after .dockerignore), the base image's id, buildah's version. Such an
    image adds files to a shipped one (a test's stand-in program); it is not a shipped image,
    so none of `read_recipe`'s rules for those apply."""
    started = time.monotonic()
    stages = parse_stages(dockerfile.read_text(), str(dockerfile))
    copies = [copy for stage in stages for copy in stage.context_copies]
    files = [f"{target}\0".encode() + path.read_bytes()
             for path, target in copied_files(root, copies, dockerfile.name)]
    args = {BASE_ARG: base.reference}
    key = _digest(dockerfile.read_bytes(), *files, base.image_id.encode(),
                  json.dumps(args).encode(), _buildah_version().encode(),
                  _storage_driver().encode())
    reference = f"{BUILD_NAME}/{name}:{key}"
    with _locked(cache_base() / "containers" / f"{name}-{key}.lock"):
        found = image_id(reference)
        if found:
            return DerivedBuilt(name, reference, found, key, True, time.monotonic() - started)
        print(f"imagebuild: building {name} from {dockerfile} on {base.reference}", file=out,
              flush=True)
        found = _bud(name, dockerfile, root, reference, args)
    prune(name)
    return DerivedBuilt(name, reference, found, key, False, time.monotonic() - started)


def push_derived(built: DerivedBuilt, registry: str) -> str:
    """Copy a `build_derived` image to `registry` (host:port, plain HTTP) as
    `<registry>/tardigrade-dev/<name>:<key>`; returns that reference."""
    target = f"{registry}/{REPOSITORY}/{built.name}:{built.key}"
    buildah("push", "--tls-verify=false", "--quiet", built.reference, f"docker://{target}",
            what=f"pushing {built.name} to {target}", timeout=1800)
    return target


def forget(reference: str) -> None:
    """Drop a name from the store: the image goes with its last name."""
    buildah("rmi", reference, what=f"removing {reference}")


def _created(image: dict[str, object]) -> tuple[int, int]:
    """(seconds, nanoseconds) of an image's creation, from `buildah images --json`: the
    seconds alone tie for images made in the same second."""
    raw = str(image.get("createdatraw") or "")
    fraction = raw.rpartition(".")[2].rstrip("Z") if "." in raw else ""
    nanos = int(fraction.ljust(9, "0")[:9]) if fraction.isdigit() else 0
    return int(str(image["created"])), nanos


def prune(name: str, keep: int = KEEP_BUILDS) -> list[str]:
    """Remove all but the `keep` newest builds of `name` (each source change builds a new
    image of up to 2 GB; other checkouts on the machine may still use the recent ones)."""
    prefix = f"{BUILD_NAME}/{name}:"
    images = json.loads(buildah("images", "--json", what="listing images") or "[]") or []
    builds = sorted(((_created(image), ref) for image in images
                     for ref in image["names"] if ref.startswith(prefix)), reverse=True)
    stale = [ref for _, ref in builds[keep:]]
    for ref in stale:
        forget(ref)
    return stale


def push(built: Built, registry: str, version: str) -> str:
    """Copy the image to `registry` (host:port, plain HTTP) as
    `<registry>/tardigrade-dev/<title>:<tag>`; returns that reference."""
    return push_to(built, f"{registry}/{REPOSITORY}", version, tls_verify=False)[0]


def shipped_name(built_image: Image, prefix: str, version: str) -> str:
    """`<prefix>/<title>:<tag>`: tardigrade-operator:0.1.0, tardigrade-trainer:0.1.0-cpu."""
    return f"{prefix}/{built_image.recipe.title}:{built_image.tag(version)}"


def push_to(built: Built, prefix: str, version: str,
            tls_verify: bool = True) -> tuple[str, str]:
    """Copy the image to `<prefix>/<title>:<tag>` (prefix: a registry host with an optional
    path, e.g. an Artifact Registry repository); returns that reference and the digest of the
    manifest pushed (what `image@sha256:...` pins). Credentials are buildah's (`buildah
    login`, or a Docker config's)."""
    target = shipped_name(built.image, prefix, version)
    with tempfile.TemporaryDirectory(prefix="tardigrade-push-") as tmp:
        digest_file = Path(tmp) / "digest"
        buildah("push", f"--tls-verify={'true' if tls_verify else 'false'}", "--quiet",
                "--digestfile", str(digest_file), built.reference, f"docker://{target}",
                what=f"pushing {built.image.name} to {target}", timeout=1800)
        return target, digest_file.read_text().strip()


def pull(reference: str) -> str:
    """Pull `reference` (plain HTTP registry) into our store; returns the image id."""
    return buildah("pull", "--tls-verify=false", "--quiet", f"docker://{reference}",
                   what=f"pulling {reference}", timeout=1800).strip()


def run_in_image(reference: str, argv: Sequence[str],
                 timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run `argv` in a container of the stored image, as its config says (User, WorkingDir,
    Env), with chroot isolation (no daemon, no runtime); the container is removed after."""
    container = buildah("from", "--pull-never", "--quiet", reference,
                        what=f"a container of {reference}").strip()
    try:
        return subprocess.run(buildah_argv("run", "--isolation", "chroot", container, "--",
                                           *argv),
                              capture_output=True, text=True, timeout=timeout)
    finally:
        subprocess.run(buildah_argv("rm", container), capture_output=True, timeout=120)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("images", nargs="*", help=f"default: {' '.join(DEFAULT_IMAGES)}; "
                                                  f"known: {' '.join(DOCKERFILES)}")
    args = parser.parse_args(argv)
    try:
        for name in args.images or DEFAULT_IMAGES:
            built = build(name)
            print(f"{name}: {built.reference} {built.image_id[:19]} "
                  f"{'cached' if built.cached else 'built'} in {built.seconds:.1f} s")
    except ImageBuildError as err:
        print(f"imagebuild: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
