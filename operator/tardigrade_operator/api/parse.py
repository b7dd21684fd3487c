"""Parse TrainingJob documents and explain what is wrong with bad ones, field by field."""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import BaseModel, ValidationError

from tardigrade_operator.api.types import PATTERN_HINTS, TrainingJob, TrainingJobSpec


@dataclasses.dataclass(frozen=True)
class FieldError:
    field: str  # "spec.checkpoint.path", "spec.env[0].name"
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class InvalidTrainingJob(ValueError):
    def __init__(self, errors: list[FieldError]) -> None:
        self.errors = errors
        super().__init__("invalid TrainingJob:\n" + "\n".join(f"  {e}" for e in errors))


def parse_trainingjob(document: dict[str, Any]) -> TrainingJob:
    """Validate a whole TrainingJob object (as applied with kubectl)."""
    try:
        return TrainingJob.model_validate(document)
    except ValidationError as err:
        raise InvalidTrainingJob(explain(err, TrainingJob)) from None


def parse_spec(spec: dict[str, Any]) -> TrainingJobSpec:
    """Validate just `.spec` (what the operator reads from a live object)."""
    try:
        return TrainingJobSpec.model_validate(spec)
    except ValidationError as err:
        raise InvalidTrainingJob(explain(err, TrainingJobSpec, prefix=("spec",))) from None


def explain(
    err: ValidationError, root: type[BaseModel], prefix: tuple[str | int, ...] = ()
) -> list[FieldError]:
    """Turn pydantic errors into one message per field, naming what is allowed."""
    errors: list[FieldError] = []
    for item in err.errors():
        loc = tuple(item["loc"])
        ctx = item.get("ctx") or {}
        extra_path = ctx.get("field_path")
        if extra_path:
            loc = loc + tuple(extra_path.split("."))
        if loc and loc[-1] == "[key]":
            # A bad map key: name the map; the message quotes the key.
            loc = loc[:-2]
        message = item["msg"]
        if item["type"] == "string_pattern_mismatch":
            message = PATTERN_HINTS.get(ctx.get("pattern", ""), message)
        if item["type"] == "extra_forbidden":
            allowed = _allowed_fields(root, loc[:-1])
            message = "unknown field"
            if allowed:
                message += f"; allowed fields: {', '.join(allowed)}"
        elif item["type"] == "missing":
            message = "required field is missing"
        elif "input" in item and item["type"] not in ("cel_rule", "quantity",
                                                         "qualified_name", "reserved_key",
                                                         "trainer_size", "trainer_depth"):
            message = f"{message} (got {_short(item['input'])})"
        errors.append(FieldError(_format_loc(prefix + loc), message))
    return errors


def _format_loc(loc: tuple[str | int, ...]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += ("." if text else "") + str(part)
    return text or "<root>"


def _allowed_fields(root: type[BaseModel], loc: tuple[str | int, ...]) -> list[str]:
    model: Any = root
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return []
        field = next(
            (f for name, f in model.model_fields.items() if part in (name, f.alias)), None
        )
        if field is None:
            return []
        model = _model_in(field.annotation)
    if isinstance(model, type) and issubclass(model, BaseModel):
        return sorted(f.alias or name for name, f in model.model_fields.items())
    return []


def _model_in(annotation: Any) -> Any:
    """The BaseModel inside Optional[...] / list[...] annotations, if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
