"""What a Dockerfile of ours says its image is: base, sources, extras, ENV, ENTRYPOINT, CMD.

The image builder (`imagebuild.py`, buildah) and the image tests read the image from its
Dockerfile through this module, so that what they build and check cannot drift from what
`docker build` produces. Only the subset of
the Dockerfile reference that our Dockerfiles use is understood (ARG with a default before the
first FROM, FROM ... AS, WORKDIR, COPY from the build context, RUN, ENV, LABEL, USER,
ENTRYPOINT/CMD in exec form); anything else that would change the result is an error naming
the line. (`imagebuild` builds the real images from the same files.)
Reference: https://docs.docker.com/reference/dockerfile/ and, for `.dockerignore`,
https://docs.docker.com/build/concepts/context/#dockerignore-files
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
import re
import shlex
from collections.abc import Iterable, Iterator
from pathlib import Path

# Labels our Dockerfiles carry. `title` is the OCI image title (the image repository's last
# path element); `modules` lists the modules the image is meant to run (smoke-tested).
LABEL_TITLE = "org.opencontainers.image.title"
LABEL_MODULES = "dev.tardigrade.image.modules"
PROJECT = "tardigrade"

# Our own project as a pip requirement with extras: ".[trainer]" or "$(ls /wheels/*.whl)[operator]".
_OWN_REQUIREMENT = re.compile(r'"(\.|\$\(ls [^)]*\.whl\))\[([A-Za-z0-9_,-]+)\]"')
_PIP_WHEEL_OWN = re.compile(r"\bpip wheel\b[^&;|]*\s\.(\s|$)")
_IGNORED = frozenset({"EXPOSE", "ARG", "SHELL", "STOPSIGNAL", "HEALTHCHECK", "VOLUME"})


class DockerfileError(ValueError):
    """A Dockerfile this module cannot turn into an image description."""


@dataclasses.dataclass(frozen=True)
class Instruction:
    line: int
    keyword: str
    args: str


@dataclasses.dataclass
class Stage:
    base: str
    name: str | None
    workdir: str = "/"
    # (sources in the build context, destination), in order.
    context_copies: list[tuple[tuple[str, ...], str]] = dataclasses.field(default_factory=list)
    runs: list[str] = dataclasses.field(default_factory=list)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    user: str | None = None
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class ImageRecipe:
    """One image as its Dockerfile builds it."""

    dockerfile: Path
    context: Path
    base: str
    title: str
    modules: tuple[str, ...]
    # Extras of our project that the image installs.
    extras: tuple[str, ...]
    # What the stage that builds our package copies from the context: (sources, destination
    # relative to that stage's WORKDIR).
    sources: tuple[tuple[tuple[str, ...], str], ...]
    env: tuple[tuple[str, str], ...]
    user: str | None
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]
    # Every RUN of the final stage (the GPU/TPU images add accelerator wheels there).
    runs: tuple[str, ...]

    @property
    def name(self) -> str:
        """`operator` for operator/Dockerfile, `trainer-cpu` for trainer_image/Dockerfile.cpu."""
        suffix = self.dockerfile.suffix.lstrip(".")
        base = self.title.removeprefix(f"{PROJECT}-")
        return f"{base}-{suffix}" if suffix else base


def instructions(text: str) -> Iterator[Instruction]:
    """Logical lines: comments dropped, backslash continuations joined."""
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        keyword, _, args = " ".join(pending).partition(" ")
        pending = []
        yield Instruction(start, keyword.upper(), args.strip())
    if pending:
        raise DockerfileError(f"line {start}: the last instruction ends with a continuation")


def _pairs(args: str, where: str) -> dict[str, str]:
    """`K=V K2="v 2"`, or the legacy one-pair form `K V`."""
    words = shlex.split(args)
    if words and "=" not in words[0]:
        return {words[0]: " ".join(words[1:])}
    pairs = {}
    for word in words:
        key, sep, value = word.partition("=")
        if not sep:
            raise DockerfileError(f"{where}: {word!r} is not KEY=VALUE")
        pairs[key] = value
    return pairs


def _exec_form(args: str, where: str) -> tuple[str, ...]:
    try:
        value = json.loads(args)
    except ValueError:
        value = None
    if not (isinstance(value, list) and all(isinstance(x, str) for x in value)):
        raise DockerfileError(f"{where}: write it in exec form, e.g. [\"python\", \"-m\", \"x\"]: "
                              "the shell form depends on the base image's /bin/sh")
    return tuple(value)


_ARG_REFERENCE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


def _global_arg(args: str, where: str) -> tuple[str, str]:
    """`ARG NAME=default` before the first FROM: what FROM may use (a build argument can
    replace it; the recipe is the image built with the defaults)."""
    name, sep, default = args.partition("=")
    if not sep or not re.fullmatch(r"\w+", name):
        raise DockerfileError(f"{where}: an ARG before FROM needs a default: `ARG NAME=value`")
    return name, default.strip('"')


def _substitute(text: str, values: dict[str, str], where: str) -> str:
    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise DockerfileError(f"{where}: ${name} is not an ARG declared before the first FROM")
        return values[name]

    return _ARG_REFERENCE.sub(value, text)


def parse_stages(text: str, source: str = "Dockerfile") -> list[Stage]:
    stages: list[Stage] = []
    global_args: dict[str, str] = {}
    for ins in instructions(text):
        where = f"{source}:{ins.line} {ins.keyword}"
        if ins.keyword == "ARG" and not stages:
            name, default = _global_arg(ins.args, where)
            global_args[name] = default
            continue
        if ins.keyword == "FROM":
            words = _substitute(ins.args, global_args, where).split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            if len(words) not in (1, 3) or (len(words) == 3 and name is None):
                raise DockerfileError(f"{where}: expected `FROM image [AS name]`")
            stages.append(Stage(base=words[0], name=name))
            continue
        if not stages:
            raise DockerfileError(f"{where}: comes before the first FROM")
        stage = stages[-1]
        if ins.keyword == "WORKDIR":
            stage.workdir = posixpath.join(stage.workdir, ins.args)
        elif ins.keyword in ("COPY", "ADD"):
            words = shlex.split(ins.args)
            if any(w.startswith("--from=") for w in words):
                continue  # from another stage: its result, not the context
            if ins.keyword == "ADD" or any(w.startswith("--") for w in words) or len(words) < 2:
                raise DockerfileError(f"{where}: only `COPY src... dest` from the context is "
                                      "understood")
            stage.context_copies.append((tuple(words[:-1]), words[-1]))
        elif ins.keyword == "RUN":
            stage.runs.append(ins.args)
        elif ins.keyword == "ENV":
            stage.env.update(_pairs(ins.args, where))
        elif ins.keyword == "LABEL":
            stage.labels.update(_pairs(ins.args, where))
        elif ins.keyword == "USER":
            stage.user = ins.args
        elif ins.keyword == "ENTRYPOINT":
            stage.entrypoint = _exec_form(ins.args, where)
            stage.cmd = ()  # as in Docker: a new ENTRYPOINT resets an inherited CMD
        elif ins.keyword == "CMD":
            stage.cmd = _exec_form(ins.args, where)
        elif ins.keyword not in _IGNORED:
            raise DockerfileError(f"{where}: instruction not understood by the local images")
    if not stages:
        raise DockerfileError(f"{source}: no FROM")
    return stages


def _build_stage(stages: list[Stage], source: str) -> Stage:
    """The stage that builds our package: `pip wheel ... .` or `pip install ".[...]"`."""
    for stage in stages:
        if any(_PIP_WHEEL_OWN.search(run) or '".[' in run for run in stage.runs):
            return stage
    raise DockerfileError(f"{source}: no stage builds the project (`pip wheel --no-deps "
                          "--wheel-dir /wheels .` or `pip install \".[extra]\"`)")


def read_recipe(dockerfile: Path, context: Path) -> ImageRecipe:
    source = str(dockerfile.relative_to(context)) if dockerfile.is_relative_to(context) \
        else str(dockerfile)
    stages = parse_stages(dockerfile.read_text(), source)
    final = stages[-1]
    extras = [extra for run in final.runs for _, names in _OWN_REQUIREMENT.findall(run)
              for extra in names.split(",")]
    if not extras:
        raise DockerfileError(f"{source}: the final stage installs none of the project's extras "
                              "(expected pip install \".[extra]\" or \"$(ls /wheels/*.whl)"
                              "[extra]\")")
    labels = final.labels
    for label in (LABEL_TITLE, LABEL_MODULES):
        if not labels.get(label):
            raise DockerfileError(f"{source}: add LABEL {label}=... to the final stage")
    if not final.entrypoint:
        raise DockerfileError(f"{source}: the final stage has no ENTRYPOINT")
    return ImageRecipe(
        dockerfile=dockerfile, context=context, base=final.base, title=labels[LABEL_TITLE],
        modules=tuple(labels[LABEL_MODULES].split()), extras=tuple(extras),
        sources=tuple(_build_stage(stages, source).context_copies),
        env=tuple(final.env.items()),
        user=final.user, entrypoint=final.entrypoint, cmd=final.cmd, runs=tuple(final.runs))


# --- the build context ---------------------------------------------------------------------
def _ignore_pattern(pattern: str) -> re.Pattern[str]:
    """A .dockerignore line as a regex over context-relative paths (Go filepath.Match + `**`)."""
    pattern = posixpath.normpath(pattern.strip().strip("/"))
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            if pattern.startswith("/", i):
                out[-1] = "(?:.*/)?"
                i += 1
            continue
        char = pattern[i]
        out.append("[^/]*" if char == "*" else "[^/]" if char == "?" else re.escape(char))
        i += 1
    return re.compile("".join(out))


@dataclasses.dataclass(frozen=True)
class DockerIgnore:
    rules: tuple[tuple[bool, re.Pattern[str]], ...] = ()

    @classmethod
    def read(cls, context: Path) -> DockerIgnore:
        path = context / ".dockerignore"
        lines = path.read_text().splitlines() if path.exists() else []
        rules = []
        for line in lines:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            negate = line.startswith("!")
            rules.append((negate, _ignore_pattern(line.lstrip("!"))))
        return cls(tuple(rules))

    def excluded(self, relative: str) -> bool:
        """Docker excludes a path that a pattern matches, or whose parent directory it matches;
        the last matching line wins, so `!pattern` re-includes."""
        parts = relative.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        result = False
        for negate, regex in self.rules:
            if any(regex.fullmatch(p) for p in prefixes):
                result = not negate
        return result


def context_files(recipe: ImageRecipe) -> list[tuple[Path, str]]:
    """(file in the context, its path in the build stage relative to the stage's WORKDIR) for
    everything the build stage copies, after .dockerignore; sorted, so it can be hashed."""
    return copied_files(recipe.context, recipe.sources, recipe.dockerfile.name)


def copied_files(context: Path, copies: Iterable[tuple[tuple[str, ...], str]],
                 dockerfile: str) -> list[tuple[Path, str]]:
    """`context_files` of any COPY instructions (sources, destination) of `dockerfile`."""
    ignore = DockerIgnore.read(context)
    files: dict[str, Path] = {}
    for sources, dest in copies:
        for pattern in sources:
            matches = sorted(context.glob(pattern)) if pattern not in (".", "./") \
                else [context]
            if not matches:
                # As `docker build`: "COPY failed: no source files were specified".
                raise DockerfileError(f"{dockerfile}: COPY {pattern}: no such file "
                                      f"in the build context {context}")
            for match in matches:
                rel = match.relative_to(context).as_posix()
                if rel != "." and ignore.excluded(rel):
                    continue
                if match.is_dir():
                    # COPY dir dest: the directory's contents go into dest.
                    for path in sorted(match.rglob("*")):
                        inner = path.relative_to(context).as_posix()
                        if path.is_file() and not ignore.excluded(inner):
                            target = posixpath.join(dest, path.relative_to(match).as_posix())
                            files[posixpath.normpath(target)] = path
                elif match.is_file():
                    target = posixpath.join(dest, match.name) if dest.endswith("/") or \
                        len(sources) > 1 else dest
                    files[posixpath.normpath(target)] = match
    return sorted(((path, target) for target, path in files.items()), key=lambda x: x[1])
