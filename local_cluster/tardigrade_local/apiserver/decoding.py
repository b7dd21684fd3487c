"""Request bodies as kube-apiserver reads them: media types, nesting depth, YAML aliases.

- Media types (staging/src/k8s.io/apiserver/pkg/endpoints/handlers/negotiation/negotiate.go,
  `NegotiateInputSerializerForMediaType`): a body without Content-Type is read as the first
  supported type (JSON); any other type than the serializer's is 415 `UnsupportedMediaType`,
  message from `errUnsupportedMediaType` in negotiation/errors.go. A browser can send
  `text/plain` to a loopback port without a CORS preflight; reading that as JSON would let any
  web page write objects.
- Nesting depth: the API server decodes JSON with sigs.k8s.io/json, a fork of Go's
  encoding/json whose scanner (`pushParseState`, `maxNestingDepth = 10000`) fails one level
  deeper with "exceeded max depth". Python's `json` stops near 1,000 levels, far below what a
  real server stores, so the decoder here runs with a recursion limit that covers 10,000.
- YAML (sigs.k8s.io/yaml, its goyaml.v2): the scanner refuses more than 10,000 open flow
  levels or indents ("exceeded max depth of 10000", scannerc.go `max_flow_level`,
  `max_indents`), and the decoder stops a document whose decoding is mostly alias expansion
  ("document contains excessive aliasing", decode.go `unmarshal` and `allowedAliasRatio`,
  the fix of CVE-2019-11253). PyYAML expands aliases without a bound: a 342-byte "billion
  laughs" body became an object graph that serializes to 3.2 GB of JSON here before.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import re
import sys
from collections.abc import Iterator
from typing import Any

import yaml

from .errors import ApiError, bad_request

JSON = "application/json"
YAML = "application/yaml"
PROTOBUF = "application/vnd.kubernetes.protobuf"
# What the codec factories offer, in their order: the generic one for built-in kinds, the
# unstructured one of apiextensions-apiserver for custom resources.
BUILTIN_MEDIA_TYPES = (JSON, YAML, PROTOBUF)
CUSTOM_MEDIA_TYPES = (JSON, YAML)

MAX_NESTING_DEPTH = 10_000
# Frames a nesting level costs here at most (decode, deepcopy, encode, merge), plus headroom.
_RECURSION_LIMIT = 6 * MAX_NESTING_DEPTH + 5_000

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")

_ALIAS_RATIO_LOW = 400_000
_ALIAS_RATIO_HIGH = 4_000_000


def allow_deep_objects() -> None:
    """Let this process handle objects as deep as the real server stores (see module doc)."""
    if sys.getrecursionlimit() < _RECURSION_LIMIT:
        sys.setrecursionlimit(_RECURSION_LIMIT)


def media_type(content_type: str | None) -> str:
    """The media type of a Content-Type header, without parameters; JSON when absent."""
    base = (content_type or "").split(";")[0].strip().lower()
    return base or JSON


def unsupported(accepted: tuple[str, ...]) -> ApiError:
    return ApiError(415, "UnsupportedMediaType",
                    "the body of the request was in an unknown format - accepted media types "
                    f"include: {', '.join(accepted)}")


def require_media_type(content_type: str | None, accepted: tuple[str, ...]) -> str:
    kind = media_type(content_type)
    if kind not in accepted:
        raise unsupported(accepted)
    return kind


def _too_deep(raw: bytes) -> str | None:
    """The bracket that opens level MAX_NESTING_DEPTH + 1 of a JSON text, if any."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_NESTING_DEPTH:
        return None
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    depth = 0
    for index, level in enumerate(itertools.accumulate(
            1 if b in (0x5B, 0x7B) else -1 for b in brackets)):
        depth = level
        if depth > MAX_NESTING_DEPTH:
            return chr(brackets[index])
    return None


def decode_json(raw: bytes) -> Any:
    bracket = _too_deep(raw)
    if bracket is not None:
        # Go's scanner error, as the decoder wraps it when it looks for apiVersion and kind.
        raise bad_request(f"couldn't get version/kind; json parse error: invalid character "
                          f"'{bracket}' exceeded max depth")
    with _deep():
        return json.loads(raw)


