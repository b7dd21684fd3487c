"""The images as shipped (docs/images.md), checked two ways:

- each Dockerfile built for real with buildah (`tardigrade_local.imagebuild`) on a base made
  from Debian 12's Python 3.11, pushed to a local registry (distribution v3), its config pulled
  back and checked (USER, WORKDIR, ENTRYPOINT, CMD, ENV, labels), and its entry point and
  modules run inside the image as its user. Cold (empty image cache): the module took 5 min
  here; warm: 1 min 14 s, the builds being lookups and the rest the pushes (figures below);
  the operator image runs every operator-side command, and the trainer image without the
  operator's environment names what is missing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tomllib
from collections.abc import Iterator

import pytest
from tardigrade_local import imagebuild
from tardigrade_local.dockerfile import (
    DockerfileError,
    ImageRecipe,
    context_files,
    parse_stages,
    read_recipe,
)
from tardigrade_local.registry import Registry

from tests.conftest import REPO_ROOT

DOCKERFILES = [REPO_ROOT / "operator" / "Dockerfile",
               *sorted((REPO_ROOT / "trainer_image").glob("Dockerfile.*"))]
PROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]
IDS = [p.relative_to(REPO_ROOT).as_posix() for p in DOCKERFILES]
SHIPPED = [imagebuild.image(name).recipe for name in imagebuild.DOCKERFILES]


def _recipe(dockerfile) -> ImageRecipe:
    return read_recipe(dockerfile, REPO_ROOT)


# --- what the Dockerfiles say (no build) ----------------------------------------------------
@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=IDS)
def test_image_runs_as_non_root(dockerfile):
    user = _recipe(dockerfile).user
    assert user is not None and user.split(":")[0] not in ("root", "0")


@pytest.mark.parametrize("accelerator", ["cpu", "gpu"])
def test_cpu_and_gpu_trainer_images_run_as_the_user_the_operator_renders(accelerator):
    """The pod's runAsUser wins over the image's USER: they must name the same user, or the
    trainer runs as a uid its image has no passwd entry for."""
    from tardigrade_operator.rendering.manifests import TRAINER_UID

    recipe = _recipe(REPO_ROOT / "trainer_image" / f"Dockerfile.{accelerator}")
    assert recipe.user == f"{TRAINER_UID}:{TRAINER_UID}"
    assert any(f"useradd --uid {TRAINER_UID} --user-group" in run for run in recipe.runs)


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


def test_the_base_image_is_a_build_argument_whose_default_is_the_public_image():
    # GKE users build with no argument and get python:3.11-slim; the local build passes its
    # own base (imagebuild.BASE_ARG).
    for dockerfile in DOCKERFILES:
        stages = parse_stages(dockerfile.read_text(), dockerfile.name)
        assert {stage.base for stage in stages} == {"python:3.11-slim"}
        assert re.search(rf"^ARG {imagebuild.BASE_ARG}=python:3.11-slim$",
                         dockerfile.read_text(), re.M)
        assert all(line.split()[1] == f"${{{imagebuild.BASE_ARG}}}"
                   for line in dockerfile.read_text().splitlines() if line.startswith("FROM"))


@pytest.mark.parametrize(("text", "error"), [
    ("ARG BASE\nFROM $BASE\n", "needs a default"),
    ("ARG BASE=x\nFROM ${OTHER}\n", "$OTHER is not an ARG"),
])
def test_arguments_in_from_need_a_declared_default(text, error):
    with pytest.raises(DockerfileError, match=re.escape(error)):
        parse_stages(text, "Dockerfile")


def test_dockerignore_matches_like_docker(tmp_path):
    from tardigrade_local.dockerfile import DockerIgnore

    (tmp_path / ".dockerignore").write_text("**/__pycache__\n*.egg-info\nbench\n!bench/keep\n")
    ignore = DockerIgnore.read(tmp_path)
    assert ignore.excluded("a/b/__pycache__/x.pyc") and ignore.excluded("__pycache__")
    assert ignore.excluded("x.egg-info/PKG-INFO") and not ignore.excluded("a/x.egg-info")
    assert ignore.excluded("bench/run.py") and not ignore.excluded("bench/keep")


# --- the real images, built with buildah from the same Dockerfiles -------------------------
# Measured on a 2-core machine shared with other test runs (scripts/setup installs buildah,
# mmdebstrap and Go), this whole module with TARDIGRADE_CACHE_DIR empty: 5 min 3 s (the base
# and the operator 159 s, trainer-cpu 55 s, trainer-tpu 61 s, each with its push); again with
# the same inputs: 1 min 14 s, each build a lookup of 0.1-0.2 s, the rest the pushes (7-21 s
# per image) and the runs. local_cluster/REAL_NODES.md has the figures per image.
BUILT = imagebuild.DEFAULT_IMAGES
BUILDER_TOOLS = ("buildah", "mmdebstrap", "go")


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> Iterator[Registry]:
    missing = [tool for tool in BUILDER_TOOLS if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} not installed: scripts/setup installs the image "
                    "builder (apt: buildah mmdebstrap skopeo umoci) and needs Go")
    root = tmp_path_factory.mktemp("registry")
    with Registry(root / "storage", log_path=root / "registry.log") as running:
        yield running


@dataclasses.dataclass(frozen=True)
class Pushed:
    built: imagebuild.Built
    reference: str  # in the registry
    repository: str
    tag: str


@pytest.fixture(scope="module", params=BUILT)
def pushed(request, registry) -> Pushed:
    built = imagebuild.build(request.param)
    reference = imagebuild.push(built, registry.host, PROJECT["version"])
    repository, tag = reference.removeprefix(f"{registry.host}/").rsplit(":", 1)
    return Pushed(built, reference, repository, tag)


def _pulled_config(registry: Registry, pushed: Pushed, check_layers: bool = False) -> dict:
    """The image config a cluster gets: manifest, then its config blob, from the registry."""
    manifest, digest = registry.manifest(pushed.repository, pushed.tag)
    assert digest.startswith("sha256:")
    assert manifest["config"]["digest"] == f"sha256:{pushed.built.image_id}"
    if check_layers:
        for layer in manifest["layers"]:
            assert registry.blob_sha256(pushed.repository, layer["digest"]) == (
                layer["size"], layer["digest"])
    return json.loads(registry.blob(pushed.repository, manifest["config"]["digest"]))


@pytest.mark.slow
def test_the_built_image_in_the_registry_has_the_dockerfiles_config(registry, pushed):
    recipe = pushed.built.image.recipe
    config = _pulled_config(registry, pushed, check_layers=True)["config"]
    assert config["User"] == recipe.user
    assert config["Entrypoint"] == list(recipe.entrypoint)
    assert (config.get("Cmd") or []) == list(recipe.cmd)
    final = parse_stages(recipe.dockerfile.read_text())[-1]
    assert (config.get("WorkingDir") or "/") == final.workdir
    env = dict(line.split("=", 1) for line in config["Env"])
    assert dict(recipe.env).items() <= env.items()
    assert "/usr/local/bin" in env["PATH"].split(":")
    assert config["Labels"]["dev.tardigrade.image.modules"] == " ".join(recipe.modules)


@pytest.fixture(scope="module")
def pulled(pushed) -> Iterator[str]:
    """The image as a node gets it: pulled back from the registry (the layers are already in
    the store, so the pull checks the manifest and config and transfers no layer)."""
    assert imagebuild.pull(pushed.reference) == pushed.built.image_id
    yield pushed.reference
    imagebuild.forget(pushed.reference)  # the registry's port is this run's


@pytest.mark.slow
def test_the_built_images_entry_point_answers_help_as_its_user(pulled, pushed, registry):
    config = _pulled_config(registry, pushed)["config"]
    argv = [*config["Entrypoint"], *(config.get("Cmd") or []), "--help"]
    result = imagebuild.run_in_image(pulled, argv)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "usage" in result.stdout.lower()
    who = imagebuild.run_in_image(pulled, ["id", "-u"])
    assert who.stdout.strip() == (pushed.built.image.recipe.user or "").split(":")[0]


@pytest.mark.slow
def test_the_built_image_imports_what_it_runs_from_its_install_and_not_the_local_cluster(
        pulled, pushed):
    recipe = pushed.built.image.recipe
    probe = (
        "import importlib, importlib.util, json, sys\n"
        f"modules = {list(recipe.modules)!r}\n"
        "files = {m: importlib.import_module(m).__file__ for m in modules}\n"
        "print(json.dumps({'files': files, 'version': sys.version_info[:2],\n"
        "                  'local': importlib.util.find_spec('tardigrade_local') is not None}))\n"
    )
    result = imagebuild.run_in_image(pulled, ["python", "-c", probe])
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout)
    assert found["local"] is False
    assert found["version"] == [3, 11]
    for module, path in found["files"].items():
        # pip's install into the system interpreter (dist-packages on Debian's Python,
        # site-packages on python:3.11-slim), never the copied sources in WORKDIR.
        assert path.startswith("/usr/local/lib/python3.11/"), f"{module} came from {path}"


@pytest.mark.slow
def test_the_build_machines_ca_bundle_stays_out_of_the_image(pulled):
    # RUN steps see the host's bundle (imagebuild.HOST_CA_BUNDLE, for this machine's proxy);
    # the image keeps its base's.
    bundle = str(imagebuild.HOST_CA_BUNDLE)
    image = imagebuild.run_in_image(pulled, ["sha256sum", bundle])
    base = imagebuild.run_in_image(imagebuild.base_reference(), ["sha256sum", bundle])
    assert image.returncode == 0 and base.returncode == 0, image.stderr + base.stderr
    assert image.stdout == base.stdout


def test_prune_keeps_the_newest_builds_of_one_image_only():
    name = f"prune-test-{os.getpid()}"
    made = []
    for tag in ("k0", "k1", "k2", "k3", "other"):
        container = imagebuild.buildah("from", "scratch", what="scratch").strip()
        try:
            imagebuild.buildah("config", "--label", f"n={tag}", container, what="label")
            image_name = f"{name}-other" if tag == "other" else name
            reference = f"{imagebuild.BUILD_NAME}/{image_name}:{tag}"
            imagebuild.buildah("commit", "--quiet", container, reference, what="commit")
            made.append(reference)
        finally:
            imagebuild.buildah("rm", container, what="rm")
    try:
        assert imagebuild.prune(name, keep=2) == made[1::-1]  # the oldest two, newest first
        assert [imagebuild.image_id(ref) is not None for ref in made] == [
            False, False, True, True, True]
    finally:
        for reference in made:
            if imagebuild.image_id(reference):
                imagebuild.forget(reference)


@pytest.mark.slow
def test_the_tpu_image_has_libtpu_and_the_cpu_images_jax(registry):
    versions = {}
    for name in ("trainer-cpu", "trainer-tpu"):
        built = imagebuild.build(name)  # a lookup after the fixtures' builds
        result = imagebuild.run_in_image(built.reference, [
            "python", "-c", "import importlib.metadata as m, importlib.util as u, jax; "
                            "print(jax.__version__, u.find_spec('libtpu') is not None, "
                            "m.version('ml_dtypes'))"])
        assert result.returncode == 0, result.stderr[-3000:]
        versions[name] = result.stdout.split()
    assert versions["trainer-cpu"][0] == versions["trainer-tpu"][0]
    assert (versions["trainer-cpu"][1], versions["trainer-tpu"][1]) == ("False", "True")
    # The accelerator install keeps [trainer]'s ml_dtypes pin (docs/images.md).
    assert versions["trainer-tpu"][2] == versions["trainer-cpu"][2]


@pytest.mark.slow
def test_a_second_build_with_the_same_inputs_is_a_lookup(pushed):
    again = imagebuild.build(pushed.built.image.name)
    assert (again.cached, again.reference, again.image_id) == (
        True, pushed.built.reference, pushed.built.image_id)
    assert again.seconds < 30, f"a cache hit took {again.seconds:.1f} s"


def test_the_image_key_changes_with_each_input_and_nothing_else(tmp_path):
    """Without building: a copied source, the Dockerfile and the base decide the key; a file
    the Dockerfile does not copy (or that .dockerignore drops) does not."""
    image = imagebuild.image("operator")
    copied = [(path, target) for path, target in
              context_files(image.all_copies())]
    for path, target in copied:
        (tmp_path / target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, tmp_path / target)
    (tmp_path / "operator").mkdir(exist_ok=True)
    shutil.copy2(image.dockerfile, tmp_path / "operator" / "Dockerfile")
    shutil.copy2(REPO_ROOT / ".dockerignore", tmp_path / ".dockerignore")

    def key(base: str = "sha256:base") -> str:
        return imagebuild.image("operator", tmp_path).key(base)

    first = key()
    assert key() == first
    assert key("sha256:other-base") != first
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "new.py").write_text("x = 1\n")  # not copied
    (tmp_path / "operator" / "tardigrade_operator" / "__pycache__").mkdir(exist_ok=True)
    (tmp_path / "operator" / "tardigrade_operator" / "__pycache__" / "x.pyc").write_bytes(b"1")
    assert key() == first
    source = tmp_path / "operator" / "tardigrade_operator" / "__init__.py"
    source.write_text(source.read_text() + "\n# changed\n")
    changed = key()
    assert changed != first
    dockerfile = tmp_path / "operator" / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text() + "\n# a comment\n")
    assert key() not in (first, changed)


# --- what the built images run, as a node runs them ----------------------------------------
def _entry_point(reference: str) -> list[str]:
    config = imagebuild.image_config(reference)
    return [*config["Entrypoint"], *(config.get("Cmd") or [])]  # type: ignore[misc]


def _run_captured(reference: str, argv: list[str], env: str = "", then_show: str = ""
                  ) -> tuple[int, str, str, str]:
    """`argv` in a container of the image (with `env`, `NAME=value ...`): its exit status,
    stdout and stderr, apart from what buildah itself adds to a failed run's stderr, and the
    file `then_show` as the run left it in the same container."""
    script = (f'{env} "$@" >/tmp/out 2>/tmp/err; echo "$?"; cat /tmp/out; '
              'echo "--- stderr"; cat /tmp/err; echo "--- file"; '
              f'{"cat " + then_show if then_show else "true"}')
    result = imagebuild.run_in_image(reference, ["sh", "-c", script, "sh", *argv])
    assert result.returncode == 0, result.stderr[-3000:]
    code, rest = result.stdout.split("\n", 1)
    out, _, rest = rest.partition("--- stderr\n")
    err, _, shown = rest.partition("--- file\n")
    return int(code), out, err, shown


@pytest.fixture(scope="module")
def operator_image() -> str:
    return imagebuild.build("operator").reference


@pytest.mark.slow
def test_the_operator_image_cannot_import_the_trainer_sdk_or_checkpoint_library(
        operator_image):
    probe = ("import importlib.util, json\n"
             f"print(json.dumps({{m: importlib.util.find_spec(m) is not None "
             f"for m in {[*TRAINER_ONLY, 'tardigrade_contract']!r}}}))\n")
    result = imagebuild.run_in_image(operator_image, ["python", "-c", probe])
    assert result.returncode == 0, result.stderr[-3000:]
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
def test_operator_image_runs_every_operator_side_command(operator_image, args, expected):
    entry = imagebuild.image_config(operator_image)["Entrypoint"]
    result = imagebuild.run_in_image(operator_image, [*entry, *args])  # type: ignore[misc]
    assert result.returncode == 0, result.stderr[-3000:]
    assert expected in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("args", [["local", "up"], ["local", "--help"], ["demo", "--quick"]])
def test_local_commands_without_the_local_extra_say_which_extra_in_one_line(operator_image,
                                                                          args):
    entry = imagebuild.image_config(operator_image)["Entrypoint"]
    code, out, err, _ = _run_captured(operator_image, [*entry, *args])  # type: ignore[misc]
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "pip install 'tardigrade[local]'" in lines[0], err


@pytest.mark.slow
def test_trainer_image_without_the_operator_environment_names_what_is_missing():
    reference = imagebuild.build("trainer-cpu").reference
    code, _, err, log = _run_captured(reference, _entry_point(reference),
                                      env="TARDIGRADE_TERMINATION_LOG=/tmp/termination-log",
                                      then_show="/tmp/termination-log")
    assert code != 0
    assert re.search(r"TARDIGRADE_\w+ is not set", err), err[-3000:]
    assert json.loads(log)["reason"] == "ConfigError"


@pytest.mark.slow
def test_a_derived_test_image_runs_its_added_program_on_its_base_and_is_cached(registry):
    """`build_derived` (tests/faults/Dockerfile.simtrainer): the trainer CPU image as built
    here is its base, through BASE_IMAGE, nothing pulled; the added simulated trainer imports
    from the image's install; a second build is a lookup; it pushes under its key."""
    base = imagebuild.build("trainer-cpu")  # a lookup after the fixtures' builds
    dockerfile = REPO_ROOT / "tests" / "faults" / "Dockerfile.simtrainer"
    built = imagebuild.build_derived("simtrainer", dockerfile, base)
    result = imagebuild.run_in_image(built.reference, [
        "python", "-c", "import tardigrade_local.simtrainer as s, tardigrade_contract as c; "
                        "print(s.__file__, c.__file__)"])
    assert result.returncode == 0, result.stderr[-3000:]
    program, contract = result.stdout.split()
    assert program == "/opt/simtrainer/tardigrade_local/simtrainer.py"
    assert contract.startswith("/usr/local/lib/python3.11/")  # the image's install
    again = imagebuild.build_derived("simtrainer", dockerfile, base)
    assert (again.cached, again.reference, again.image_id) == (
        True, built.reference, built.image_id)
    reference = imagebuild.push_derived(built, registry.host)
    assert reference == f"{registry.host}/tardigrade-dev/simtrainer:{built.key}"
    assert imagebuild.pull(reference) == built.image_id
    imagebuild.forget(reference)  # the registry's port is this run's
