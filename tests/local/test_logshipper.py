"""The log shipper writes what the API serves in the kubelet's CRI format, so the readers of
the kubelets' files read it as the container wrote it."""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path

import kubernetes
from tardigrade_local import crilog, logshipper
from tardigrade_local.logshipper import LogShipper, cri_line
from tardigrade_local.steplog import StepLog

STAMPED = [f"2026-12-07T02:40:0{i}Z line {i}" for i in range(3)]


def test_shipped_lines_read_back_as_written() -> None:
    lines = ['{"event": "step", "step": 1, "loss": 2.5}', "", "a line with  spaces ",
             "ünïcode"]
    shipped = "".join(cri_line(f"2026-12-07T02:40:00.{i:09d}Z {line}")
                      for i, line in enumerate(lines))
    assert crilog.text(shipped.encode()).splitlines() == lines


def test_a_step_log_reads_shipped_files(tmp_path: Path) -> None:
    run = tmp_path / "default_j-a2-0_uid-1" / "trainer" / "0.log"
    run.parent.mkdir(parents=True)
    records = [{"event": "checkpoint_restored", "step": 4},
               {"event": "step", "step": 5, "loss": 1.25}]
    run.write_text("".join(cri_line(f"2026-12-07T02:40:00Z {json.dumps(r)}") for r in records))
    log = StepLog.from_pod_log_dirs([tmp_path], "default", "j")
    assert log.losses == {5: [1.25]}
    assert log.restored == [4]


class _CutShort(http.server.BaseHTTPRequestHandler):
    """The API server of a run of three lines, of which the first follow gets one line and an
    end while the container still runs (its kubelet's connection lost); later ones get all
    three, and the container has ended."""
    follows = 0

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        if "/log?" in self.path:
            type(self).follows += 1
            lines = STAMPED[:1] if self.follows == 1 else STAMPED
            self._answer("text/plain", "".join(f"{line}\n" for line in lines).encode())
            return
        state = {"running": {}} if self.follows < 2 else {"terminated": {"exitCode": 0}}
        self._answer("application/json", json.dumps({
            "kind": "Pod", "apiVersion": "v1", "metadata": {"name": "p"},
            "status": {"containerStatuses": [{
                "name": "c", "restartCount": 0, "state": state, "image": "i", "imageID": "",
                "ready": True}]}}).encode())

    def _answer(self, content_type: str, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_a_follow_cut_short_while_the_run_goes_on_is_made_again_without_repeats(
        tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(logshipper, "RETRY_SECONDS", 0.01)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _CutShort)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    config = kubernetes.client.Configuration()
    config.host = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        shipper = LogShipper(lambda: kubernetes.client.ApiClient(config), tmp_path, "default")
        run = tmp_path / "0.log"
        shipper._follow("p", "c", 0, run, previous=False)
    finally:
        server.shutdown()
        server.server_close()
    assert _CutShort.follows == 2
    assert run.read_text() == "".join(cri_line(line) for line in STAMPED)
