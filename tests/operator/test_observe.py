"""Observation helpers that are not covered through `decide`."""

from __future__ import annotations

from tardigrade_operator.observe import newest_readiness


def test_a_deleted_node_seen_last_as_not_ready_does_not_shadow_its_replacement():
    # (resourceVersion, ready): the reclaimed VM's last state, then its replacement.
    index = [("node-a", [(120, False), (180, True)]), ("node-b", [(90, True)]),
             ("node-c", [(200, False), (150, True)])]
    assert newest_readiness(index) == {"node-a": True, "node-b": True, "node-c": False}
