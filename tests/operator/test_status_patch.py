"""The status write is a JSON merge patch (RFC 7386) from the status as read to the one
decided: applied to the stored status it must give exactly the decided one, fields that went
back to unset included."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from tardigrade_operator.apply.kube import merge_patch

# Statuses as status_json gives them: no nulls (exclude_none), lists replaced whole.
leaves = st.one_of(st.integers(), st.text(max_size=5), st.booleans(),
                   st.lists(st.integers(), max_size=3))
documents = st.recursive(
    st.dictionaries(st.text(max_size=3), leaves, max_size=4),
    lambda children: st.dictionaries(st.text(max_size=3), st.one_of(leaves, children),
                                     max_size=4),
    max_leaves=20)


def apply_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386, section 2, as the API server applies it."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = apply_merge_patch(result.get(key), value)
    return result


@given(documents, documents)
def test_the_patch_turns_the_stored_status_into_the_decided_one(old, new):
    assert apply_merge_patch(old, merge_patch(old, new)) == new


def test_a_field_gone_back_to_unset_is_removed():
    old = {"phase": "Running", "queue": {"admitted": True, "growingTo": 3}}
    new = {"phase": "Running", "queue": {"admitted": True}}
    assert merge_patch(old, new) == {"phase": "Running",
                                     "queue": {"admitted": True, "growingTo": None}}
