"""Cross-field rules written once in CEL, enforced twice: by the API server and by pydantic.

A rule lives on the model class (`cel_rules`) and is emitted into the CRD as an
`x-kubernetes-validations` entry; `CelValidated` evaluates the same expression with cel-python
when the model is built in Python, so a spec rejected by a real API server is rejected by
`tardigrade` tooling too, with the same message.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import celpy
from pydantic import BaseModel, model_validator
from pydantic_core import PydanticCustomError


@dataclasses.dataclass(frozen=True)
class CelRule:
    rule: str
    message: str
    # Relative JSONPath-like field the rule is about (".minReplicas"): error messages name it.
    field_path: str = ""

    @property
    def transition(self) -> bool:
        """A transition rule compares with the stored object (`oldSelf`): updates only."""
        return "oldSelf" in self.rule

    def to_crd(self) -> dict[str, str]:
        entry = {"rule": self.rule, "message": self.message}
        if self.field_path:
            entry["fieldPath"] = self.field_path
        return entry


@functools.cache
def _compiled(rule: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def evaluate(rule: str, value: dict[str, Any]) -> bool:
    """Evaluate a CEL rule with `self` bound to `value` (JSON-like data)."""
    result = _compiled(rule).evaluate({"self": celpy.json_to_cel(value)})
    if isinstance(result, Exception):
        # A rule that cannot evaluate (e.g. a missing field) counts as failed, as on the server.
        return False
    return bool(result)


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
                    {"message": rule.message, "field_path": rule.field_path.lstrip(".")},
                )
        return self
