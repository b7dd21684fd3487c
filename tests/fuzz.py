"""Budgets and generators for the property-based tests of every input path (hypothesis).

CI runs the `ci` profile: a fixed number of examples per property, drawn from a fixed seed
(`derandomize`), so a run's time is bounded and a red run is reproducible. The longer run
draws fresh inputs each time, many more of them:

    TARDIGRADE_FUZZ=long scripts/test -m fuzz

(`TARDIGRADE_FUZZ_EXAMPLES=N` scales both profiles' example counts to N for the cheap
properties; the end-to-end ones take a tenth of it.) Every input a run finds failing is
added as an explicit regression test next to the property that found it.
"""

from __future__ import annotations

import json
import os
import string
from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from tardigrade_contract.boundedjson import MARKER, nesting_depth

# kube-apiserver's JSON decoder (sigs.k8s.io/json, from Go's encoding/json scanner).
API_SERVER_MAX_NESTING_DEPTH = 10_000
# k8s.io/apiserver/pkg/server/config.go: MaxRequestBodyBytes; etcd's default request limit.
API_SERVER_MAX_REQUEST_BYTES = 3 * 1024 * 1024
ETCD_MAX_OBJECT_BYTES = int(1.5 * 1024 * 1024)
INT64 = (-(2**63), 2**63 - 1)

_LONG = os.environ.get("TARDIGRADE_FUZZ", "").lower() == "long"
_EXAMPLES = int(os.environ.get("TARDIGRADE_FUZZ_EXAMPLES") or (2000 if _LONG else 150))
_SUPPRESSED = [HealthCheck.too_slow, HealthCheck.data_too_large,
               HealthCheck.function_scoped_fixture]

# In-process properties: cheap, many examples.
CHEAP = settings(max_examples=_EXAMPLES, deadline=None, derandomize=not _LONG,
                 database=None, suppress_health_check=_SUPPRESSED, print_blob=True)
# Through a running API server and operator: each example is a few requests, so a failure
# is reported as drawn, not shrunk (shrinking would replay hundreds of them).
THROUGH_THE_API = settings(max_examples=max(8, _EXAMPLES // 10), deadline=None,
                           derandomize=not _LONG, database=None,
                           phases=[Phase.explicit, Phase.reuse, Phase.generate],
                           suppress_health_check=_SUPPRESSED, print_blob=True)

# Keys a user may write; the marker's key is ours (a forged marker only makes its own
# object count as deeper).
keys = st.text(min_size=0, max_size=24).filter(lambda k: k != MARKER)
scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(*INT64),
    st.sampled_from([0, -1, INT64[0], INT64[1], 2**53, -(2**53)]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([1.7976931348623157e308, -1.7976931348623157e308, 5e-324, -0.0]),
    st.text(max_size=64),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=8),
    st.sampled_from(['"', "\\", "[", "{", "]]]", "}}}", '\\"[{', "\u2028", "\x00", "\ud7ff"]),
)


def json_values(max_leaves: int = 30) -> st.SearchStrategy[Any]:
    """Any JSON value, shallow and wide, with strings and numbers at their edges."""
    return st.recursive(
        scalars,
        lambda children: st.one_of(st.lists(children, max_size=6),
                                   st.dictionaries(keys, children, max_size=6)),
        max_leaves=max_leaves)


@st.composite
def deep_json(draw: st.DrawFn, min_depth: int = 1,
              max_depth: int = API_SERVER_MAX_NESTING_DEPTH) -> tuple[str, int]:
    """JSON text nested a drawn number of levels (a chain of objects and arrays in a drawn
    mix, with drawn keys, a drawn leaf and drawn values beside the chain), and its depth.
    Written as text: neither building nor dumping it may recurse."""
    chain = draw(st.integers(min_depth, max_depth))
    kinds = draw(st.sampled_from(["objects", "arrays", "mixed"]))
    name = draw(keys)
    key, side_key = json.dumps(name), json.dumps(name + "+side")
    side = draw(st.one_of(st.none(), json_values(4)))
    side_text, side_depth = json.dumps(side), nesting_depth(side)
    every = draw(st.integers(2, 50))
    opening, closing, depth = [], [], chain
    for level in range(chain):
        beside = side is not None and level % every == 0
        if beside:
            depth = max(depth, level + 1 + side_depth)
        if kinds == "arrays" or (kinds == "mixed" and level % 3 == 1):
            opening.append(f"[{side_text}," if beside else "[")
            closing.append("]")
        else:
            opening.append(f"{{{side_key}:{side_text},{key}:" if beside else f"{{{key}:")
            closing.append("}")
    leaf = json.dumps(draw(scalars))
    return "".join(opening) + leaf + "".join(reversed(closing)), depth


def dns_labels() -> st.SearchStrategy[str]:
    return st.text(alphabet=string.ascii_lowercase + string.digits, min_size=1,
                   max_size=20).map(lambda s: f"f{s}")
