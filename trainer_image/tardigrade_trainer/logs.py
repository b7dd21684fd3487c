"""JSON-lines logging to stdout: one object per line, safe from several threads."""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any, TextIO


class JsonLog:
    def __init__(self, process_id: int, stream: TextIO | None = None) -> None:
        self.process_id = process_id
        self.stream = stream or sys.stdout
        self._lock = threading.Lock()

    def __call__(self, record: dict[str, Any]) -> None:
        line = json.dumps({"time": round(time.time(), 3), "process": self.process_id, **record})
        with self._lock:
            self.stream.write(line + "\n")
            self.stream.flush()
