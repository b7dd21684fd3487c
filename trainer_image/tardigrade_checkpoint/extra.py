"""The `extra` of a save: checked where the caller passes it, not where process 0 commits.

`extra` goes into the commit marker, which process 0 writes after every host has written its
shards. Found out only then, a value JSON cannot hold (a numpy scalar, a set, NaN) failed
the commit on process 0 alone, after the whole save's I/O. Checked in `save()`, it fails at
the call, on every host alike, naming the offending entry.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any


class ExtraError(TypeError):
    """`extra` holds something the commit marker (JSON) cannot."""


def _problem(value: Any, where: str) -> str | None:
    if value is None or isinstance(value, (str, bool, int)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{where} is {value!r}, which JSON cannot hold"
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            found = _problem(item, f"{where}[{index}]")
            if found:
                return found
        return None
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{where} has the key {key!r} ({type(key).__name__}), not a string"
            found = _problem(item, f"{where}[{key!r}]")
            if found:
                return found
        return None
    return (f"{where} is a {type(value).__module__}.{type(value).__qualname__}"
            f" ({value!r:.60}), not a JSON value")


def check_extra(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of `extra` as the commit marker will hold it, or ExtraError naming the entry."""
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise ExtraError(f"save(extra=...) must be a mapping of JSON values, "
                         f"got {type(extra).__name__}")
    found = _problem(extra, "extra")
    if found:
        raise ExtraError(f"save(extra=...): {found}. Convert it to str, int, float, bool, None, "
                         "or lists and string-keyed dicts of those (e.g. int(x) for a numpy "
                         "integer)")
    return dict(json.loads(json.dumps(extra, allow_nan=False)))
