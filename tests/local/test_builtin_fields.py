"""The API server's decoding check of built-in kinds (apiserver/builtin_fields.py) takes a
fast path without field paths first; it must refuse exactly what the message-naming walk
refuses, and name the same field."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from tardigrade_local.apiserver import builtin_fields

POD: dict[str, Any] = {
    "apiVersion": "v1", "kind": "Pod",
    "metadata": {"name": "p", "labels": {"a": "b"}, "annotations": {"x": "y"},
                 "ownerReferences": [{"apiVersion": "v1", "kind": "X", "name": "o",
                                      "uid": "u", "controller": True}]},
    "spec": {
        "terminationGracePeriodSeconds": 30,
        "nodeSelector": {"pool": "a"},
        "containers": [{
            "name": "c", "image": "i", "args": ["--x", "1"],
            "env": [{"name": "A", "value": "1"},
                    {"name": "B", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
            "ports": [{"containerPort": 8476, "protocol": "TCP"}],
            "resources": {"limits": {"cpu": "1", "memory": "1Gi"}},
            "restartPolicyRules": [{"action": "Restart", "exitCodes": {
                "operator": "In", "values": [77]}}],
        }],
        "tolerations": [{"key": "k", "operator": "Exists", "tolerationSeconds": 5}],
    },
    "status": {"phase": "Running", "startTime": "2026-01-01T00:00:00Z",
               "containerStatuses": [{"name": "c", "ready": True, "restartCount": 0,
                                      "image": "i", "imageID": "", "state": {
                                          "running": {"startedAt": "2026-01-01T00:00:00Z"}}}]},
}

# (path of keys and list indexes, a value the Go decoder refuses there)
BREAKS = [
    (("metadata", "labels", "a"), 3),
    (("metadata", "ownerReferences", 0, "controller"), "yes"),
    (("spec", "terminationGracePeriodSeconds"), 1.5),
    (("spec", "terminationGracePeriodSeconds"), True),
    (("spec", "containers", 0, "args", 1), 1),
    (("spec", "containers", 0, "env", 1, "valueFrom", "fieldRef"), "metadata.name"),
    (("spec", "containers", 0, "ports", 0, "containerPort"), "8476"),
    (("spec", "containers", 0, "restartPolicyRules", 0, "exitCodes", "values", 0), "77"),
    (("spec", "containers"), {"name": "c"}),
    (("spec", "nodeSelector"), ["pool"]),
    (("spec", "tolerations", 0, "tolerationSeconds"), "5"),
    (("status", "containerStatuses", 0, "ready"), "true"),
    (("status", "containerStatuses", 0, "state", "running"), []),
]


def _broken(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    pod = copy.deepcopy(POD)
    target = pod
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    return pod


def test_a_valid_pod_passes_both_ways():
    assert builtin_fields.type_error("", "Pod", copy.deepcopy(POD)) is None
    assert builtin_fields._type_error("V1Pod", POD, "") is None


@pytest.mark.parametrize(("path", "value"), BREAKS, ids=[".".join(map(str, p)) for p, _ in BREAKS])
def test_a_refused_value_is_refused_and_named(path: tuple[Any, ...], value: Any):
    pod = _broken(path, value)
    message = builtin_fields.type_error("", "Pod", pod)
    assert message is not None and message.startswith("json: cannot unmarshal")
    assert message == builtin_fields._type_error("V1Pod", pod, "")
    assert f".{path[0]}." in message or f".{path[0]} " in message  # where, as Go names it


def test_metadata_alone_is_checked_the_same_way():
    assert builtin_fields.metadata_type_error({"name": "x", "labels": {"a": "b"}}) is None
    message = builtin_fields.metadata_type_error({"name": "x", "generation": "1"})
    assert message is not None and "metadata.generation" in message
