"""The image venv cache: rebuilt when the image's dependencies change, only our wheel
reinstalled when our sources change, untouched otherwise."""

from __future__ import annotations

import subprocess
import textwrap

import pytest
from tardigrade_local import imagevenv
from tardigrade_local.dockerfile import read_recipe

pytestmark = pytest.mark.slow

DOCKERFILE = """\
FROM python:3.11-slim
WORKDIR /opt/tiny
COPY pyproject.toml ./
COPY src/ src/
RUN pip install ".[run]"
LABEL org.opencontainers.image.title="tiny-app" dev.tardigrade.image.modules="tiny_app"
ENTRYPOINT ["python", "-m", "tiny_app"]
"""


def _project(root, value: int, description: str = "v1", extra: str = "") -> None:
    (root / "src" / "tiny_app").mkdir(parents=True, exist_ok=True)
    (root / "src" / "tiny_app" / "__init__.py").write_text(f"VALUE = {value}\n")
    (root / "pyproject.toml").write_text(textwrap.dedent(f"""\
        [build-system]
        requires = ["setuptools>=77"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "tiny-app"
        version = "0.1.0"
        description = "{description}"
        [project.optional-dependencies]
        run = [{extra}]
        unused = []
        [tool.setuptools.packages.find]
        where = ["src"]
        """))


def _value(image: imagevenv.ImageVenv) -> str:
    return subprocess.run([str(image.python), "-c", "import tiny_app; print(tiny_app.VALUE)"],
                          capture_output=True, text=True, check=True, timeout=60,
                          cwd=image.root).stdout.strip()


def test_venv_is_rebuilt_on_dependency_changes_and_refreshed_on_source_changes(tmp_path):
    context = tmp_path / "context"
    context.mkdir()
    (context / "Dockerfile").write_text(DOCKERFILE)
    (context / ".dockerignore").write_text("**/__pycache__\n")
    _project(context, 1)

    def image() -> imagevenv.ImageVenv:
        return imagevenv.image_venv(read_recipe(context / "Dockerfile", context),
                                    tmp_path / "cache")

    assert imagevenv.ensure(image()) is True
    assert image().recipe.name == "tiny-app"
    assert _value(image()) == "1"
    assert imagevenv.ensure(image()) is False
    # A marker inside the venv tells a reinstall (kept) from a rebuild (gone).
    marker = image().venv / "marker"
    marker.touch()

    _project(context, 2)
    assert imagevenv.ensure(image()) is True
    assert _value(image()) == "2" and marker.exists()

    # pyproject.toml is copied, so a non-dependency change is a source change too.
    _project(context, 2, description="v2")
    assert imagevenv.ensure(image()) is True and marker.exists()
    # An extra this image does not install is not its dependency.
    text = (context / "pyproject.toml").read_text().replace("unused = []", 'unused = ["x"]')
    (context / "pyproject.toml").write_text(text)
    assert imagevenv.ensure(image()) is True and marker.exists()

    # ENV and LABEL do not change what is installed; a RUN line may.
    (context / "Dockerfile").write_text(DOCKERFILE.replace("WORKDIR", "ENV A=1\nWORKDIR"))
    assert imagevenv.ensure(image()) is False and marker.exists()
    (context / "Dockerfile").write_text(DOCKERFILE.replace("pip install", "pip install -q"))
    assert imagevenv.ensure(image()) is True
    assert not marker.exists() and _value(image()) == "2"
    # Only the copied files count: an ignored or uncopied file changes nothing.
    (context / "src" / "tiny_app" / "__pycache__").mkdir()
    (context / "src" / "tiny_app" / "__pycache__" / "x.pyc").write_bytes(b"x")
    (context / "notes.txt").write_text("not copied")
    assert imagevenv.ensure(image()) is False
