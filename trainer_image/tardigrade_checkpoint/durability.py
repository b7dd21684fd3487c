"""Make a save's local files durable with one filesystem flush instead of fsyncs per file.

TensorStore's file driver fsyncs every file it writes and then its directory: a save of N
chunk files (plus one metadata file per array) costs 2N+ synchronous flushes, each a journal
commit on ext4. syncfs(2) writes back every dirty page and inode of the filesystem at once and,
since Linux 5.8, fails if any writeback error happened on that filesystem since the
descriptor it is given was opened. Opening that descriptor before the first write therefore
gives the same guarantee for the commit protocol (everything a host wrote is on stable
storage before the hosts agree that the step is written) with one call per host.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

_Syncfs = Callable[[int], int]


def _load_syncfs() -> _Syncfs | None:
    try:
        function = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):  # not Linux/glibc: keep TensorStore's per-file fsyncs
        return None
    function.argtypes = [ctypes.c_int]
    function.restype = ctypes.c_int
    return function


_SYNCFS = _load_syncfs()


def available() -> bool:
    return _SYNCFS is not None


class FilesystemFlush:
    """Open it before writing under `directory`; `flush()` once all files are written."""

    def __init__(self, directory: str) -> None:
        if _SYNCFS is None:
            raise OSError("syncfs is not available on this platform")
        self._syncfs = _SYNCFS
        os.makedirs(directory, exist_ok=True)
        self._fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)

    def flush(self) -> None:
        if self._syncfs(self._fd) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"syncfs: {os.strerror(errno)}")

    def close(self) -> None:
        os.close(self._fd)
