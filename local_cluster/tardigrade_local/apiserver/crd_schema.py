"""Custom resource schema enforcement, as the real API server does it.

Order of work on a write (like apiextensions-apiserver): drop nulls of non-nullable fields,
apply defaults, prune unknown fields (reporting them under fieldValidation=Strict), then
validate the OpenAPI v3 structural schema, then the CEL `x-kubernetes-validations` rules.
Messages reproduce the real server's text, e.g.
`spec.replicas: Invalid value: 0: spec.replicas in body should be greater than or equal to 1`.

Usable without the server: `validate_custom_resource` and `default_and_prune` take the CRD
as a plain dict.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from typing import Any

import celpy

from .celstrings import FUNCTIONS as STRINGS_EXT
from .errors import (
    FieldCause,
    cause_duplicate,
    cause_invalid,
    cause_not_supported,
    cause_required,
    cause_too_long,
    cause_too_many,
    cause_type_invalid,
    format_value,
)

__all__ = ["FieldCause", "default_and_prune", "schema_for", "unknown_fields",
           "validate_custom_resource"]

# ObjectMeta fields a client may send; anything else under metadata is pruned.
_OBJECT_META_FIELDS = {
    "name", "generateName", "namespace", "selfLink", "uid", "resourceVersion", "generation",
    "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "labels",
    "annotations", "ownerReferences", "finalizers", "managedFields",
}


def schema_for(crd: dict[str, Any], api_version: str | None = None) -> dict[str, Any]:
    """The openAPIV3Schema of the version named by `api_version` (else the storage version)."""
    versions = crd.get("spec", {}).get("versions") or []
    wanted = api_version.rpartition("/")[2] if api_version else None
    chosen = None
    for v in versions:
        if (wanted and v.get("name") == wanted) or (not wanted and v.get("storage")):
            chosen = v
            break
    if chosen is None and versions:
        chosen = versions[0]
    return ((chosen or {}).get("schema") or {}).get("openAPIV3Schema") or {
        "type": "object", "x-kubernetes-preserve-unknown-fields": True}


# ---- defaulting and pruning -------------------------------------------------------------
def default_and_prune(crd: dict[str, Any], obj: dict[str, Any]) -> dict[str, Any]:
    """A copy of `obj` with nulls dropped, defaults applied and unknown fields pruned."""
    out = copy.deepcopy(obj)
    schema = schema_for(crd, out.get("apiVersion"))
    _apply_defaults(schema, out)
    _prune(schema, out, "", [], root=True)
    return out


def unknown_fields(crd: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    """Paths of fields the schema does not declare (what Strict field validation rejects)."""
    found: list[str] = []
    _prune(schema_for(crd, obj.get("apiVersion")), copy.deepcopy(obj), "", found, root=True)
    return found


def _apply_defaults(schema: dict[str, Any], value: Any) -> None:
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for key in list(value):
            sub = props.get(key)
            if value[key] is None and sub is not None and not sub.get("nullable"):
                # Nulls of non-nullable fields are dropped before defaulting, like the server.
                del value[key]
        for key, sub in props.items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
        for key, item in value.items():
            sub = props.get(key)
            if sub is None and isinstance(schema.get("additionalProperties"), dict):
                sub = schema["additionalProperties"]
            if sub is not None:
                _apply_defaults(sub, item)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            _apply_defaults(schema["items"], item)


def _path(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _prune(schema: dict[str, Any], value: Any, path: str, found: list[str],
           root: bool = False) -> None:
    if isinstance(value, dict):
        if root or schema.get("x-kubernetes-embedded-resource"):
            meta = value.get("metadata")
            if isinstance(meta, dict):
                for key in [k for k in meta if k not in _OBJECT_META_FIELDS]:
                    found.append(_path(_path(path, "metadata"), key))
                    del meta[key]
        props = schema.get("properties")
        additional = schema.get("additionalProperties")
        preserve = schema.get("x-kubernetes-preserve-unknown-fields")
        embedded = root or schema.get("x-kubernetes-embedded-resource")
        for key in list(value):
            if embedded and key == "metadata":
                continue  # ObjectMeta follows its own rules (above), not the CRD schema
            sub = (props or {}).get(key)
            if sub is None and isinstance(additional, dict):
                sub = additional
            if sub is None:
                keep = (preserve or additional is True
                        or ((root or schema.get("x-kubernetes-embedded-resource"))
                            and key in ("apiVersion", "kind", "metadata")))
                if not keep:
                    found.append(_path(path, key))
                    del value[key]
                continue
            _prune(sub, value[key], _path(path, key), found)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            _prune(schema["items"], item, f"{path}[{i}]", found)


# ---- structural validation ----------------------------------------------------------------
def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        # Beyond int64 the real decoder falls back to float64.
        return "integer" if -(2**63) <= value < 2**63 else "number"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _type_ok(schema: dict[str, Any], value: Any) -> tuple[bool, str]:
    if schema.get("x-kubernetes-int-or-string"):
        return _json_type(value) in ("integer", "string"), "integer,string"
    wanted = schema.get("type")
    if not wanted:
        return True, ""
    actual = _json_type(value)
    if wanted == "number":
        return actual in ("integer", "number"), wanted
    return actual == wanted, wanted


def _validate(schema: dict[str, Any], value: Any, path: str,
              errors: list[FieldCause]) -> None:
    if value is None:
        if schema.get("nullable"):
            return
        if schema.get("type") or schema.get("x-kubernetes-int-or-string"):
            wanted = "integer,string" if schema.get("x-kubernetes-int-or-string") else (
                schema["type"])
            errors.append(cause_type_invalid(path, "null",
                                             f'{path} in body must be of type {wanted}: "null"'))
        return
    ok, wanted = _type_ok(schema, value)
    if not ok:
        actual = _json_type(value)
        errors.append(cause_type_invalid(path, actual,
                                         f'{path} in body must be of type {wanted}: "{actual}"'))
        return
    if "enum" in schema and value not in schema["enum"]:
        errors.append(cause_not_supported(path, value, schema["enum"]))
    if isinstance(value, bool):
        return
    if isinstance(value, int | float):
        _validate_number(schema, value, path, errors)
    elif isinstance(value, str):
        _validate_string(schema, value, path, errors)
    elif isinstance(value, list):
        _validate_array(schema, value, path, errors)
    elif isinstance(value, dict):
        _validate_object(schema, value, path, errors)
    for sub in schema.get("allOf") or []:
        _validate(sub, value, path, errors)


def _validate_number(schema: dict[str, Any], value: float, path: str,
                     errors: list[FieldCause]) -> None:
    if "minimum" in schema:
        low = schema["minimum"]
        if schema.get("exclusiveMinimum") and value <= low:
            errors.append(cause_invalid(path, value, f"{path} in body should be greater than "
                                        f"{format_value(low)}"))
        elif value < low:
            errors.append(cause_invalid(path, value, f"{path} in body should be greater than "
                                        f"or equal to {format_value(low)}"))
    if "maximum" in schema:
        high = schema["maximum"]
        if schema.get("exclusiveMaximum") and value >= high:
            errors.append(cause_invalid(path, value, f"{path} in body should be less than "
                                        f"{format_value(high)}"))
        elif value > high:
            errors.append(cause_invalid(path, value, f"{path} in body should be less than or "
                                        f"equal to {format_value(high)}"))
    step = schema.get("multipleOf")
    if step and (value / step) != int(value / step):
        errors.append(cause_invalid(path, value, f"{path} in body should be a multiple of "
                                    f"{format_value(step)}"))


def _validate_string(schema: dict[str, Any], value: str, path: str,
                     errors: list[FieldCause]) -> None:
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        errors.append(cause_too_long(path, schema["maxLength"]))
    if "minLength" in schema and len(value) < schema["minLength"]:
        errors.append(cause_invalid(path, value, f"{path} in body should be at least "
                                    f"{schema['minLength']} chars long"))
    pattern = schema.get("pattern")
    if pattern and not re.search(pattern, value):
        errors.append(cause_invalid(path, value, f"{path} in body should match '{pattern}'"))


def _validate_array(schema: dict[str, Any], value: list[Any], path: str,
                    errors: list[FieldCause]) -> None:
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        errors.append(cause_too_many(path, len(value), schema["maxItems"]))
    if "minItems" in schema and len(value) < schema["minItems"]:
        errors.append(cause_invalid(path, len(value), f"{path} in body should have at least "
                                    f"{schema['minItems']} items"))
    list_type = schema.get("x-kubernetes-list-type")
    if schema.get("uniqueItems") or list_type == "set":
        seen: list[Any] = []
        for i, item in enumerate(value):
            if item in seen:
                errors.append(cause_duplicate(f"{path}[{i}]", item))
            seen.append(item)
    elif list_type == "map":
        keys = schema.get("x-kubernetes-list-map-keys") or []
        seen_keys: list[tuple[Any, ...]] = []
        for i, item in enumerate(value):
            if isinstance(item, dict):
                k = tuple(item.get(name) for name in keys)
                if k in seen_keys:
                    shown = {name: item.get(name) for name in keys}
                    errors.append(cause_duplicate(f"{path}[{i}]", shown))
                seen_keys.append(k)
    items = schema.get("items")
    if isinstance(items, dict):
        for i, item in enumerate(value):
            _validate(items, item, f"{path}[{i}]", errors)


def _validate_object(schema: dict[str, Any], value: dict[str, Any], path: str,
                     errors: list[FieldCause]) -> None:
    props = schema.get("properties") or {}
    for name in schema.get("required") or []:
        if name not in value:
            errors.append(cause_required(_path(path, name)))
    if "maxProperties" in schema and len(value) > schema["maxProperties"]:
        errors.append(cause_too_many(path, len(value), schema["maxProperties"]))
    if "minProperties" in schema and len(value) < schema["minProperties"]:
        errors.append(cause_invalid(path, len(value), f"{path} in body should have at least "
                                    f"{schema['minProperties']} properties"))
    additional = schema.get("additionalProperties")
    for key, item in value.items():
        sub = props.get(key)
        if sub is not None:
            _validate(sub, item, _path(path, key), errors)
        elif isinstance(additional, dict):
            # Map entries: the real server names them `spec.labels[key]`... but reports
            # `spec.labels.key` in schema errors; follow the latter.
            _validate(additional, item, _path(path, key), errors)


# ---- CEL ------------------------------------------------------------------------------------
_CEL_ENV = celpy.Environment()


@functools.lru_cache(maxsize=512)
def _program(rule: str) -> Any:
    return _CEL_ENV.program(_CEL_ENV.compile(rule), functions=STRINGS_EXT)


# `self` not preceded by a dot, with the field it selects if any ("self.path" -> "path").
_SELF = re.compile(r"(?<![.\w])self\b(?:\s*\.\s*([A-Za-z_]\w*)\b(?!\s*\())?")


@functools.lru_cache(maxsize=1024)
def _fields_read(rule: str) -> frozenset[str] | None:
    """The fields of `self` (and `oldSelf`) that `rule` can read, or None where it may read
    any: `self` on its own (`size(self)`, `self['a']`) or a method or macro on it."""
    fields = set()
    for name in ("self", "oldSelf"):
        pattern = _SELF if name == "self" else re.compile(_SELF.pattern.replace("self", name))
        for match in pattern.finditer(rule):
            if match.group(1) is None:
                return None
            fields.add(match.group(1))
    return frozenset(fields)


def _reads(rule: str, value: Any) -> Any:
    """`value` as far as `rule` can see it: a root rule on the name reads none of the status
    that every status write changes."""
    fields = _fields_read(rule)
    if fields is None or not isinstance(value, dict):
        return value
    return {name: value[name] for name in fields if name in value}


@functools.lru_cache(maxsize=32768)
def _evaluate(text: str, self_json: str, old_json: str | None) -> tuple[bool, Any]:
    """(raised, value or exception) of `text` on these inputs. CEL is pure, so equal inputs
    give the same outcome: a status write re-checks the spec's unchanged rules (and a list's
    unchanged items) from here instead of converting and interpreting them again, which
    cel-python, an interpreter in Python, makes the API server's costliest step. Raises
    what `json_to_cel` raises for values CEL cannot hold (not cached)."""
    activation = {"self": celpy.json_to_cel(json.loads(self_json))}
    if old_json is not None:
        activation["oldSelf"] = celpy.json_to_cel(json.loads(old_json))
    try:
        return False, _program(text).evaluate(activation)
    except celpy.CELParseError:
        raise  # a broken rule: no outcome to remember
    except Exception as exc:  # celpy raises CELEvalError and friends at run time
        return True, exc


def _schema_type_name(schema: dict[str, Any]) -> str:
    if schema.get("x-kubernetes-int-or-string"):
        return "string"
    return schema.get("type", "object")


def _cel_validate(schema: dict[str, Any], value: Any, old: Any, has_old: bool, path: str,
                  errors: list[FieldCause]) -> None:
    if value is None:
        return
    for rule in schema.get("x-kubernetes-validations") or []:
        text = rule.get("rule", "")
        transition = "oldSelf" in text
        if transition and not has_old and not rule.get("optionalOldSelf"):
            continue
        self_json = json.dumps(_reads(text, value))
        old_json = json.dumps(_reads(text, old)) if transition else None
        # The root is a nil field path in the real server: it prints (and reports) "<nil>".
        field = path or "<nil>"
        if rule.get("fieldPath"):
            field = path + rule["fieldPath"] if path else rule["fieldPath"].lstrip(".")
        try:
            raised, result = _evaluate(text, self_json, old_json)
        except (ValueError, OverflowError) as exc:  # e.g. integers beyond int64
            errors.append(cause_invalid(path or "<nil>", _schema_type_name(schema),
                                        f"rule evaluation error: {exc}"))
            continue
        except celpy.CELParseError as exc:
            errors.append(cause_invalid(field, _schema_type_name(schema),
                                        f"compilation failed: {exc}"))
            continue
        if raised:
            errors.append(FieldCause(field, "FieldValueInvalid",
                                     f"Invalid value: {format_value(_schema_type_name(schema))}"
                                     f": {result}"))
            continue
        if isinstance(result, Exception):
            errors.append(FieldCause(field, "FieldValueInvalid",
                                     f"Invalid value: {format_value(_schema_type_name(schema))}"
                                     f": {result}"))
            continue
        if bool(result):
            continue
        message = rule.get("message") or f"failed rule: {text.strip()}"
        if rule.get("messageExpression"):
            try:
                expression = rule["messageExpression"]
                raised, rendered = _evaluate(
                    expression, json.dumps(_reads(expression, value)),
                    json.dumps(_reads(expression, old)) if transition else None)
                if not raised and isinstance(rendered, str) and rendered.strip():
                    message = str(rendered)
            except Exception:  # a broken messageExpression falls back to the message
                pass
        reason = rule.get("reason") or "FieldValueInvalid"
        if reason == "FieldValueRequired":
            errors.append(FieldCause(field, reason, f"Required value: {message}"))
        elif reason == "FieldValueForbidden":
            errors.append(FieldCause(field, reason, f"Forbidden: {message}"))
        elif reason == "FieldValueDuplicate":
            errors.append(FieldCause(field, reason, f"Duplicate value: {message}"))
        else:
            errors.append(FieldCause(field, "FieldValueInvalid",
                                     f"Invalid value: {format_value(_schema_type_name(schema))}"
                                     f": {message}"))
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        additional = schema.get("additionalProperties")
        old_map = old if isinstance(old, dict) else {}
        for key, item in value.items():
            sub = props.get(key)
            if sub is None and isinstance(additional, dict):
                sub = additional
            if sub is not None:
                _cel_validate(sub, item, old_map.get(key), has_old and key in old_map,
                              _path(path, key), errors)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        items = schema["items"]
        keys = schema.get("x-kubernetes-list-map-keys") or []
        old_by_key: dict[Any, Any] = {}
        if has_old and isinstance(old, list) and schema.get("x-kubernetes-list-type") == "map":
            for o in old:
                if isinstance(o, dict):
                    old_by_key[tuple(o.get(k) for k in keys)] = o
        for i, item in enumerate(value):
            ident = tuple(item.get(k) for k in keys) if isinstance(item, dict) else None
            _cel_validate(items, item, old_by_key.get(ident), ident in old_by_key,
                          f"{path}[{i}]", errors)


# ---- entry point ------------------------------------------------------------------------------
def validate_custom_resource(crd: dict[str, Any], obj: dict[str, Any], *,
                             old: dict[str, Any] | None = None,
                             strict: bool = True) -> list[FieldCause]:
    """All errors the real server would report for writing `obj` (replacing `old`).

    The object is defaulted and pruned first, as on the server. With `strict`, fields the
    schema does not declare are errors too (`unknown field "spec.foo"`), as with
    `fieldValidation=Strict`.
    """
    errors: list[FieldCause] = []
    if strict:
        errors += [FieldCause(p, "FieldValueInvalid", f'unknown field "{p}"')
                   for p in unknown_fields(crd, obj)]
    prepared = default_and_prune(crd, obj)
    prepared_old = default_and_prune(crd, old) if old is not None else None
    errors += validate_prepared(crd, prepared, prepared_old)
    return errors


def validate_prepared(crd: dict[str, Any], obj: dict[str, Any],
                      old: dict[str, Any] | None) -> list[FieldCause]:
    """Schema and CEL errors for an object that is already defaulted and pruned."""
    schema = schema_for(crd, obj.get("apiVersion"))
    errors: list[FieldCause] = []
    body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
    root = {k: v for k, v in schema.items() if k != "x-kubernetes-validations"}
    root_props = {k: v for k, v in (root.get("properties") or {}).items()
                  if k not in ("apiVersion", "kind", "metadata")}
    root["properties"] = root_props
    root["required"] = [r for r in root.get("required") or []
                        if r not in ("apiVersion", "kind", "metadata")]
    _validate(root, body, "", errors)
    if any(e.reason == "FieldValueTypeInvalid" for e in errors):
        # CEL rules assume well-typed input; the real server skips them too.
        return errors
    _cel_validate(schema, obj, old, old is not None, "", errors)
    return errors
