"""Ship a release to a registry the user names: the operator and trainer images, built from
our Dockerfiles with the builder the tests use (`imagebuild`), and the Helm chart as an OCI
artifact whose values name the operator image just pushed.

`tardigrade local ship --registry us-central1-docker.pkg.dev/PROJECT/tardigrade` pushes
    <registry>/tardigrade-operator:<tag>
    <registry>/tardigrade-trainer:<tag>-cpu, -tpu, -gpu
    oci://<registry>/charts/tardigrade, version <chart version>, appVersion <tag>
and prints the `helm install` line and the trainer images to put in a TrainingJob's
`spec.image`. A `tardigrade local` command because it needs what only a checkout with the
[local] extra has: the Dockerfiles, the chart's sources and buildah (the operator image's
`tardigrade` must not import the local cluster). docs/images.md, "Shipping".
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TextIO

import yaml

from tardigrade_local import imagebuild

CHART_DIR = imagebuild.REPO_ROOT / "charts" / "tardigrade"
ACCELERATORS = ("cpu", "tpu", "gpu")
CHARTS_PATH = "charts"
HELM_TIMEOUT_SECONDS = 600

# distribution's reference grammar (distribution/reference/regexp.go): a domain is
# dot-separated components with an optional port; path components are lower case.
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = re.compile(rf"{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*(?::[0-9]+)?")
_PATH_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
# SemVer 2 (semver.org), which Helm requires of a chart's version.
_SEMVER = re.compile(r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
                     r"(?:-[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*)?(?:\+[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*)?")


class ShipInputError(ValueError):
    """Bad input, naming the flag."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag}: {message}")
        self.flag = flag


class ShipError(RuntimeError):
    pass


def chart_metadata(chart: Path = CHART_DIR) -> dict[str, str]:
    data = yaml.safe_load((chart / "Chart.yaml").read_text())
    return {"name": str(data["name"]), "version": str(data["version"]),
            "appVersion": str(data["appVersion"])}


def parse_registry(value: str) -> str:
    """`host[:port][/path...]`, without a scheme or a trailing slash."""
    registry = value.strip().rstrip("/")
    if "://" in registry:
        raise ShipInputError("--registry", f"{value!r} has a scheme; give host[:port][/path], "
                             "e.g. us-central1-docker.pkg.dev/my-project/tardigrade "
                             "(--plain-http for a registry without TLS)")
    host, _, path = registry.partition("/")
    # As Docker reads a reference: a first component without a dot or a port, other than
    # localhost, is a path on Docker Hub, not a host.
    if not host or not (("." in host or ":" in host or host == "localhost")
                        and _DOMAIN.fullmatch(host)):
        raise ShipInputError("--registry", f"{value!r} does not start with a registry host; "
                             "give host[:port][/path], e.g. ghcr.io/my-org, "
                             "us-central1-docker.pkg.dev/my-project/tardigrade or "
                             "localhost:5000")
    for component in path.split("/") if path else ():
        if not _PATH_COMPONENT.fullmatch(component):
            raise ShipInputError("--registry", f"path component {component!r} of {value!r} is "
                                 "not a repository name (lower-case letters, digits, and "
                                 "'.', '_', '-' between them)")
    return registry


def parse_tag(value: str) -> str:
    # The trainer images add "-<accelerator>" (at most 4 characters) to the tag.
    if not _TAG.fullmatch(value) or len(value) > 128 - len("-cpu"):
        raise ShipInputError("--tag", f"{value!r} is not an image tag: letters, digits, '_', "
                             "'.' and '-', not starting with '.' or '-', at most 124 "
                             "characters (the trainer images append -cpu/-tpu/-gpu)")
    return value


def parse_chart_version(value: str) -> str:
    if not _SEMVER.fullmatch(value):
        raise ShipInputError("--chart-version", f"{value!r} is not a SemVer 2 version "
                             "(Helm requires one), e.g. 0.2.0 or 0.2.1-rc.1")
    return value


def parse_accelerators(value: str) -> tuple[str, ...]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in ACCELERATORS]
    if unknown or not names:
        raise ShipInputError("--accelerators", f"{value!r}: give a comma-separated list of "
                             f"{', '.join(ACCELERATORS)}" +
                             (f" (unknown: {', '.join(unknown)})" if unknown else ""))
    return tuple(dict.fromkeys(names))


