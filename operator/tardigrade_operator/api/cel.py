"""Cross-field rules written once in CEL, enforced twice: by the API server and by pydantic.

A rule lives on the model class (`cel_rules`) and is emitted into the CRD as an
`x-kubernetes-validations` entry; `CelValidated` evaluates the same expression with cel-python
when the model is built in Python, so a spec rejected by a real API server is rejected by
`tardigrade` tooling too, with the same message.

cel-python knows the CEL standard definitions only; the API server also offers cel-go's
extended strings library to every rule (see `_SERVER_FUNCTIONS`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import Any, ClassVar

import celpy
from celpy import celtypes
from pydantic import BaseModel, model_validator
from pydantic_core import PydanticCustomError


@dataclasses.dataclass(frozen=True)
class CelRule:
    rule: str
    message: str
    # Relative JSONPath-like field the rule is about (".minReplicas"): error messages name it.
    field_path: str = ""
    # A CEL expression that renders the error message from the object (its numbers, the fix);
    # `message` is the fallback where it cannot be rendered.
    message_expression: str = ""

    @property
    def transition(self) -> bool:
        """A transition rule compares with the stored object (`oldSelf`): updates only."""
        return "oldSelf" in self.rule

    def to_crd(self) -> dict[str, str]:
        entry = {"rule": self.rule, "message": self.message}
        if self.message_expression:
            entry["messageExpression"] = self.message_expression
        if self.field_path:
            entry["fieldPath"] = self.field_path
        return entry


def _split(text: str, separator: str) -> Any:
    # `<string>.split(<string>)` of cel-go's ext.Strings (Go's strings.Split); rules split on
    # a non-empty separator only.
    return celtypes.ListType([celtypes.StringType(p) for p in text.split(separator)])


# The library functions our rules use beyond the CEL standard, as the API server defines them
# (k8s.io/apiserver/pkg/cel/environment/base.go enables ext.Strings for every CEL rule).
_SERVER_FUNCTIONS = {"split": _split}


@functools.cache
def _compiled(rule: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(rule), functions=_SERVER_FUNCTIONS)


# `self` not preceded by a dot, with the field it selects if any ("self.path" -> "path").
_SELF = re.compile(r"(?<![.\w])self\b(?:\s*\.\s*([A-Za-z_]\w*)\b(?!\s*\())?")


@functools.cache
def fields_read(rule: str) -> frozenset[str] | None:
    """The fields of `self` that `rule` can read, or None where it may read any: `self` on its
    own (`size(self)`, `self['a']`) or a method or macro on it (`self.all(...)`)."""
    fields = set()
    for match in _SELF.finditer(rule):
        if match.group(1) is None:
            return None
        fields.add(match.group(1))
    return frozenset(fields)


def evaluate(rule: str, value: dict[str, Any]) -> bool:
    """Evaluate a CEL rule with `self` bound to `value` (JSON-like data)."""
    fields = fields_read(rule)
    if fields is not None:
        # The rule sees only these fields, so jobs that agree on them share one evaluation:
        # cel-python interprets in Python (milliseconds a rule), and an operator starting on
        # a thousand jobs checks each spec once.
        value = {name: value[name] for name in fields if name in value}
    return _outcome(rule, json.dumps(value, sort_keys=True))


@functools.lru_cache(maxsize=4096)
def _outcome(rule: str, value_json: str) -> bool:
    result = _compiled(rule).evaluate({"self": celpy.json_to_cel(json.loads(value_json))})
    if isinstance(result, Exception):
        # A rule that cannot evaluate (e.g. a missing field) counts as failed, as on the server.
        return False
    return bool(result)


def render_message(rule: CelRule, value: dict[str, Any]) -> str:
    """The rule's error message for `value`: its messageExpression when that renders a
    non-blank string (as the API server does), else the static message."""
    if rule.message_expression:
        rendered = _compiled(rule.message_expression).evaluate({"self": celpy.json_to_cel(value)})
        if isinstance(rendered, str) and rendered.strip():
            return str(rendered)
    return rule.message


class CelValidated(BaseModel):
    """Base for models carrying CEL rules; evaluates them after field validation."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = ()

    @model_validator(mode="after")
    def _check_cel_rules(self) -> CelValidated:
        if not self.cel_rules:
            return self
        data = self.model_dump(by_alias=True, exclude_none=True, mode="json")
        for rule in self.cel_rules:
            if rule.transition:
                continue  # needs the stored object: only the API server can check it
            if not evaluate(rule.rule, data):
                raise PydanticCustomError(
                    "cel_rule",
                    "{message}",
                    {"message": render_message(rule, data),
                     "field_path": rule.field_path.lstrip(".")},
                )
        return self
