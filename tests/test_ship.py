"""`tardigrade local ship` (tardigrade_local/ship.py): its argument checks, and one real run
against a local registry (distribution v3) with the CPU trainer only (the GPU image is 6 GB),
after which the registry serves the images and a chart whose values name them."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from tardigrade_local import imagebuild, ship
from tardigrade_local.registry import Registry

from tests.conftest import REPO_ROOT

META = ship.chart_metadata()


# --- the arguments --------------------------------------------------------------------------
@pytest.mark.parametrize("registry", ["ghcr.io/my-org", "localhost:5000", "127.0.0.1:5000/a/b",
                                      "us-central1-docker.pkg.dev/my-project/tardigrade",
                                      "registry.example.com/team_a/x-y/"])
def test_registries_with_a_host_are_accepted(registry):
    assert ship.parse_registry(registry) == registry.rstrip("/")


@pytest.mark.parametrize(("registry", "says"), [
    ("tardigrade", "does not start with a registry host"),
    ("my-org/tardigrade", "does not start with a registry host"),
    ("", "does not start with a registry host"),
    ("/ghcr.io/x", "does not start with a registry host"),
    ("https://ghcr.io/my-org", "has a scheme"),
    ("ghcr.io/My-Org", "'My-Org'"),
    ("ghcr.io/a//b", "path component ''"),
    ("bad_host.io/x", "does not start with a registry host"),
])
def test_a_registry_without_a_host_or_with_a_bad_path_names_the_flag(registry, says):
    with pytest.raises(ship.ShipInputError, match=r"^--registry: ") as err:
        ship.parse_registry(registry)
    assert says in str(err.value)


@pytest.mark.parametrize("tag", ["0.1.0", "v1", "0.2.0-rc.1", "_x", "A" * 124])
def test_valid_tags_are_accepted(tag):
    assert ship.parse_tag(tag) == tag


@pytest.mark.parametrize("tag", ["", "-x", ".x", "1.0+build", "a/b", "a b", "A" * 125])
def test_a_tag_with_invalid_characters_names_the_flag(tag):
    with pytest.raises(ship.ShipInputError, match=r"^--tag: .*not an image tag"):
        ship.parse_tag(tag)


@pytest.mark.parametrize(("value", "expected"), [
    ("cpu", ("cpu",)), ("cpu, tpu,cpu", ("cpu", "tpu")), ("gpu,cpu,tpu", ("gpu", "cpu", "tpu"))])
def test_accelerators(value, expected):
    assert ship.parse_accelerators(value) == expected


@pytest.mark.parametrize("value", ["", ",", "cuda", "cpu,tpu,h100"])
def test_unknown_accelerators_name_the_flag(value):
    with pytest.raises(ship.ShipInputError, match=r"^--accelerators: "):
        ship.parse_accelerators(value)


@pytest.mark.parametrize("value", ["1", "v0.2.0", "0.2", "01.2.3"])
def test_a_chart_version_that_is_not_semver_names_the_flag(value):
    with pytest.raises(ship.ShipInputError, match=r"^--chart-version: .*SemVer"):
        ship.parse_chart_version(value)


def test_the_plan_names_what_the_examples_name():
    plan = ship.ShipPlan.parse("us-central1-docker.pkg.dev/p/tardigrade", accelerators="cpu,gpu")
    assert (plan.tag, plan.chart_version) == (META["appVersion"], META["version"])
    assert plan.images == ("operator", "trainer-cpu", "trainer-gpu")
    prefix = "us-central1-docker.pkg.dev/p/tardigrade"
    assert plan.reference("operator") == f"{prefix}/tardigrade-operator:{plan.tag}"
    assert plan.reference("trainer-gpu") == f"{prefix}/tardigrade-trainer:{plan.tag}-gpu"
    assert plan.helm_install() == (
        f"helm install tardigrade oci://{prefix}/charts/tardigrade --version "
        f"{META['version']} --namespace tardigrade-system --create-namespace")
    assert plan.base == imagebuild.PUBLIC_BASE
    # Every example's image is one of the trainers ship pushes (to the registry the docs use).
    for path in sorted((REPO_ROOT / "examples").glob("*.yaml")):
        image = yaml.safe_load(path.read_text())["spec"]["image"]
        accelerator = image.rpartition("-")[2]
        assert image == ship.ShipPlan.parse(
            image.rsplit("/", 1)[0], accelerators=accelerator).reference(
                f"trainer-{accelerator}"), path.name


def test_the_packaged_values_keep_their_comments_and_change_only_the_repository():
    text = (ship.CHART_DIR / "values.yaml").read_text()
    changed = ship.set_operator_repository(text, "r.example/x/tardigrade-operator")
    before, after = yaml.safe_load(text), yaml.safe_load(changed)
    assert after["image"] == {**before["image"], "repository": "r.example/x/tardigrade-operator"}
    assert {k: v for k, v in after.items() if k != "image"} == {
        k: v for k, v in before.items() if k != "image"}
    assert changed.count("\n#") == text.count("\n#")


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tardigrade_operator.cli", "local", "ship",
                           *args], capture_output=True, text=True, timeout=600,
                          env=env, cwd=REPO_ROOT)


@pytest.mark.parametrize(("args", "says"), [
    (["--registry", "tardigrade"], "error: --registry: 'tardigrade' does not start with"),
    (["--registry", "localhost:5000", "--tag", "v1/x"], "error: --tag: 'v1/x' is not"),
    (["--registry", "localhost:5000", "--accelerators", "cuda"], "error: --accelerators:"),
])
def test_the_command_refuses_bad_input_before_building_anything(args, says):
    result = _cli(*args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(says), result.stderr
    assert "imagebuild" not in result.stderr


def test_the_command_says_what_each_flag_does():
    result = _cli("--help")
    assert result.returncode == 0, result.stderr
    for flag in ("--registry", "--tag", "--accelerators", "--chart-version", "--plain-http",
                 "--local-base"):
        assert flag in result.stdout
    # Help text is rich markup: a [bracketed] default would vanish (or fail to render).
    assert "appVersion" in result.stdout and "Chart.yaml" in result.stdout


def test_a_base_that_cannot_be_pulled_names_the_local_base_flag(tmp_path):
    plan = ship.ShipPlan.parse("localhost:1", accelerators="cpu")
    unreachable = "127.0.0.1:1/library/python:3.11-slim"  # nothing listens on port 1
    with pytest.raises(ship.ShipError, match="pulling the base") as err:
        ship.ship(dataclasses.replace(plan, base=unreachable), out=io.StringIO())
    assert str(err.value).endswith("builds on a base of its own: --local-base")


# --- a real run against a local registry ----------------------------------------------------
TOOLS = ("buildah", "mmdebstrap", "go", "helm")


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> Iterator[Registry]:
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} not installed: scripts/setup installs the image "
                    "builder and Go; .ci/install-kube-clients.sh installs helm")
    root = tmp_path_factory.mktemp("registry")
    with Registry(root / "storage", log_path=root / "registry.log") as running:
        yield running


TAG = "0.0.0-shiptest"
CHART_VERSION = "0.0.0-shiptest"


@pytest.fixture(scope="module")
def shipped(registry) -> subprocess.CompletedProcess[str]:
    # This machine has no Docker Hub: the local base, as the image tests build on.
    result = _cli("--registry", f"{registry.host}/team", "--tag", TAG, "--accelerators", "cpu",
                  "--chart-version", CHART_VERSION, "--plain-http", "--local-base",
                  env={**os.environ, "HELM_CONFIG_HOME": str(registry.storage.parent / "helm")})
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@pytest.mark.slow
def test_ship_prints_the_install_line_and_the_trainer_images(registry, shipped):
    prefix = f"{registry.host}/team"
    assert (f"helm install tardigrade oci://{prefix}/charts/tardigrade --version "
            f"{CHART_VERSION} --namespace tardigrade-system --create-namespace --plain-http"
            in shipped.stdout)
    assert f"cpu: {prefix}/tardigrade-trainer:{TAG}-cpu" in shipped.stdout
    assert "tpu:" not in shipped.stdout and "gpu:" not in shipped.stdout


@pytest.mark.slow
@pytest.mark.parametrize(("name", "repository", "tag"), [
    ("operator", "team/tardigrade-operator", TAG),
    ("trainer-cpu", "team/tardigrade-trainer", f"{TAG}-cpu"),
])
def test_the_registry_serves_the_built_images(registry, shipped, name, repository, tag):
    manifest, digest = registry.manifest(repository, tag)
    # The manifest ship pushed and printed (the image store is shared with other checkouts,
    # whose builds may prune this one's: the digest, not a rebuild, identifies it).
    assert f"{registry.host}/{repository}:{tag} ({digest})" in shipped.stdout
    config = json.loads(registry.blob(repository, manifest["config"]["digest"]))["config"]
    recipe = imagebuild.image(name).recipe
    assert config["Labels"]["org.opencontainers.image.title"] == recipe.title
    assert config["Labels"]["dev.tardigrade.image.modules"] == " ".join(recipe.modules)
    assert config["Entrypoint"] == list(recipe.entrypoint)
    assert registry.tags(repository) == [tag]  # only the accelerators asked for


@pytest.mark.slow
def test_the_pushed_chart_names_the_pushed_operator_image(registry, shipped, tmp_path):
    env = {**os.environ, "HELM_CONFIG_HOME": str(tmp_path / "helm")}
    reference = f"oci://{registry.host}/team/charts/tardigrade"
    pulled = subprocess.run(["helm", "pull", reference, "--version", CHART_VERSION,
                             "--plain-http", "--destination", str(tmp_path)],
                            capture_output=True, text=True, timeout=120, env=env)
    assert pulled.returncode == 0, pulled.stderr
    with tarfile.open(tmp_path / f"tardigrade-{CHART_VERSION}.tgz") as archive:
        archive.extractall(tmp_path / "chart", filter="data")
    chart = yaml.safe_load((tmp_path / "chart" / "tardigrade" / "Chart.yaml").read_text())
    assert (chart["version"], chart["appVersion"]) == (CHART_VERSION, TAG)
    # What helm installs: the Deployment's image, rendered from the pulled chart.
    rendered = subprocess.run(["helm", "template", "tardigrade", str(tmp_path / "chart" /
                                                                     "tardigrade")],
                              capture_output=True, text=True, timeout=120, env=env)
    assert rendered.returncode == 0, rendered.stderr
    deployment = next(d for d in yaml.safe_load_all(rendered.stdout)
                      if d and d["kind"] == "Deployment")
    image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == f"{registry.host}/team/tardigrade-operator:{TAG}"
    # ...and it is one the registry serves.
    registry.manifest("team/tardigrade-operator", TAG)
    installed = subprocess.run(["helm", "install", "tg", str(tmp_path / "chart" / "tardigrade"),
                                "--dry-run=client"], capture_output=True, text=True,
                               timeout=120, env=env)
    assert installed.returncode == 0, installed.stderr
    assert "placeholder" not in installed.stdout.split("NOTES:", 1)[1]
    # The rest of the chart is the checkout's.
    assert Path(tmp_path / "chart" / "tardigrade" / "templates" / "deployment.yaml"
                ).read_text() == (ship.CHART_DIR / "templates" / "deployment.yaml").read_text()
