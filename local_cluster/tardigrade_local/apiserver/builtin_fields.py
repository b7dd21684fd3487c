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


def _go_type(type_name: str) -> str:
    if type_name in _SCALARS:
        return _SCALARS[type_name][1]
    return "v1." + re.sub(r"^V1|^CoreV1|^EventsV1", "", type_name)


class _StructName:
    """The Go struct name of a model, computed only when an error message needs it."""

    def __init__(self, model: str) -> None:
        self.model = model

    def __str__(self) -> str:
        return re.sub(r"^V1|^CoreV1|^EventsV1", "", self.model)


# Python model type -> (JSON type name, Go type the real decoder reports)
_SCALARS = {"int": ("number", "int32"), "float": ("number", "float64"),
            "bool": ("bool", "bool"), "str": ("string", "string"),
            "datetime": ("string", "v1.Time")}


def json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def type_error(group: str, kind: str, obj: dict[str, Any]) -> str | None:
    """The first value whose JSON type the Go decoder would refuse, in its words."""
    name = model_name(group, kind)
    if not name or _valid_model(name, obj):
        return None
    return _type_error(name, obj, "")


def metadata_type_error(meta: dict[str, Any]) -> str | None:
    """Type errors in ObjectMeta, which every kind (custom ones too) shares."""
    return None if _valid_model("V1ObjectMeta", meta) else _type_error("V1ObjectMeta", meta,
                                                                          "metadata")


# Every write of a pod checks the whole object, and a recovery at a thousand ranks writes
# thousands of pods: the check runs without paths or messages first (`_valid`), and only an
# object that fails it is walked again to name the field (`_type_error`).
@functools.lru_cache(maxsize=1024)
def _shape(type_name: str) -> tuple[str, str]:
    """How a model type string is checked: scalar, list or dict (of the inner type), model,
    or anything."""
    if type_name in _SCALARS:
        return "scalar", type_name
    m = _LIST.match(type_name)
    if m:
        return "list", m.group(1)
    m = _DICT.match(type_name)
    if m:
        return "dict", m.group(1)
    return ("model", type_name) if _fields(type_name) is not None else ("any", type_name)


def _valid(type_name: str, value: Any) -> bool:
    shape, inner = _shape(type_name)
    if shape == "scalar":
        return json_kind(value) == _SCALARS[inner][0] and not (
            inner == "int" and isinstance(value, float) and not value.is_integer())
    if shape == "list":
        return isinstance(value, list) and all(item is None or _valid(inner, item)
                                               for item in value)
    if shape == "dict":
        return isinstance(value, dict) and (
            inner not in ("str", "int", "bool")
            or all(item is None or _valid(inner, item) for item in value.values()))
    if shape == "model":
        return isinstance(value, dict) and _valid_model(inner, value)
    return True


def _valid_model(name: str, value: dict[str, Any]) -> bool:
    fields = _fields(name) or {}
    for key, item in value.items():
        type_name = fields.get(key)
        if type_name is not None and item is not None and not _valid(type_name, item):
            return False
    return True


def _type_error(name: str, value: dict[str, Any], path: str) -> str | None:
    fields = _fields(name) or {}
    for key, item in value.items():
        type_name = fields.get(key)
        if type_name is None or item is None:
            continue
        child = f"{path}.{key}" if path else key
        problem = _check(name, type_name, item, child)
        if problem:
            return problem
    return None


def _check(owner: str, type_name: str, value: Any, path: str) -> str | None:
    struct = _StructName(owner)
    if type_name in _SCALARS:
        wanted, go_type = _SCALARS[type_name]
        if json_kind(value) != wanted or (type_name == "int" and isinstance(value, float)
                                           and not value.is_integer()):
            return (f"json: cannot unmarshal {json_kind(value)} into Go struct field "
                    f"{struct}.{path} of type {go_type}")
        return None
    m = _LIST.match(type_name)
    if m:
        if not isinstance(value, list):
            return (f"json: cannot unmarshal {json_kind(value)} into Go struct field "
                    f"{struct}.{path} of type []{_go_type(m.group(1))}")
        for item in value:
            problem = _check(owner, m.group(1), item, path) if item is not None else None
            if problem:
                return problem
        return None
    m = _DICT.match(type_name)
    if m:
        if not isinstance(value, dict):
            return (f"json: cannot unmarshal {json_kind(value)} into Go struct field "
                    f"{struct}.{path} of type map[string]{_go_type(m.group(1))}")
        if m.group(1) in ("str", "int", "bool"):
            for item in value.values():
                problem = _check(owner, m.group(1), item, path) if item is not None else None
                if problem:
                    return problem
        return None
    if _fields(type_name) is not None:
        if not isinstance(value, dict):
            return (f"json: cannot unmarshal {json_kind(value)} into Go struct field "
                    f"{struct}.{path} of type {_go_type(type_name)}")
        return _type_error(type_name, value, path)
    return None


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
