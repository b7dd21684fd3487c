"""Build the local cluster's programs from the pinned Go modules in `local_cluster/builds/`.

Every program of the control plane is compiled here with `go build` from a module whose
`go.mod` and `go.sum` are committed (never a downloaded binary). One module per group of
programs, so that Go's minimal version selection cannot move one program's dependencies
under another. The binaries land in a cache outside the clone, keyed by everything that
decides their bytes (the module's go.mod and go.sum, the Go version, the build flags), so a
second clone on the same machine builds nothing, and a changed pin builds afresh.

`python -m tardigrade_local.gobuild` builds whatever is missing (what `scripts/setup` runs);
`binary("kube-apiserver")` is where the cluster finds a program.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TextIO

BUILDS_DIR = Path(__file__).resolve().parents[1] / "builds"
# As upstream builds its release binaries (kubernetes hack/lib/golang.sh): static, no paths
# of the build machine in the binary, and the tags of its release builds (`Module.tags`).
PROGRESS_SECONDS = 15.0


class BuildError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class Module:
    """A directory of `local_cluster/builds/` and the programs built from it."""

    name: str
    programs: tuple[tuple[str, str], ...]  # (binary name, Go package)
    # cgo and build tags as the program's own release build has them (runc: libseccomp).
    cgo: bool = False
    tags: str = "selinux,notest"
    # `-X` variables that get a pinned version: (Go variable, module path whose version).
    version_variables: tuple[tuple[str, str], ...] = ()

    @property
    def build_flags(self) -> tuple[str, ...]:
        return ("-trimpath", "-tags", self.tags)

    @property
    def directory(self) -> Path:
        return BUILDS_DIR / self.name

    def requirement(self, module_path: str) -> str:
        """The pinned version of `module_path` in this module's go.mod."""
        text = (self.directory / "go.mod").read_text()
        found = re.search(rf"^\s*(?:require\s+)?{re.escape(module_path)}\s+(v\S+)", text, re.M)
        if found is None:
            raise BuildError(f"{self.directory / 'go.mod'} does not require {module_path}")
        return found.group(1)


KUBERNETES = Module("kubernetes", (
    ("kube-apiserver", "k8s.io/kubernetes/cmd/kube-apiserver"),
    ("kube-controller-manager", "k8s.io/kubernetes/cmd/kube-controller-manager"),
    ("kube-scheduler", "k8s.io/kubernetes/cmd/kube-scheduler"),
))
ETCD = Module("etcd", (("etcd", "go.etcd.io/etcd/server/v3"),))
FAKE_GCS = Module("fakegcs", (("fake-gcs-server", "github.com/fsouza/fake-gcs-server"),))
# Kueue's manager, for `tardigrade local up --kueue` only: built when asked for (by name, or
# by a cluster that starts it), never by a plain set-up. `kueue` pins the version the local
# cluster runs; `kueue-v0.17` the oldest Tardigrade supports, for a run that checks it
# (KUEUE_MODULE_ENV).
KUEUE_PACKAGE = "sigs.k8s.io/kueue/cmd/kueue"
KUEUE = Module("kueue", (("kueue", KUEUE_PACKAGE),))
KUEUE_OLDEST = Module("kueue-v0.17", (("kueue", KUEUE_PACKAGE),))
KUEUE_MODULE_ENV = "TARDIGRADE_KUEUE_MODULE"
# What a real node runs (`realnode.py`): the kubelet and kube-proxy of the control plane's
# pin, containerd with runc, crictl and the CNI plugins, each group from a module of its own.
# Each stamps its version the way its Makefile does, so the Node object reports
# `containerd://2.4.2` rather than `2.4.2+unknown`.
KUBERNETES_NODE = Module("kubernetes-node", (
    ("kubelet", "k8s.io/kubernetes/cmd/kubelet"),
    ("kube-proxy", "k8s.io/kubernetes/cmd/kube-proxy"),
))
CONTAINERD = Module("containerd", (
    ("containerd", "github.com/containerd/containerd/v2/cmd/containerd"),
    ("containerd-shim-runc-v2", "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"),
    ("ctr", "github.com/containerd/containerd/v2/cmd/ctr"),
), version_variables=(("github.com/containerd/containerd/v2/version.Version",
                       "github.com/containerd/containerd/v2"),))
# runc's Makefile: cgo, `seccomp` (Debian's libseccomp-dev and pkg-config); its
# `libpathrs` tag needs a Rust library Debian 12 does not ship, and is left out. runc reads
# its version from its embedded VERSION file.
RUNC = Module("runc", (("runc", "github.com/opencontainers/runc"),), cgo=True,
              tags="seccomp,urfave_cli_no_docs")
CRI_TOOLS = Module("cri-tools", (("crictl", "sigs.k8s.io/cri-tools/cmd/crictl"),),
                   version_variables=(("sigs.k8s.io/cri-tools/pkg/version.Version",
                                       "sigs.k8s.io/cri-tools"),))
