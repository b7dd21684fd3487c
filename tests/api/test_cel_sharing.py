"""The operator checks a spec's CEL rules once per distinct input, not once per job: a rule is
evaluated on the fields of `self` it reads, so jobs that agree on them share the result."""

from __future__ import annotations

from typing import Any

import pytest
from tardigrade_operator.api import cel
from tardigrade_operator.api.parse import InvalidTrainingJob, parse_spec


def spec(name: str, **extra: Any) -> dict[str, Any]:
    return {"replicas": 2, "image": "trainer:1", "checkpoint": {"path": f"/ckpt/{name}"},
            **extra}


@pytest.mark.parametrize(("rule", "fields"), [
    ("!has(self.minReplicas) || self.minReplicas <= self.replicas",
     {"minReplicas", "replicas"}),
    ("self.accelerator.kind != 'tpu' || has(self.accelerator.topology)", {"accelerator"}),
    ("self.path.matches('^/')", {"path"}),
    ("self.items.exists(i, i.self == 1)", {"items"}),
])
def test_fields_read_by_a_rule(rule: str, fields: set[str]) -> None:
    assert cel.fields_read(rule) == fields


@pytest.mark.parametrize("rule", [
    "size(self) > 1",  # self as a whole
    "self['a'] == 1",
    "self.all(k, k != 'a')",  # a macro over self's keys, not a field named `all`
    "self.exists (k, k == 'a')",
    "has(self)",
])
def test_a_rule_that_may_read_any_field_sees_the_whole_value(rule: str) -> None:
    assert cel.fields_read(rule) is None
    # Evaluated on all of self: a projection to no field would make these wrong.
    assert cel.evaluate("self.all(k, k != 'a')", {"a": 1, "b": 2}) is False
    assert cel.evaluate("size(self) > 1", {"a": 1, "b": 2}) is True


def test_jobs_that_differ_only_elsewhere_share_the_rule_evaluations(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cel._outcome.cache_clear()
    evaluated: list[str] = []
    compiled = cel._compiled

    class Counting:
        def __init__(self, rule: str) -> None:
            self.program = compiled(rule)
            self.rule = rule

        def evaluate(self, activation: dict[str, Any]) -> Any:
            evaluated.append(self.rule)
            return self.program.evaluate(activation)

    monkeypatch.setattr(cel, "_compiled", Counting)
    parse_spec(spec("a"))
    first = len(evaluated)
    parse_spec(spec("b"))
    again = evaluated[first:]
    # Only the checkpoint's rules read the path, the one field that differs.
    assert again, "the checkpoint path rules must be evaluated for the new path"
    assert all("path" in rule for rule in again), again
    assert len(again) < first / 2
    # A shared failure still rejects, with the rule's message.
    for name in ("c", "d"):
        with pytest.raises(InvalidTrainingJob, match="minReplicas"):
            parse_spec(spec(name, minReplicas=3))
    assert not any("minReplicas" in rule for rule in evaluated[len(evaluated) - 1:])
