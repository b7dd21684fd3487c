"""A GCS emulator on loopback: fake-gcs-server, built from its pinned module (`gobuild.py`).

Built rather than taken from the PyPI wrapper, whose bundled binary ignores
`ifGenerationMatch` (a create-only upload succeeded twice there): this one answers 412 to a
failed precondition on media, multipart and resumable uploads, as GCS does, which the
checkpoint root record's compare-and-swap relies on (tests/local/test_gcs_emulator.py; what
it does not check is in local_cluster/README.md, "The GCS emulator").

Pods and tests reach it through `client_env()`, which also points every Google auth library
away from the cloud metadata server so that no client leaves loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from types import TracebackType

from tardigrade_local import gobuild, lifetime
from tardigrade_local.lifetime import die_with_parent
from tardigrade_local.ports import free_port

READY_TIMEOUT_SECONDS = 30.0
# An access-log line as fake-gcs-server writes it: ... \"PUT /upload/storage/v1/... HTTP/1.1\" 200
_ACCESS_LINE = re.compile(r'\\"([A-Z]+) (\S+) HTTP/[0-9.]+\\" (\d{3})')


def _binary() -> str:
    return str(gobuild.binary("fake-gcs-server"))


def client_env(url: str) -> dict[str, str]:
    """Environment for TensorStore, google-cloud-storage and gcsfs clients of `url`."""
    return {
        "TENSORSTORE_GCS_HTTP_URL": url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "local-token",
        "STORAGE_EMULATOR_HOST": url,
        **offline_google_env(),
    }


def offline_google_env() -> dict[str, str]:
    """Keep google-auth from probing the metadata server (a non-loopback address)."""
    closed = "127.0.0.1:1"
    return {
        "GCE_METADATA_HOST": closed,
        "GCE_METADATA_IP": closed,
        "GCE_METADATA_ROOT": closed,
        "NO_GCE_CHECK": "true",
        "GOOGLE_CLOUD_PROJECT": "local",
        # A credentials file that does not exist beats one found in a home directory.
        "GOOGLE_APPLICATION_CREDENTIALS": os.devnull,
    }


class GcsEmulator:
    """`with GcsEmulator(log_path=...) as gcs: gcs.create_bucket("b"); gcs.url`."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1",
                 log_path: Path | None = None, data_dir: Path | None = None,
                 log_requests: bool = False) -> None:
        self.host = host
        self.port = port or free_port()
        self.log_path = log_path
        self.data_dir = data_dir  # None: in memory
        # fake-gcs-server logs one access-log line per request at level info.
        if log_requests and log_path is None:
            raise ValueError("log_requests needs a log_path to count requests in")
        self.log_requests = log_requests
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def endpoint(self) -> str:
        return self.url

    def start(self) -> GcsEmulator:
        self.spawn()
        self.wait_ready()
        return self

    def spawn(self) -> None:
        """Start the server process. It dies with the thread that calls this (prctl
        PR_SET_PDEATHSIG), so call it from one that lives as long as the emulator should."""
        argv = [_binary(), "-scheme", "http", "-host", self.host, "-port", str(self.port),
                "-external-url", self.url, "-log-level",
                "info" if self.log_requests else "warn"]
        if self.data_dir is None:
            argv += ["-backend", "memory"]
        else:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            argv += ["-backend", "filesystem", "-filesystem-root", str(self.data_dir)]
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self._proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        finally:
            if self.log_path:
                out.close()  # type: ignore[union-attr]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"fake-gcs-server exited with {self._proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/storage/v1/b", timeout=2):
                    return
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    raise RuntimeError("fake-gcs-server did not become ready") from None
                time.sleep(0.1)

    def create_bucket(self, name: str) -> None:
        request = urllib.request.Request(
            self.url + "/storage/v1/b?project=local", method="POST",
            data=json.dumps({"name": name}).encode(), headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10):
                pass
        except urllib.error.HTTPError as err:
            if err.code != 409:  # already there
                raise

    def client_env(self) -> dict[str, str]:
        return client_env(self.url)

    def list_objects(self, bucket: str, prefix: str = "") -> list[str]:
        names: list[str] = []
        token = ""
        while True:
            query = f"prefix={urllib.parse.quote(prefix)}"
            if token:
                query += f"&pageToken={token}"
            url = f"{self.url}/storage/v1/b/{bucket}/o?{query}"
            with urllib.request.urlopen(url, timeout=10) as response:
                page = json.load(response)
            names.extend(item["name"] for item in page.get("items", []))
            token = page.get("nextPageToken", "")
            if not token:
                return names

    def requests(self) -> list[tuple[str, str]]:
        """(method, path) of every request served so far (needs `log_requests`)."""
        return [(method, path) for method, path, _ in self.answers()]

    def answers(self) -> list[tuple[str, str, int]]:
        """(method, path, status) of every request served so far (needs `log_requests`)."""
        if not self.log_requests or self.log_path is None:
            raise RuntimeError("start the emulator with log_requests=True and a log_path")
        served = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            match = _ACCESS_LINE.search(line)
            if match:
                served.append((match.group(1), match.group(2), int(match.group(3))))
        return served

    def stop(self) -> None:
        if self._proc is None:
            return
        lifetime.stop(self._proc)
        self._proc = None

    def __enter__(self) -> GcsEmulator:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        with contextlib.suppress(Exception):
            self.stop()
