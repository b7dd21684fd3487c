"""A container registry on loopback: distribution v3 (the Docker registry), built from its
pinned module (`builds/registry/`, `gobuild.REGISTRY`).

Images built here (`imagebuild`) are pushed to it and pulled from it, as a GKE cluster's are
to and from Artifact Registry. Plain HTTP on 127.0.0.1 (clients need `--tls-verify=false`),
no authentication, its blobs on disk under `storage` (kept across restarts).
`with Registry(storage) as registry: registry.host` ("127.0.0.1:PORT").
Configuration reference: distribution's docs/content/about/configuration.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from tardigrade_local import gobuild, lifetime
from tardigrade_local.lifetime import die_with_parent
from tardigrade_local.ports import free_port

READY_TIMEOUT_SECONDS = 30.0
# What a pull asks for: an OCI index or manifest, or Docker's schema 2 (buildah pushes OCI).
MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json",
                  "application/vnd.oci.image.index.v1+json",
                  "application/vnd.docker.distribution.manifest.v2+json",
                  "application/vnd.docker.distribution.manifest.list.v2+json")


class RegistryError(RuntimeError):
    pass


def config_text(storage: Path, host: str, port: int) -> str:
    """The registry's configuration (JSON is YAML)."""
    return json.dumps({
        "version": "0.1",
        "log": {"level": "warn", "accesslog": {"disabled": True}},
        "storage": {"filesystem": {"rootdirectory": str(storage)},
                    "delete": {"enabled": True}},
        "http": {"addr": f"{host}:{port}"},
    }, indent=1)


class Registry:
    def __init__(self, storage: Path, port: int | None = None, host: str = "127.0.0.1",
                 log_path: Path | None = None) -> None:
        self.storage = storage
        self.host_name = host
        self.port = port or free_port()
        self.log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        """What image references start with: `127.0.0.1:PORT`."""
        return f"{self.host_name}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    def start(self) -> Registry:
        """Start it (building it first if need be) and wait until it answers `/v2/`. The
        process dies with the thread that starts it (PR_SET_PDEATHSIG)."""
        binary = gobuild.registry_binary()
        self.storage.mkdir(parents=True, exist_ok=True)
        config = self.storage.parent / f"{self.storage.name}.config.json"
        config.write_text(config_text(self.storage, self.host_name, self.port))
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self._proc = subprocess.Popen([str(binary), "serve", str(config)], stdout=out,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          preexec_fn=die_with_parent)
        finally:
            if self.log_path:
                out.close()  # type: ignore[union-attr]
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                raise RegistryError(f"the registry exited with {self._proc.returncode}"
                                    + (f"; its log: {self.log_path}" if self.log_path else ""))
            try:
                with urllib.request.urlopen(f"{self.url}/v2/", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RegistryError(f"the registry did not answer {self.url}/v2/ within "
                                    f"{READY_TIMEOUT_SECONDS:.0f} s")
            time.sleep(0.1)

    def _get(self, path: str, accept: tuple[str, ...] = ()) -> tuple[bytes, dict[str, str]]:
        request = urllib.request.Request(f"{self.url}/v2/{path}",
                                         headers={"Accept": ", ".join(accept)} if accept else {})
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                return answer.read(), dict(answer.headers)
        except urllib.error.HTTPError as err:
            raise RegistryError(f"GET /v2/{path}: {err.code} {err.read()[:300]!r}") from err

    def tags(self, repository: str) -> list[str]:
        body, _ = self._get(f"{repository}/tags/list")
        return list(json.loads(body).get("tags") or [])

    def manifest(self, repository: str, reference: str) -> tuple[dict[str, object], str]:
        """The manifest a pull gets for `repository:reference`, and its digest."""
        body, headers = self._get(f"{repository}/manifests/{reference}", MANIFEST_TYPES)
        digest = next((v for k, v in headers.items() if k.lower() == "docker-content-digest"),
                      "")
        return json.loads(body), digest

    def blob(self, repository: str, digest: str) -> bytes:
        body, _ = self._get(f"{repository}/blobs/{digest}")
        return body

    def blob_sha256(self, repository: str, digest: str) -> tuple[int, str]:
        """(size, sha256:...) of a blob as served, read in chunks (layers are large)."""
        sha = hashlib.sha256()
        size = 0
        try:
            with urllib.request.urlopen(f"{self.url}/v2/{repository}/blobs/{digest}",
                                        timeout=60) as answer:
                while chunk := answer.read(1 << 20):
                    sha.update(chunk)
                    size += len(chunk)
        except urllib.error.HTTPError as err:
            raise RegistryError(f"GET blob {digest}: {err.code}") from err
        return size, f"sha256:{sha.hexdigest()}"

    def stop(self) -> None:
        if self._proc is None:
            return
        lifetime.stop(self._proc)
        self._proc = None

    def __enter__(self) -> Registry:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        with contextlib.suppress(Exception):
            self.stop()
