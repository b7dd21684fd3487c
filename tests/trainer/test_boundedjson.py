"""JSON decoded with bounded nesting (tardigrade_contract.boundedjson), held to json itself.

Property: for any JSON text, however deep (up to the API server's 10,000 levels and beyond),
`loads` never recurses past its limit, agrees with `json.loads` wherever that is within the
limit, and reports the exact depth of what it cut out.
"""

from __future__ import annotations

import json
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tardigrade_contract import boundedjson
from tardigrade_contract.boundedjson import MARKER, bound, loads, max_depth, nesting_depth

from tests.fuzz import API_SERVER_MAX_NESTING_DEPTH, CHEAP, deep_json, json_values

pytestmark = pytest.mark.fuzz

renderings = st.fixed_dictionaries({
    "indent": st.sampled_from([None, 0, 2]),
    "ensure_ascii": st.booleans(),
    "separators": st.sampled_from([None, (",", ":"), (" , ", " : ")]),
})


@CHEAP
@given(json_values(), renderings, st.integers(1, 12))
def test_within_the_limit_it_is_json_loads(value, rendering, limit):
    text = json.dumps(value, **rendering)
    depth = nesting_depth(value)
    assert max_depth(text) == depth
    decoded = loads(text, limit)
    if depth <= limit:
        assert decoded == json.loads(text)
        assert bound(text, limit) is text
    else:
        assert nesting_depth(decoded) == depth
        assert max_depth(json.dumps(decoded)) == limit + 1


@CHEAP
@given(deep_json(), st.sampled_from([1, 2, 8, boundedjson.API_OBJECT_LIMIT]),
       st.sampled_from([str, bytes]))
def test_any_depth_the_api_server_stores_decodes_within_the_limit(deep, limit, kind):
    text, depth = deep
    data = text if kind is str else text.encode()
    decoded = loads(data, limit)
    assert nesting_depth(decoded) == depth
    assert max_depth(json.dumps(decoded)) <= limit + 1


@CHEAP
@given(deep_json(min_depth=API_SERVER_MAX_NESTING_DEPTH,
                 max_depth=4 * API_SERVER_MAX_NESTING_DEPTH))
def test_beyond_the_api_servers_depth_too(deep):
    text, depth = deep
    assert nesting_depth(loads(text)) == depth


@CHEAP
@given(st.text(alphabet='[]{}",:1 \\a', max_size=400), st.integers(1, 6))
def test_malformed_text_raises_value_error_never_recursion(text, limit):
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        valid = False
    else:
        valid = True
    if valid:
        assert nesting_depth(loads(text, limit)) == nesting_depth(json.loads(text))
    else:
        with pytest.raises(ValueError):
            loads(text, limit)


def test_deeper_than_the_interpreter_allows_unclosed():
    depth = 10 * sys.getrecursionlimit()
    for text in ("[" * depth, '{"a":' * depth, "]" * 3 + "[" * depth):
        with pytest.raises(ValueError):
            loads(text)


def test_the_marker_names_the_cut_and_its_levels():
    text = '{"spec":{"trainer":{"a":[[[[1]]]],"b":2},"image":"x"}}'
    assert loads(text, 4) == {"spec": {"trainer": {"a": [{MARKER: 3}], "b": 2}, "image": "x"}}
    assert nesting_depth(loads(text, 4)) == 7
    # Brackets inside strings are text, escaped quotes included.
    quoted = json.dumps({"s": '\\"[[[[{{{{', "t": ["\\\\"]})
    assert loads(quoted, 2) == json.loads(quoted)
