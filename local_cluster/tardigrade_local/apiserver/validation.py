"""Checks every kind gets: names, label syntax, sizes. Kind-specific rules live elsewhere."""

from __future__ import annotations

import json
import re
from typing import Any

from .errors import ApiError, FieldCause, cause_invalid, cause_required, cause_too_long

MAX_REQUEST_BYTES = 3 * 1024 * 1024  # the real server's request body limit
MAX_OBJECT_BYTES = 1536 * 1024  # etcd's default request limit
MAX_CONFIG_DATA_BYTES = 1024 * 1024  # ConfigMap/Secret data limit
MAX_ANNOTATION_BYTES = 256 * 1024  # all annotations of one object together

_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")

SUBDOMAIN_MSG = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric "
                 "characters, '-' or '.', and must start and end with an alphanumeric character "
                 "(e.g. 'example.com', regex used for validation is "
                 "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")
LABEL_MSG = ("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or "
             "'-', and must start and end with an alphanumeric character (e.g. 'my-name',  or "
             "'123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')")
DNS1035_MSG = ("a DNS-1035 label must consist of lower case alphanumeric characters or '-', "
               "start with an alphabetic character, and end with an alphanumeric character "
               "(e.g. 'my-name',  or 'abc-123', regex used for validation is "
               "'[a-z]([-a-z0-9]*[a-z0-9])?')")

# Kinds whose names must be DNS labels rather than subdomains.
_LABEL_NAMED = {"Namespace"}
_DNS1035_NAMED = {"Service"}


# RBAC objects take any path segment (`system:discovery`): pkg/apis/rbac/validation
# `ValidateRBACName` is apimachinery's `path.IsValidPathSegmentName`.
_PATH_SEGMENT_NAMED = ("Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding")


def _path_segment_errors(name: str, field: str) -> list[FieldCause]:
    problems = [f"may not be '{name}'"] if name in (".", "..") else []
    problems += [f"may not contain '{c}'" for c in "/%" if c in name]
    return [cause_invalid(field, name, p) for p in problems]


def name_errors(kind: str, name: str, field: str = "metadata.name") -> list[FieldCause]:
    if kind in _PATH_SEGMENT_NAMED:
        return _path_segment_errors(name, field)
    if kind in _DNS1035_NAMED:
        pattern, msg, limit = _DNS1035, DNS1035_MSG, 63
    elif kind in _LABEL_NAMED:
        pattern, msg, limit = _LABEL, LABEL_MSG, 63
    else:
        pattern, msg, limit = _SUBDOMAIN, SUBDOMAIN_MSG, 253
    errors = []
    if len(name) > limit:
        errors.append(cause_invalid(field, name, f"must be no more than {limit} characters"))
    if not pattern.match(name):
        errors.append(cause_invalid(field, name, msg))
    return errors


def _qualified_name_errors(field: str, key: str) -> list[FieldCause]:
    prefix, _, name = key.rpartition("/")
    errors = []
    if prefix and not _SUBDOMAIN.match(prefix):
        errors.append(cause_invalid(field, key, "prefix part " + SUBDOMAIN_MSG))
    if not name or len(name) > 63 or not _QUALIFIED_NAME.match(name):
        errors.append(cause_invalid(
            field, key, "name part must consist of alphanumeric characters, '-', '_' or '.', "
            "and must start and end with an alphanumeric character (e.g. 'MyName',  or "
            "'my.name',  or '123-abc', regex used for validation is "
            "'([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')"))
    return errors


def metadata_errors(kind: str, meta: dict[str, Any], namespaced: bool) -> list[FieldCause]:
    errors: list[FieldCause] = []
    name = meta.get("name")
    if not name:
        errors.append(cause_required("metadata.name", "name or generateName is required"))
    else:
        errors += name_errors(kind, name)
    if namespaced and not meta.get("namespace"):
        errors.append(cause_required("metadata.namespace"))
    for key, value in (meta.get("labels") or {}).items():
        errors += _qualified_name_errors("metadata.labels", key)
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
            errors.append(cause_invalid(
                "metadata.labels", value, "a valid label must be an empty string or consist of "
                "alphanumeric characters, '-', '_' or '.', and must start and end with an "
                "alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex "
                "used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"))
    annotations = meta.get("annotations") or {}
    for key in annotations:
        errors += _qualified_name_errors("metadata.annotations", key)
    total = sum(len(k) + len(str(v)) for k, v in annotations.items())
    if total > MAX_ANNOTATION_BYTES:
        errors.append(FieldCause("metadata.annotations", "FieldValueTooLong",
                                 f"Too long: must have at most {MAX_ANNOTATION_BYTES} bytes"))
    for i, finalizer in enumerate(meta.get("finalizers") or []):
        if "/" not in finalizer and finalizer not in ("kubernetes", "orphan",
                                                      "foregroundDeletion"):
            errors.append(FieldCause(
                f"metadata.finalizers[{i}]", "FieldValueInvalid",
                f'Invalid value: "{finalizer}": name is neither a standard finalizer name nor '
                f'is it fully qualified'))
    return errors


def config_data_errors(kind: str, obj: dict[str, Any]) -> list[FieldCause]:
    if kind not in ("ConfigMap", "Secret"):
        return []
    total = sum(len(str(v)) for section in ("data", "binaryData", "stringData")
                for v in (obj.get(section) or {}).values())
    if total > MAX_CONFIG_DATA_BYTES:
        field = "[]" if kind == "ConfigMap" else "data"
        return [FieldCause(field, "FieldValueTooLong",
                           f"Too long: must have at most {MAX_CONFIG_DATA_BYTES} bytes")]
    return []


def check_object_size(obj: dict[str, Any]) -> None:
    if len(json.dumps(obj, separators=(",", ":"))) > MAX_OBJECT_BYTES:
        raise ApiError(413, "RequestEntityTooLarge", "etcdserver: request is too large")


def check_request_size(length: int) -> None:
    if length > MAX_REQUEST_BYTES:
        raise ApiError(413, "RequestEntityTooLarge",
                       f"Request entity too large: limit is {MAX_REQUEST_BYTES}")


__all__ = ["cause_too_long", "check_object_size", "check_request_size", "config_data_errors",
           "metadata_errors", "name_errors"]
