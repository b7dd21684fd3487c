"""Label and field selectors, parsed once per request and matched per object."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .errors import ApiError, bad_request


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # =, !=, in, notin, exists, !exists
    values: tuple[str, ...] = ()

    def matches(self, labels: dict[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op == "exists":
            return present
        if self.op == "!exists":
            return not present
        if self.op in ("=", "in"):
            return present and value in self.values
        # != and notin match objects without the label too, like the real server.
        return not present or value not in self.values


_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                        r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside `in (...)` value sets."""
    parts, depth, current = [], 0, []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def _invalid_selector(text: str, why: str) -> ApiError:
    return bad_request(f'unable to parse requirement: {why}' if why else
                       f'couldn\'t parse the selector string "{text}"')


def parse_label_selector(text: str | None) -> list[Requirement]:
    if not text:
        return []
    reqs = []
    for part in _split_top_level(text):
        m = re.fullmatch(r"(\S+)\s+(in|notin)\s+\((.*)\)", part)
        if m:
            values = tuple(v.strip() for v in m.group(3).split(",") if v.strip())
            reqs.append(Requirement(m.group(1), m.group(2), values))
        elif part.startswith("!"):
            reqs.append(Requirement(part[1:].strip(), "!exists"))
        elif "!=" in part:
            k, v = part.split("!=", 1)
            reqs.append(Requirement(k.strip(), "!=", (v.strip(),)))
        elif "==" in part:
            k, v = part.split("==", 1)
            reqs.append(Requirement(k.strip(), "=", (v.strip(),)))
        elif "=" in part:
            k, v = part.split("=", 1)
            reqs.append(Requirement(k.strip(), "=", (v.strip(),)))
        else:
            reqs.append(Requirement(part, "exists"))
    for req in reqs:
        if not _LABEL_KEY.match(req.key):
            raise _invalid_selector(text, f'key: Invalid value: "{req.key}": name part must '
                                    "consist of alphanumeric characters, '-', '_' or '.', and "
                                    "must start and end with an alphanumeric character")
    return reqs


def selector_from_match(selector: dict[str, Any]) -> list[Requirement]:
    """A LabelSelector object (matchLabels + matchExpressions) as requirements."""
    reqs = [Requirement(k, "=", (v,)) for k, v in (selector.get("matchLabels") or {}).items()]
    ops = {"In": "in", "NotIn": "notin", "Exists": "exists", "DoesNotExist": "!exists"}
    for expr in selector.get("matchExpressions") or []:
        reqs.append(Requirement(expr["key"], ops[expr["operator"]],
                                tuple(expr.get("values") or ())))
    return reqs


def selector_to_string(selector: dict[str, Any]) -> str:
    """LabelSelector object -> the string form Scale.status.selector carries."""
    out = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expr in selector.get("matchExpressions") or []:
        op = expr["operator"]
        if op == "Exists":
            out.append(expr["key"])
        elif op == "DoesNotExist":
            out.append("!" + expr["key"])
        else:
            vals = ",".join(sorted(expr.get("values") or []))
            out.append(f"{expr['key']} {'in' if op == 'In' else 'notin'} ({vals})")
    return ",".join(out)


def labels_match(reqs: list[Requirement], obj: dict[str, Any]) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    return all(r.matches(labels) for r in reqs)


@dataclass(frozen=True)
class FieldRequirement:
    path: str
    op: str  # = or !=
    value: str


def parse_field_selector(text: str | None, allowed: tuple[str, ...]) -> list[FieldRequirement]:
    if not text:
        return []
    reqs = []
    for part in _split_top_level(text):
        if "!=" in part:
            k, v = part.split("!=", 1)
            op = "!="
        elif "==" in part:
            k, v = part.split("==", 1)
            op = "="
        elif "=" in part:
            k, v = part.split("=", 1)
            op = "="
        else:
            raise bad_request(f"invalid selector: '{text}'; can't understand '{part}'")
        k = k.strip()
        if k not in ("metadata.name", "metadata.namespace", *allowed):
            raise bad_request(f'field label not supported: {k}')
        reqs.append(FieldRequirement(k, op, v.strip()))
    return reqs


def _field_value(obj: dict[str, Any], path: str) -> str:
    cur: Any = obj
    for part in path.split("."):
        if not isinstance(cur, dict):
            return ""
        cur = cur.get(part)
    if cur is None:
        return ""
    if isinstance(cur, bool):
        return "true" if cur else "false"
    return str(cur)


def fields_match(reqs: list[FieldRequirement], obj: dict[str, Any]) -> bool:
    for req in reqs:
        value = _field_value(obj, req.path)
        if (value == req.value) != (req.op == "="):
            return False
    return True
