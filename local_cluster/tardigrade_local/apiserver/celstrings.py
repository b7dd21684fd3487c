"""CEL's extended strings library, as Kubernetes enables it for CRD validation rules.

cel-python implements the CEL standard definitions only. A real API server adds cel-go's
`ext.Strings` to every CEL environment (k8s.io/apiserver/pkg/cel/environment/base.go: version 0
from Kubernetes 1.0 to 1.28, version 2 since 1.29; the Kubernetes docs page "Common Expression
Language in Kubernetes" lists it for all versions). These are its version-0 functions, with the
semantics of cel-go ext/strings.go: indices count code points (Go runes), `split`/`replace`
follow Go's strings.SplitN/strings.Replace, `trim` Go's strings.TrimSpace, and out-of-range
indices are evaluation errors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import celpy
from celpy import celtypes

# Go's unicode.IsSpace: the Latin-1 spaces, then the Unicode White_Space property.
_GO_SPACE = ("\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007"
             "\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")


def _out_of_range(index: int) -> celpy.CELEvalError:
    return celpy.CELEvalError(f"index out of range: {index}")


def char_at(text: str, index: int) -> Any:
    if index < 0 or index > len(text):
        return _out_of_range(index)
    return celtypes.StringType(text[index] if index < len(text) else "")


def index_of(text: str, sub: str, offset: int = 0) -> Any:
    if sub == "":
        return celtypes.IntType(offset)
    if offset < 0 or offset >= len(text):
        return _out_of_range(offset)
    return celtypes.IntType(text.find(sub, offset))


def last_index_of(text: str, sub: str, offset: int | None = None) -> Any:
    if offset is None:
        if sub == "":
            return celtypes.IntType(len(text))
        offset = len(text) - 1
    if sub == "":
        return celtypes.IntType(offset)
    if offset < 0 or offset >= len(text):
        return _out_of_range(offset)
    # The last match may start at `offset` at most, so it ends by offset + len(sub).
    return celtypes.IntType(text.rfind(sub, 0, offset + len(sub)))


def _ascii_mapped(text: str, convert: Callable[[str], str]) -> str:
    return "".join(convert(c) if c <= "\x7f" else c for c in text)


def lower_ascii(text: str) -> Any:
    return celtypes.StringType(_ascii_mapped(text, str.lower))


def upper_ascii(text: str) -> Any:
    return celtypes.StringType(_ascii_mapped(text, str.upper))


def replace(text: str, old: str, new: str, limit: int = -1) -> Any:
    # Python's str.replace counts as Go's strings.Replace, for an empty `old` too.
    return celtypes.StringType(text.replace(old, new, limit))


def split(text: str, separator: str, limit: int = -1) -> Any:
    if limit == 0:
        return celtypes.ListType([])
    if separator == "":
        # Go explodes into code points; with a limit, the last part is the rest.
        parts = list(text)
        if 0 < limit < len(parts):
            parts = [*parts[:limit - 1], "".join(parts[limit - 1:])]
    else:
        parts = text.split(separator, limit - 1 if limit > 0 else -1)
    return celtypes.ListType([celtypes.StringType(p) for p in parts])


def substring(text: str, start: int, end: int | None = None) -> Any:
    if end is None:
        end = len(text)
    elif start > end:
        return celpy.CELEvalError(
            f"invalid substring range. start: {start}, end: {end}")
    for index in (start, end):
        if index < 0 or index > len(text):
            return _out_of_range(index)
    return celtypes.StringType(text[start:end])


def trim(text: str) -> Any:
    return celtypes.StringType(text.strip(_GO_SPACE))


def join(items: list[Any], separator: str = "") -> Any:
    if not all(isinstance(item, str) for item in items):
        return celpy.CELEvalError("join: the list must hold strings only")
    return celtypes.StringType(separator.join(items))


# The names rules call them by, each a receiver-style ("member") function in cel-go.
FUNCTIONS: dict[str, Callable[..., Any]] = {
    "charAt": char_at,
    "indexOf": index_of,
    "lastIndexOf": last_index_of,
    "lowerAscii": lower_ascii,
    "upperAscii": upper_ascii,
    "replace": replace,
    "split": split,
    "substring": substring,
    "trim": trim,
    "join": join,
}
