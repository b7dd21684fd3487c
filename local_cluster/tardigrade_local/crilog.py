"""Container logs in the CRI format that real kubelets keep on disk.

One record per line: `<RFC 3339 time> <stdout|stderr> <F|P> <content>`, where `P` marks a
partial line continued by the next record. Timestamps make `kubectl logs --timestamps`,
`--since` and `--since-time` work.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterable, Iterator
from typing import BinaryIO

MAX_RECORD_BYTES = 16 * 1024  # longer lines are split into partial records, as containerd does


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class CriLogWriter:
    """Turns a stream's raw bytes into CRI records appended to `out`."""

    def __init__(self, out: BinaryIO, stream: str) -> None:
        self.out = out
        self.prefix = stream.encode()
        self._buffer = b""

    def _record(self, tag: bytes, content: bytes) -> None:
        self.out.write(b"%s %s %s %s\n" % (_now().encode(), self.prefix, tag, content))

    def feed(self, data: bytes) -> None:
        self._buffer += data
        while True:
            line, newline, rest = self._buffer.partition(b"\n")
            if len(line) > MAX_RECORD_BYTES:
                self._record(b"P", line[:MAX_RECORD_BYTES])
                self._buffer = self._buffer[MAX_RECORD_BYTES:]
            elif newline:
                self._record(b"F", line)
                self._buffer = rest
            elif len(self._buffer) >= MAX_RECORD_BYTES:
                self._record(b"P", self._buffer[:MAX_RECORD_BYTES])
                self._buffer = self._buffer[MAX_RECORD_BYTES:]
            else:
                break
        self.out.flush()

    def close(self) -> None:
        if self._buffer:
            self._record(b"P", self._buffer)
            self._buffer = b""
        self.out.flush()


@dataclasses.dataclass(frozen=True)
class Record:
    time: str
    stream: str
    partial: bool
    content: bytes

    @property
    def when(self) -> dt.datetime:
        return dt.datetime.strptime(self.time, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=dt.UTC)

    def render(self, timestamps: bool) -> bytes:
        text = self.content if self.partial else self.content + b"\n"
        return (self.time.encode() + b" " + text) if timestamps else text


def parse(data: bytes) -> Iterator[Record]:
    """Records in `data`; an incomplete last line (still being written) is left out."""
    for line in data.split(b"\n")[:-1]:
        parts = line.split(b" ", 3)
        if len(parts) < 3:
            continue
        content = parts[3] if len(parts) == 4 else b""
        yield Record(parts[0].decode(), parts[1].decode(), parts[2] == b"P", content)


def select(records: Iterable[Record], since: dt.datetime | None = None,
           tail_lines: int | None = None) -> list[Record]:
    chosen = [r for r in records if since is None or r.when >= since]
    if tail_lines is None:
        return chosen
    # Count whole lines: partial records belong to the line that completes them (or to the
    # unfinished last line).
    lines: list[list[Record]] = []
    current: list[Record] = []
    for record in chosen:
        current.append(record)
        if not record.partial:
            lines.append(current)
            current = []
    if current:
        lines.append(current)
    kept = lines[-tail_lines:] if tail_lines > 0 else []
    return [r for line in kept for r in line]


def text(data: bytes) -> str:
    """The plain log text (what `kubectl logs` shows without options)."""
    return b"".join(r.render(False) for r in parse(data)).decode(errors="replace")
