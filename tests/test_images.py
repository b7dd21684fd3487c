"""The images as shipped: each Dockerfile's install line, rebuilt as a virtualenv, runs its
entry point and imports the modules the image is meant to run (docs/images.md).

A venv is not the image: the base image, USER, WORKDIR and OS packages are only checked by
`test_docker_build`, which needs a Docker engine."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib

import pytest
from tardigrade_local import imagevenv
from tardigrade_local.dockerfile import (
    DockerfileError,
    ImageRecipe,
    context_files,
    parse_stages,
    read_recipe,
)
from tardigrade_local.kubelet.images import ImageMap

from tests.conftest import REPO_ROOT

DOCKERFILES = [REPO_ROOT / "operator" / "Dockerfile",
               *sorted((REPO_ROOT / "trainer_image").glob("Dockerfile.*"))]
PROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]
IDS = [p.relative_to(REPO_ROOT).as_posix() for p in DOCKERFILES]
SHIPPED = imagevenv.recipes()


def _recipe(dockerfile) -> ImageRecipe:
    return read_recipe(dockerfile, REPO_ROOT)


# --- what the Dockerfiles say (no build) ----------------------------------------------------
@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=IDS)
def test_image_runs_as_non_root(dockerfile):
    user = _recipe(dockerfile).user
    assert user is not None and user.split(":")[0] not in ("root", "0")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=IDS)
def test_installed_extras_exist_and_the_local_cluster_is_not_shipped(dockerfile):
    recipe = _recipe(dockerfile)
    for extra in recipe.extras:
        assert extra in EXTRAS, f"{dockerfile.name} installs unknown extra [{extra}]"
    assert "local" not in recipe.extras
    copied = {src.rstrip("/") for sources, _ in recipe.sources for src in sources}
    assert "local_cluster" not in copied and "." not in copied, copied
    for module in recipe.modules:
        assert not module.startswith("tardigrade_local"), module


@pytest.mark.parametrize("accelerator", ["gpu", "tpu"])
def test_accelerator_trainer_images_install_what_the_cpu_image_does(accelerator):
    cpu = _recipe(REPO_ROOT / "trainer_image" / "Dockerfile.cpu")
    other = _recipe(REPO_ROOT / "trainer_image" / f"Dockerfile.{accelerator}")
    assert (other.extras, other.sources, other.modules, other.entrypoint, other.cmd) == (
        cpu.extras, cpu.sources, cpu.modules, cpu.entrypoint, cpu.cmd)
    # The only addition: the accelerator build of jax, pinned to the version [trainer] got.
    installs = " ".join(other.runs)
    pin = re.search(r'"jax\[(\w+)\]==\$\(python -c .import jax; print\(jax.__version__\).\)"',
                    installs)
    assert pin is not None and pin.group(1) == {"gpu": "cuda12", "tpu": "tpu"}[accelerator]


def test_the_gpu_image_loads_the_driver_gke_mounts():
    # GKE's device plugin mounts the node's driver at /usr/local/nvidia and sets no environment
    # (container-engine-accelerators cmd/nvidia_gpu/nvidia_gpu.go): the image must put its
    # libraries on the loader path, or JAX finds no libcuda.so.1 and falls back to the CPU.
    env = dict(_recipe(REPO_ROOT / "trainer_image" / "Dockerfile.gpu").env)
    assert "/usr/local/nvidia/lib64" in env["LD_LIBRARY_PATH"].split(":")
    for other in ("cpu", "tpu"):
        assert "LD_LIBRARY_PATH" not in dict(
            _recipe(REPO_ROOT / "trainer_image" / f"Dockerfile.{other}").env)


def _source_folder(package: str) -> str:
    """Where a package of ours lives in the checkout (pyproject's package-dir)."""
    return "operator" if package == "tardigrade_operator" else "trainer_image"


def test_each_image_states_modules_that_exist_in_its_sources():
    for recipe in SHIPPED:
        copied = {src.rstrip("/") for sources, _ in recipe.sources for src in sources}
        for module in recipe.modules:
            package = module.split(".")[0]
            folder = f"{_source_folder(package)}/{package}"
            assert any(folder == c or folder.startswith(f"{c}/") for c in copied), (
                f"{recipe.name} runs {module} but does not copy {folder}/")
            path = REPO_ROOT / _source_folder(package) / module.replace(".", "/")
            assert path.with_suffix(".py").exists() or (path / "__init__.py").exists(), module


# The operator's image holds the contract and none of the trainer's other packages.
TRAINER_ONLY = ("tardigrade_trainer", "tardigrade_sdk", "tardigrade_checkpoint")


def test_the_operator_image_copies_the_contract_and_no_other_trainer_package():
    recipe = next(r for r in SHIPPED if r.name == "operator")
    staged = {target.split("/")[1] for _, target in context_files(recipe)
              if target.startswith("trainer_image/")}
    assert staged == {"tardigrade_contract"}, staged


@pytest.mark.parametrize(("text", "error"), [
    ('FROM python:3.11-slim\nENTRYPOINT python -m x\n', "exec form"),
    ('FROM python:3.11-slim\nADD x.tar /opt\n', "COPY src... dest"),
    ('FROM python:3.11-slim\nONBUILD RUN true\n', "not understood"),
    ('RUN true\n', "before the first FROM"),
])
def test_dockerfile_features_the_local_images_cannot_reproduce_are_errors(text, error):
    with pytest.raises(DockerfileError, match=re.escape(error)):
        parse_stages(text, "Dockerfile")


def test_dockerfile_continuations_comments_and_env_forms_parse_as_docker_does():
    stage = parse_stages(
        'FROM python:3.11-slim AS build\n'
        'ENV A=1 B="two words" \\\n'
        '# a comment inside a continuation is dropped\n'
        '    C=3\n'
        'ENV LEGACY value with spaces\n'
        'ENTRYPOINT ["x"]\n', "Dockerfile")[0]
    assert (stage.name, stage.env) == ("build", {"A": "1", "B": "two words", "C": "3",
                                                 "LEGACY": "value with spaces"})
    assert stage.entrypoint == ("x",)


def test_dockerignore_matches_like_docker(tmp_path):
    from tardigrade_local.dockerfile import DockerIgnore

    (tmp_path / ".dockerignore").write_text("**/__pycache__\n*.egg-info\nbench\n!bench/keep\n")
    ignore = DockerIgnore.read(tmp_path)
    assert ignore.excluded("a/b/__pycache__/x.pyc") and ignore.excluded("__pycache__")
    assert ignore.excluded("x.egg-info/PKG-INFO") and not ignore.excluded("a/x.egg-info")
    assert ignore.excluded("bench/run.py") and not ignore.excluded("bench/keep")


# --- the images, rebuilt as virtualenvs -----------------------------------------------------
def _image_env(recipe: ImageRecipe, venv: imagevenv.ImageVenv, home) -> dict[str, str]:
    """What a container of the image gets: its ENV and its programs first on PATH; none of the
    checkout (no PYTHONPATH, run outside the repository)."""
    return {**dict(recipe.env), "PATH": f"{venv.bin_dir}{os.pathsep}{os.defpath}",
            "HOME": str(home)}


@pytest.fixture(scope="module", params=SHIPPED, ids=[r.name for r in SHIPPED])
def image(request) -> imagevenv.ImageVenv:
    venv = imagevenv.image_venv(request.param)
    imagevenv.ensure(venv)
    return venv


def _run(image: imagevenv.ImageVenv, argv: list[str], tmp_path,
         **env: str) -> subprocess.CompletedProcess[str]:
    with imagevenv.in_use(image):
        return subprocess.run(argv, env={**_image_env(image.recipe, image, tmp_path), **env},
                              cwd=tmp_path, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_entrypoint_and_cmd_run_with_help(image, tmp_path):
    # The local kubelet's own resolution: ENTRYPOINT + CMD, programs from the image's venv.
    argv = ImageMap.with_extra([image.rule()]).argv(image.recipe.title, None, None)
    assert argv[0].startswith(str(image.bin_dir))
    result = _run(image, [*argv, "--help"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "usage" in result.stdout.lower()


@pytest.mark.slow
def test_the_image_imports_every_module_it_runs_and_not_the_local_cluster(image, tmp_path):
    probe = (
        "import importlib, importlib.util, json, sys\n"
        f"modules = {list(image.recipe.modules)!r}\n"
        "files = {m: importlib.import_module(m).__file__ for m in modules}\n"
        "print(json.dumps({'files': files,\n"
        "                  'local': importlib.util.find_spec('tardigrade_local') is not None}))\n"
    )
    result = _run(image, [str(image.python), "-c", probe], tmp_path)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert found["local"] is False
    for module, path in found["files"].items():
        assert path.startswith(str(image.venv)), f"{module} came from {path}"


@pytest.fixture(scope="module")
def operator_image() -> imagevenv.ImageVenv:
    venv = imagevenv.shipped_image("operator")
    imagevenv.ensure(venv)
    return venv


@pytest.mark.slow
def test_the_operator_image_cannot_import_the_trainer_sdk_or_checkpoint_library(
        operator_image, tmp_path):
    probe = ("import importlib.util, json\n"
             f"print(json.dumps({{m: importlib.util.find_spec(m) is not None "
             f"for m in {[*TRAINER_ONLY, 'tardigrade_contract']!r}}}))\n")
    result = _run(operator_image, [str(operator_image.python), "-c", probe], tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {**dict.fromkeys(TRAINER_ONLY, False),
                                         "tardigrade_contract": True}


@pytest.mark.slow
@pytest.mark.parametrize(("args", "expected"), [
    (["--version"], f"tardigrade {PROJECT['version']}"),
    (["crd"], "kind: CustomResourceDefinition"),
    (["reference"], "TrainingJob"),
    (["timeline", "--help"], "Usage"),
    (["operator", "run", "--help"], "--all-namespaces"),
    # The chart's pre-delete hook runs this in the operator image.
    (["operator", "release", "--help"], "--deployment"),
])
def test_operator_image_runs_every_operator_side_command(operator_image, tmp_path, args,
                                                         expected):
    result = _run(operator_image, [str(operator_image.bin_dir / "tardigrade"), *args], tmp_path)
    assert result.returncode == 0, result.stderr
    assert expected in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("args", [["local", "up"], ["local", "--help"], ["demo", "--quick"]])
def test_local_commands_without_the_local_extra_say_which_extra_in_one_line(operator_image,
                                                                          tmp_path, args):
    result = _run(operator_image, [str(operator_image.bin_dir / "tardigrade"), *args], tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'tardigrade[local]'" in lines[0], result.stderr


@pytest.mark.slow
def test_trainer_image_without_the_operator_environment_names_what_is_missing(tmp_path):
    recipe = next(r for r in SHIPPED if r.name == "trainer-cpu")
    venv = imagevenv.image_venv(recipe)
    imagevenv.ensure(venv)
    argv = ImageMap.with_extra([venv.rule()]).argv(recipe.title, None, None)
    result = _run(venv, argv, tmp_path,
                  TARDIGRADE_TERMINATION_LOG=str(tmp_path / "termination-log"))
    assert result.returncode != 0
    assert re.search(r"TARDIGRADE_\w+ is not set", result.stderr), result.stderr
    assert json.loads((tmp_path / "termination-log").read_text())["reason"] == "ConfigError"


# --- a real image build, where Docker exists ------------------------------------------------
def _docker_engine() -> str | None:
    """Why `docker build` cannot run here, or None when it can."""
    if shutil.which("docker") is None:
        return "no docker CLI on PATH"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    return None if info.returncode == 0 else f"no Docker engine: {info.stderr.strip()[:200]}"


@pytest.mark.slow
@pytest.mark.parametrize("recipe", SHIPPED, ids=[r.name for r in SHIPPED])
def test_docker_build(recipe, tmp_path):
    """The real image: base image, USER and ENV included; its entry point answers --help."""
    reason = _docker_engine()
    if reason:
        pytest.skip(reason)
    tag = f"tardigrade-test/{recipe.name}:{os.getpid()}"
    build = subprocess.run(["docker", "build", "-f", str(recipe.dockerfile), "-t", tag,
                            str(REPO_ROOT)], capture_output=True, text=True, timeout=1800)
    assert build.returncode == 0, build.stderr[-3000:]
    try:
        run = subprocess.run(["docker", "run", "--rm", tag, *recipe.cmd, "--help"],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        user = subprocess.run(["docker", "run", "--rm", "--entrypoint", "id", tag, "-u"],
                              capture_output=True, text=True, timeout=300)
        assert user.stdout.strip() == (recipe.user or "").split(":")[0]
    finally:
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True, timeout=300)


def test_the_interpreter_building_the_venvs_matches_the_base_images():
    for recipe in SHIPPED:
        version = re.match(r"python:(\d+\.\d+)", recipe.base)
        assert version is not None, f"{recipe.name}: base image {recipe.base} is not python:X.Y"
        if version.group(1) != f"{sys.version_info.major}.{sys.version_info.minor}":
            pytest.skip(f"{recipe.name} is based on Python {version.group(1)}; the venvs here "
                        f"use {sys.version.split()[0]}")
