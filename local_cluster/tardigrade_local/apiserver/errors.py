"""Errors as the real API server reports them: a `Status` object with reason and code."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FieldCause:
    """One field error, shaped like a `StatusCause` (`field`, `reason`, `message`)."""

    field: str
    reason: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message

    def as_cause(self) -> dict[str, str]:
        return {"reason": self.reason, "message": self.message, "field": self.field}


class ApiError(Exception):
    """Raised anywhere in a request; the handler turns it into a Status response."""

    def __init__(self, code: int, reason: str, message: str,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            body["details"] = self.details
        return body


def qualified(plural: str, group: str) -> str:
    """`pods`, `deployments.apps`: how the server names a resource in messages."""
    return f"{plural}.{group}" if group else plural


def _details(name: str, plural: str, group: str) -> dict[str, Any]:
    details: dict[str, Any] = {"name": name}
    if group:
        details["group"] = group
    details["kind"] = plural
    return details


def not_found(plural: str, group: str, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{qualified(plural, group)} "{name}" not found',
                    _details(name, plural, group))


def already_exists(plural: str, group: str, name: str) -> ApiError:
    return ApiError(409, "AlreadyExists", f'{qualified(plural, group)} "{name}" already exists',
                    _details(name, plural, group))


def conflict(plural: str, group: str, name: str,
             why: str = "the object has been modified; please apply your changes to the "
                        "latest version and try again") -> ApiError:
    return ApiError(409, "Conflict",
                    f'Operation cannot be fulfilled on {qualified(plural, group)} "{name}": {why}',
                    _details(name, plural, group))


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def method_not_allowed() -> ApiError:
    return ApiError(405, "MethodNotAllowed",
                    "the server does not allow this method on the requested resource")


def not_found_resource() -> ApiError:
    # What the real server says for a path that names no resource at all.
    return ApiError(404, "NotFound", "the server could not find the requested resource",
                    {})


def gone(message: str) -> ApiError:
    return ApiError(410, "Expired", message)


def invalid(kind: str, group: str, name: str, causes: list[FieldCause]) -> ApiError:
    """422 Invalid: `Kind.group "name" is invalid: field: message` (bracketed when several)."""
    qualified_kind = f"{kind}.{group}" if group else kind
    texts = [str(c) if c.field else f"<nil>: {c.message}" for c in causes]
    summary = texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"
    details: dict[str, Any] = {"name": name}
    if group:
        details["group"] = group
    details["kind"] = kind
    details["causes"] = [c.as_cause() for c in causes]
    return ApiError(422, "Invalid", f'{qualified_kind} "{name}" is invalid: {summary}', details)


def format_value(value: Any) -> str:
    """Print a bad value the way Go's field.Error does (`%v` for scalars, `%q` for strings)."""
    import json

    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e21 else repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def cause_invalid(field: str, value: Any, detail: str) -> FieldCause:
    return FieldCause(field, "FieldValueInvalid", f"Invalid value: {format_value(value)}: {detail}")


def cause_type_invalid(field: str, value: Any, detail: str) -> FieldCause:
    return FieldCause(field, "FieldValueTypeInvalid",
                      f"Invalid value: {format_value(value)}: {detail}")


def cause_required(field: str, detail: str = "") -> FieldCause:
    return FieldCause(field, "FieldValueRequired",
                      "Required value" + (f": {detail}" if detail else ""))


def cause_forbidden(field: str, detail: str) -> FieldCause:
    return FieldCause(field, "FieldValueForbidden", f"Forbidden: {detail}")


def cause_not_supported(field: str, value: Any, supported: list[Any]) -> FieldCause:
    choices = ", ".join(format_value(v) for v in supported)
    return FieldCause(field, "FieldValueNotSupported",
                      f"Unsupported value: {format_value(value)}: supported values: {choices}")


def cause_too_long(field: str, max_length: int) -> FieldCause:
    unit = "byte" if max_length == 1 else "bytes"
    return FieldCause(field, "FieldValueTooLong",
                      f"Too long: may not be more than {max_length} {unit}")


def cause_too_many(field: str, actual: int, max_items: int) -> FieldCause:
    return FieldCause(field, "FieldValueTooMany",
                      f"Too many: {actual}: must have at most {max_items} items")


def cause_duplicate(field: str, value: Any) -> FieldCause:
    return FieldCause(field, "FieldValueDuplicate", f"Duplicate value: {format_value(value)}")