@dataclasses.dataclass(frozen=True)
class ShipPlan:
    """What `ship` pushes, and where."""

    registry: str
    tag: str
    accelerators: tuple[str, ...]
    chart_version: str
    plain_http: bool = False
    base: str | None = imagebuild.PUBLIC_BASE  # None: the local base (no Docker Hub)

    @classmethod
    def parse(cls, registry: str, tag: str | None = None, accelerators: str = "cpu,tpu,gpu",
              chart_version: str | None = None, plain_http: bool = False,
              local_base: bool = False) -> ShipPlan:
        meta = chart_metadata()
        return cls(parse_registry(registry), parse_tag(tag or meta["appVersion"]),
                   parse_accelerators(accelerators),
                   parse_chart_version(chart_version or meta["version"]), plain_http,
                   None if local_base else imagebuild.PUBLIC_BASE)

    @property
    def images(self) -> tuple[str, ...]:
        """imagebuild's names: the operator, then a trainer per accelerator."""
        return ("operator", *(f"trainer-{accelerator}" for accelerator in self.accelerators))

    def reference(self, name: str) -> str:
        return imagebuild.shipped_name(imagebuild.image(name), self.registry, self.tag)

    @property
    def operator_repository(self) -> str:
        return self.reference("operator").rpartition(":")[0]

    @property
    def chart_repository(self) -> str:
        return f"oci://{self.registry}/{CHARTS_PATH}"

    @property
    def chart_reference(self) -> str:
        return f"{self.chart_repository}/{chart_metadata()['name']}"

    def helm_install(self) -> str:
        return (f"helm install tardigrade {self.chart_reference} --version {self.chart_version}"
                " --namespace tardigrade-system --create-namespace"
                + (" --plain-http" if self.plain_http else ""))


@dataclasses.dataclass(frozen=True)
class Shipped:
    plan: ShipPlan
    images: dict[str, tuple[str, str]]  # imagebuild name -> (pushed reference, digest)
    chart: str  # what `helm push` reported (oci://...:version)


def helm_binary() -> str:
    found = shutil.which("helm")
    if found is None:
        raise ShipError("helm is not installed (https://helm.sh/docs/intro/install/; the "
                        "tests' copy: .ci/install-kube-clients.sh .ci/cache, then put .ci/cache "
                        "on PATH)")
    return found


def _helm(*args: str) -> str:
    argv = [helm_binary(), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=HELM_TIMEOUT_SECONDS)
    if done.returncode != 0:
        raise ShipError(f"{' '.join(argv)} failed (exit {done.returncode}): "
                        f"{(done.stderr or done.stdout).strip()[-2000:]}")
    return done.stdout + done.stderr


def set_operator_repository(values_text: str, repository: str) -> str:
    """values.yaml with `image.repository` replaced, its comments kept (they are the chart's
    documentation for `helm show values`)."""
    lines = values_text.splitlines(keepends=True)
    in_image = False
    for index, line in enumerate(lines):
        if re.match(r"^image:\s*$", line):
            in_image = True
        elif in_image and re.match(r"^\S", line):
            break
        elif in_image and re.match(r"^  repository:", line):
            lines[index] = f"  repository: {repository}\n"
            text = "".join(lines)
            assert yaml.safe_load(text)["image"]["repository"] == repository
            return text
    raise ShipError("charts/tardigrade/values.yaml has no image.repository line to set")


def package_chart(plan: ShipPlan, into: Path, chart: Path = CHART_DIR) -> Path:
    """The chart packaged with its operator image set to the pushed one: values name the
    repository, appVersion (the default image tag) is the tag."""
    staged = into / chart.name
    shutil.copytree(chart, staged)
    values = staged / "values.yaml"
    values.write_text(set_operator_repository(values.read_text(), plan.operator_repository))
    _helm("package", str(staged), "--version", plan.chart_version, "--app-version", plan.tag,
          "--destination", str(into))
    packaged = into / f"{chart_metadata(chart)['name']}-{plan.chart_version}.tgz"
    if not packaged.is_file():
        raise ShipError(f"helm package left no {packaged.name}")
    return packaged


def ship(plan: ShipPlan, out: TextIO = sys.stderr) -> Shipped:
    helm_binary()  # before the builds, which take minutes
    try:
        base = imagebuild.ensure_public_base(plan.base, out) if plan.base else None
    except imagebuild.ImageBuildError as err:
        raise ShipError(f"{err}\nA machine that cannot reach {str(plan.base).split('/')[0]} "
                        "builds on a base of its own: --local-base") from err
    pushed: dict[str, tuple[str, str]] = {}
    for name in plan.images:
        built = imagebuild.build(name, out, base=base)
        print(f"ship: pushing {name} ({'cached' if built.cached else 'built'})", file=out,
              flush=True)
        pushed[name] = imagebuild.push_to(built, plan.registry, plan.tag,
                                          tls_verify=not plan.plain_http)
        assert pushed[name][0] == plan.reference(name)
    with tempfile.TemporaryDirectory(prefix="tardigrade-chart-") as tmp:
        packaged = package_chart(plan, Path(tmp))
        said = _helm("push", str(packaged), plan.chart_repository,
                     *(["--plain-http"] if plan.plain_http else []))
    chart = next((line.split(":", 1)[1].strip() for line in said.splitlines()
                  if line.startswith("Pushed:")), f"{plan.chart_reference}:{plan.chart_version}")
    return Shipped(plan, pushed, chart)


def summary(shipped: Shipped) -> str:
    plan = shipped.plan
    lines = ["Pushed:", *(f"  {reference} ({digest})"
                          for reference, digest in shipped.images.values()),
             f"  {shipped.chart}", "", "Install the operator:", f"  {plan.helm_install()}", "",
             "Trainer images for a TrainingJob's spec.image:"]
    lines += [f"  {accelerator}: {plan.reference(f'trainer-{accelerator}')}"
              for accelerator in plan.accelerators]
    return "\n".join(lines) + "\n"

