"""JSON-lines logging to stdout: one object per line, safe from several threads."""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any, TextIO


class JsonLog:
    def __init__(self, process_id: int, stream: TextIO | None = None,
                 attempt: int | None = None) -> None:
        self.process_id = process_id
        self.stream = stream or sys.stdout
        # A pod restarted in place keeps its first attempt's name: the line says which attempt
        # wrote it.
        self._fields: dict[str, Any] = {"process": process_id}
        if attempt is not None:
            self._fields["attempt"] = attempt
        self._lock = threading.Lock()

    def __call__(self, record: dict[str, Any]) -> None:
        line = json.dumps({"time": round(time.time(), 3), **self._fields, **record})
        with self._lock:
            self.stream.write(line + "\n")
            self.stream.flush()