_CNI = "github.com/containernetworking/plugins"
CNI_PLUGINS = Module("cni-plugins", (
    ("bridge", f"{_CNI}/plugins/main/bridge"),
    ("loopback", f"{_CNI}/plugins/main/loopback"),
    ("host-local", f"{_CNI}/plugins/ipam/host-local"),
    ("portmap", f"{_CNI}/plugins/meta/portmap"),
), version_variables=((f"{_CNI}/pkg/utils/buildversion.BuildVersion", _CNI),))
# CoreDNS, the cluster DNS real nodes' pods resolve Service names with (clusterdns.py), as
# GKE's kube-dns does. Its Makefile builds with `CGO_ENABLED=0`, tag `grpcnotrace`, and
# stamps only a git commit (`coremain.GitCommit`, not a version: `coremain.CoreVersion` is
# in its source), which a module build has none of.
COREDNS = Module("coredns", (("coredns", "github.com/coredns/coredns"),), tags="grpcnotrace")
# kube-network-policies (kubernetes-sigs), built only when asked for by name: it runs here,
# but cannot enforce on this kernel (no nftables `queue`, REAL_NODES.md). Upstream's Makefile
# builds `cmd/main.go` with `CGO_ENABLED=0`, no tags and no version stamp.
NETWORK_POLICIES = Module("kube-network-policies", (
    ("kube-network-policies", "sigs.k8s.io/kube-network-policies/cmd"),), tags="")
# kube-router's network policy controller (`--run-firewall` only), the enforcer real nodes
# run (netpolicy.py): iptables and ipset, which this kernel has, where kube-network-policies
# needs nftables' `queue` expression, which it lacks (REAL_NODES.md). CGO_ENABLED=0 and its
# Makefile's `-X .../pkg/version.Version` (a git commit there; the pinned version here).
KUBE_ROUTER = Module("kube-router", (
    ("kube-router", "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router"),), tags="",
    version_variables=(("github.com/cloudnativelabs/kube-router/v2/pkg/version.Version",
                        "github.com/cloudnativelabs/kube-router/v2"),))
NODE_MODULES = (KUBERNETES_NODE, CONTAINERD, RUNC, CRI_TOOLS, CNI_PLUGINS, COREDNS,
                KUBE_ROUTER)
# distribution v3 (the Docker registry), which the images built here are pushed to and pulled
# from (registry.py, imagebuild.py); built when a registry starts or when asked for by name.
REGISTRY = Module("registry", (
    ("registry", "github.com/distribution/distribution/v3/cmd/registry"),),
    version_variables=(("github.com/distribution/distribution/v3/version.version",
                        "github.com/distribution/distribution/v3"),))
# `python -m tardigrade_local.gobuild node` builds these (what scripts/setup runs as root).
GROUPS = {"node": NODE_MODULES}
MODULES = (KUBERNETES, ETCD, FAKE_GCS)
OPTIONAL_MODULES = (KUEUE, KUEUE_OLDEST, *NODE_MODULES, NETWORK_POLICIES, REGISTRY)
PROGRAMS = {program: module for module in (*MODULES, KUEUE, *NODE_MODULES, NETWORK_POLICIES,
                                           REGISTRY)
            for program, _ in module.programs}


def kueue_module() -> Module:
    """The Kueue module a cluster builds and runs: `builds/kueue` unless
    $TARDIGRADE_KUEUE_MODULE names another of the Kueue modules (`kueue-v0.17`)."""
    name = os.environ.get(KUEUE_MODULE_ENV) or KUEUE.name
    kueues = {m.name: m for m in OPTIONAL_MODULES if m.programs == KUEUE.programs}
    if name not in kueues:
        raise BuildError(f"${KUEUE_MODULE_ENV}={name!r} names no Kueue module; one of "
                         f"{sorted(kueues)} (folders of {BUILDS_DIR})")
    return kueues[name]


def kueue_version() -> str:
    """The Kueue version the chosen module pins (e.g. v0.19.2)."""
    return kueue_module().requirement("sigs.k8s.io/kueue")


def kubernetes_version() -> str:
    return KUBERNETES.requirement("k8s.io/kubernetes")


def _version_ldflags(module: Module) -> list[str]:
    """What `kubectl version` and `/version` report: without these, a module build says
    v0.0.0-master+$Format:%H$ (k8s.io/component-base/version/base.go)."""
    flags = [f"-X {variable}={module.requirement(path)}"
             for variable, path in module.version_variables]
    if module not in (KUBERNETES, KUBERNETES_NODE):
        return flags
    version = module.requirement("k8s.io/kubernetes")
    major, minor = version.lstrip("v").split(".")[:2]
    for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [f"-X {package}.gitVersion={version}", f"-X {package}.gitMajor={major}",
                  f"-X {package}.gitMinor={minor}", f"-X {package}.gitTreeState=clean"]
    return flags


def _ldflags(module: Module) -> str:
    return " ".join(["-s", "-w", *_version_ldflags(module)])


def go_env(cgo: bool = False) -> dict[str, str]:
    # GOTOOLCHAIN=local: the machine's Go builds it, never one fetched behind our back;
    # -mod=readonly: the committed go.sum is the whole truth.
    return {**os.environ, "GOTOOLCHAIN": "local", "CGO_ENABLED": "1" if cgo else "0",
            "GOFLAGS": "-mod=readonly"}