def decode_yaml(raw: bytes) -> Any:
    with _deep():
        loader = _Loader(raw.decode("utf-8"))
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            _check_aliases(node, loader.anchors_by_node)
            # As JSON, the way sigs.k8s.io/yaml hands YAML on: an alias becomes a copy, not
            # a shared object that a later edit of one place would change in both.
            return json.loads(json.dumps(loader.construct_document(node), default=_scalar))
        finally:
            loader.dispose()


class _Loader(yaml.SafeLoader):
    """SafeLoader that remembers anchor names (PyYAML forgets them once composed)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.anchors_by_node: dict[int, str] = {}

    def compose_sequence_node(self, anchor: str | None) -> yaml.Node:
        node = super().compose_sequence_node(anchor)
        if anchor:
            self.anchors_by_node[id(node)] = anchor
        return node

    def compose_mapping_node(self, anchor: str | None) -> yaml.Node:
        node = super().compose_mapping_node(anchor)
        if anchor:
            self.anchors_by_node[id(node)] = anchor
        return node


def _scalar(value: object) -> str:
    """YAML timestamps (and anything else JSON lacks) as the strings JSON would carry."""
    if isinstance(value, datetime.datetime | datetime.date):
        return value.isoformat().replace("+00:00", "Z")
    return str(value)


@contextlib.contextmanager
def _deep() -> Iterator[None]:
    allow_deep_objects()
    yield


def _allowed_alias_ratio(decode_count: int) -> float:
    if decode_count <= _ALIAS_RATIO_LOW:
        return 0.99
    if decode_count >= _ALIAS_RATIO_HIGH:
        return 0.10
    span = _ALIAS_RATIO_HIGH - _ALIAS_RATIO_LOW
    return 0.99 - 0.89 * (decode_count - _ALIAS_RATIO_LOW) / span


def _check_aliases(root: yaml.Node, anchors: dict[int, str]) -> None:
    """go-yaml's bookkeeping in `unmarshal`: every node decoded counts, and those reached
    through an alias count as alias expansion too; also its depth limit and its refusal of an
    anchor that contains itself.

    PyYAML's composer makes an alias the very node its anchor names, so a node met a second
    time in document order is an alias. The walk stops as soon as the ratio is exceeded, so a
    billion laughs costs a few thousand steps, not a billion."""
    decode_count = alias_count = 0
    seen: set[int] = set()
    on_path: set[int] = set()
    # ("enter", node, reached through an alias, depth) or ("leave", node, _, _)
    stack: list[tuple[str, yaml.Node, bool, int]] = [("enter", root, False, 0)]
    while stack:
        step, node, aliased, depth = stack.pop()
        if step == "leave":
            on_path.discard(id(node))
            continue
        if id(node) in on_path:
            raise bad_request(f"error converting YAML to JSON: yaml: anchor "
                              f"'{anchors.get(id(node), '')}' value contains itself")
        aliased = aliased or id(node) in seen
        seen.add(id(node))
        decode_count += 1
        alias_count += aliased
        if (alias_count > 100 and decode_count > 1000
                and alias_count / decode_count > _allowed_alias_ratio(decode_count)):
            raise bad_request("error converting YAML to JSON: yaml: document contains "
                              "excessive aliasing")
        if depth > MAX_NESTING_DEPTH:
            raise bad_request(f"error converting YAML to JSON: yaml: exceeded max depth of "
                              f"{MAX_NESTING_DEPTH}")
        if isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        else:
            continue
        on_path.add(id(node))
        stack.append(("leave", node, aliased, depth))
        stack.extend(("enter", child, aliased, depth + 1) for child in reversed(children))


__all__ = ["BUILTIN_MEDIA_TYPES", "CUSTOM_MEDIA_TYPES", "MAX_NESTING_DEPTH",
           "allow_deep_objects", "decode_json", "decode_yaml", "media_type",
           "require_media_type", "unsupported"]
