"""Which fields built-in kinds have, from the official Python client's generated models.

The real server decodes built-in kinds into Go structs: unknown fields are dropped, or
rejected under `fieldValidation=Strict` (`strict decoding error: unknown field "spec.foo"`).
The `kubernetes` package's models carry the same field lists (`attribute_map`) and types
(`openapi_types`), so they serve as the schema here.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import kubernetes.client as models

_SPECIAL_MODELS = {("", "Event"): "CoreV1Event", ("events.k8s.io", "Event"): "EventsV1Event"}
_LIST = re.compile(r"^List\[(.+)\]$")
_DICT = re.compile(r"^Dict\[str, (.+)\]$")


def model_name(group: str, kind: str) -> str | None:
    name = _SPECIAL_MODELS.get((group, kind), f"V1{kind}")
    return name if hasattr(models, name) else None


@functools.lru_cache(maxsize=512)
def _fields(name: str) -> dict[str, str] | None:
    """JSON field name -> type string, for a model class name (None: not a model)."""
    cls = getattr(models, name, None)
    if cls is None or not hasattr(cls, "attribute_map"):
        return None
    return {json_name: cls.openapi_types[attr] for attr, json_name in cls.attribute_map.items()}


def prune_unknown(group: str, kind: str, obj: dict[str, Any]) -> list[str]:
    """Drop fields the kind does not have, in place; return their paths."""
    name = model_name(group, kind)
    found: list[str] = []
    if name is not None:
        _walk(name, obj, "", found)
    return found


def _walk_type(type_name: str, value: Any, path: str, found: list[str]) -> None:
    m = _LIST.match(type_name)
    if m and isinstance(value, list):
        for i, item in enumerate(value):
            _walk_type(m.group(1), item, f"{path}[{i}]", found)
        return
    m = _DICT.match(type_name)
    if m and isinstance(value, dict):
        for key, item in value.items():
            _walk_type(m.group(1), item, f"{path}[{key}]", found)
        return
    if isinstance(value, dict) and _fields(type_name) is not None:
        _walk(type_name, value, path, found)


def _walk(name: str, value: dict[str, Any], path: str, found: list[str]) -> None:
    fields = _fields(name)
    if fields is None:
        return
    for key in list(value):
        child = f"{path}.{key}" if path else key
        if key not in fields:
            found.append(child)
            del value[key]
        else:
            _walk_type(fields[key], value[key], child, found)