def _go_version() -> str:
    try:
        done = subprocess.run(["go", "version"], capture_output=True, text=True, check=True,
                              env=go_env())
    except (OSError, subprocess.CalledProcessError) as err:
        raise BuildError(f"Go is needed to build the local cluster's control plane: {err}"
                         ) from err
    return done.stdout.strip()


def cache_root() -> Path:
    base = os.environ.get("TARDIGRADE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tardigrade")
    return Path(base) / "gobin"


def build_key(module: Module, go_version: str) -> str:
    digest = hashlib.sha256()
    for part in ((module.directory / "go.mod").read_bytes(),
                 (module.directory / "go.sum").read_bytes(), go_version.encode(),
                 " ".join(module.build_flags).encode(), _ldflags(module).encode(),
                 repr(module.programs).encode()):
        digest.update(hashlib.sha256(part).digest())
    if module.cgo:
        # A cgo build also depends on the C toolchain and libraries, which no pin names.
        digest.update(b"cgo")
    return digest.hexdigest()[:16]


_keys: dict[str, Path] = {}


def module_dir(module: Module) -> Path:
    """Where this module's binaries live once built (whether or not they are yet)."""
    if module.name not in _keys:
        _keys[module.name] = cache_root() / f"{module.name}-{build_key(module, _go_version())}"
    return _keys[module.name]


def binary(program: str) -> Path:
    """The built program; BuildError naming the fix if it is not built yet."""
    module = kueue_module() if PROGRAMS[program] is KUEUE else PROGRAMS[program]
    path = module_dir(module) / program
    if not path.is_file():
        raise BuildError(f"{program} is not built for the pinned modules (looked in "
                         f"{path.parent}): run scripts/setup, or "
                         f"`python -m tardigrade_local.gobuild`")
    return path


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure(module: Module, out: TextIO = sys.stderr) -> Path:
    """Build `module`'s programs unless its cache entry exists; returns the directory.

    Two clones setting up at once build once: the second waits on the first's lock."""
    target = module_dir(module)
    if all((target / name).is_file() for name, _ in module.programs):
        return target
    with _locked(target.with_suffix(".lock")):
        if all((target / name).is_file() for name, _ in module.programs):
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{module.name}-", dir=target.parent))
        try:
            _build(module, staging, out)
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _build(module: Module, destination: Path, out: TextIO) -> None:
    started = time.monotonic()
    print(f"gobuild: building {module.name} ({', '.join(n for n, _ in module.programs)}) "
          f"from {module.directory.relative_to(BUILDS_DIR.parents[1])}: a cold build takes "
          f"minutes, progress every {PROGRESS_SECONDS:.0f} s", file=out, flush=True)
    for name, package in module.programs:
        command = ["go", "build", "-v", *module.build_flags, "-ldflags", _ldflags(module),
                   "-o", str(destination / name), package]
        _run_with_progress(command, module, name, started, out)
    print(f"gobuild: {module.name} built in {time.monotonic() - started:.0f} s", file=out,
          flush=True)


def _run_with_progress(command: Sequence[str], module: Module, name: str, started: float,
                       out: TextIO) -> None:
    """`go build -v` names each package as it compiles it: count them, and say so now and
    then, so a cold build is never minutes of silence."""
    proc = subprocess.Popen(command, cwd=module.directory, env=go_env(module.cgo), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines: list[str] = []
    stop = threading.Event()

    def report() -> None:
        while not stop.wait(PROGRESS_SECONDS):
            print(f"gobuild: {name}: {len(lines)} packages compiled, "
                  f"{time.monotonic() - started:.0f} s", file=out, flush=True)

    reporter = threading.Thread(target=report, daemon=True)
    reporter.start()
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.rstrip())
    code = proc.wait()
    stop.set()
    if code != 0:
        tail = "\n".join(lines[-40:])
        raise BuildError(f"go build of {name} failed (exit {code}):\n{tail}")


def registry_binary() -> Path:
    """The registry program, built first if it is not yet."""
    return ensure(REGISTRY) / "registry"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*",
                        help="modules to build, or `node` for a real node's (default: all "
                             "but the optional ones, "
                             f"{', '.join(m.name for m in OPTIONAL_MODULES)})")
    parser.add_argument("--print-dir", action="store_true",
                        help="print each module's binary directory after building it")
    args = parser.parse_args(argv)
    known = (*MODULES, *OPTIONAL_MODULES)
    unknown = set(args.modules) - {m.name for m in known} - set(GROUPS)
    if unknown:
        parser.error(f"unknown modules {sorted(unknown)}; known: {[m.name for m in known]} "
                     f"and the groups {sorted(GROUPS)}")
    names = {n for name in args.modules for n in (
        [m.name for m in GROUPS[name]] if name in GROUPS else [name])}
    chosen = [m for m in known if m.name in names] if args.modules else list(MODULES)
    try:
        for module in chosen:
            directory = ensure(module)
            if args.print_dir:
                print(directory)
    except BuildError as err:
        print(f"gobuild: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
