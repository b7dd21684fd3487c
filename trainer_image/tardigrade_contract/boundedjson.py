"""JSON from the API server and from peers, decoded with its nesting bounded.

kube-apiserver stores JSON nested up to 10,000 levels (sigs.k8s.io/json, `maxNestingDepth`).
Python's `json` recurses once per level and raises RecursionError near the interpreter's
limit (1,000 by default; from 3.12 on, C code has its own fixed limit that
`sys.setrecursionlimit` does not raise), and so does nearly everything that reads the result
afterwards: `copy.deepcopy`, `json.dumps`, kopf's diffs, pydantic, CEL. Raising limits only
moves the cliff (a deep enough value then overflows the C stack and kills the process).

So the depth is measured on the text, without recursion, before anything is decoded: every
value nested deeper than `limit` is cut out of the text and replaced by a marker,
`{"tardigrade.dev/nestedTooDeep": N}`, N being how many levels the removed value had. The
document then decodes with `json` as usual, nothing downstream ever sees more than `limit`+1
levels, and whoever reads the field learns which one was too deep and by how much
(`nesting_depth` counts a marker as the levels it stands for).
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any, TypeVar

# The marker left where a value nested too deep was cut out.
MARKER = "tardigrade.dev/nestedTooDeep"
# What the operator decodes API objects with: above anything it accepts (a trainer config of
# 100 levels sits at most ~110 levels down in a watch event or a list, its managedFields
# included), and far below any interpreter's recursion limit, however many frames each level
# costs its readers.
API_OBJECT_LIMIT = 128

_T = TypeVar("_T", str, bytes)
# A JSON string literal. Outside strings, valid JSON has no quotes: scanning left to right,
# each match is exactly one literal, and the brackets it holds are not structure.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)
_OPEN = frozenset(b"[{")
_QUOTE = ord('"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
# Openings as +1, closings as -1 (signed bytes): the running sum is the depth.
_SIGNED = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")


def max_depth(text: str | bytes) -> int:
    """Levels of objects and arrays in a JSON text, counted without decoding it."""
    data = _as_bytes(text)
    if data.count(b"{") + data.count(b"[") == 0:
        return 0
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKETS).translate(_SIGNED)
    return max(0, max(itertools.accumulate(memoryview(brackets).cast("b")), default=0))


def bound(text: _T, limit: int = API_OBJECT_LIMIT) -> _T:
    """`text` with every value nested deeper than `limit` levels replaced by a marker (the
    text itself when none is). Invalid JSON raises json.JSONDecodeError, as json would."""
    data = _as_bytes(text)
    if data.count(b"{") + data.count(b"[") <= limit or max_depth(data) <= limit:
        return text
    pieces, kept = [], 0
    depth, start, deepest = 0, -1, 0
    for token in _TOKEN.finditer(data):
        at = token.start()
        char = data[at]
        if char == _QUOTE:
            continue
        if char in _OPEN:
            depth += 1
            if start < 0 and depth > limit:
                start, deepest = at, depth
            deepest = max(deepest, depth)
            continue
        depth -= 1
        if depth < 0:
            raise json.JSONDecodeError("unbalanced closing bracket", _as_str(data), at)
        if start >= 0 and depth == limit:
            pieces += [data[kept:start], marker_text(deepest - limit).encode()]
            kept, start = token.end(), -1
    if depth != 0:
        raise json.JSONDecodeError("unclosed object or array", _as_str(data), len(data))
    cut = b"".join([*pieces, data[kept:]])
    return cut.decode("utf-8", "surrogatepass") if isinstance(text, str) else cut  # type: ignore[return-value]


def loads(text: str | bytes, limit: int = API_OBJECT_LIMIT) -> Any:
    """json.loads, with values nested deeper than `limit` replaced by markers (see `bound`)."""
    return json.loads(bound(text, limit))


def marker_text(levels: int) -> str:
    return json.dumps({MARKER: levels}, separators=(",", ":"))


def removed_levels(value: Any) -> int | None:
    """The levels a marker stands for; None when `value` is not a marker."""
    if isinstance(value, dict) and len(value) == 1:
        levels = value.get(MARKER)
        if isinstance(levels, int) and not isinstance(levels, bool) and levels > 0:
            return levels
    return None


def nesting_depth(value: Any) -> int:
    """Levels of objects and arrays in decoded JSON, counted without recursion; a marker
    counts as the levels of the value it replaced."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        removed = removed_levels(item)
        if removed is not None:
            deepest = max(deepest, depth + removed)
            continue
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth + 1)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _as_bytes(text: str | bytes) -> bytes:
    return text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)


def _as_str(data: bytes) -> str:
    return data.decode("utf-8", "replace")
