"""CEL's extended strings library in CRD validation rules, as a real API server offers it.

The expected values are the examples of cel-go's ext/strings.go documentation.
"""

from __future__ import annotations

import pytest
from api_helpers import widget, widget_crd
from tardigrade_local.apiserver import validate_custom_resource


def rule_errors(rule: str, image: str = "registry/trainer:v1") -> list[str]:
    crd = widget_crd()
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["x-kubernetes-validations"] = [{"rule": rule, "message": "rule is false"}]
    return [str(c) for c in validate_custom_resource(crd, widget("w", image=image))]


@pytest.mark.parametrize("rule", [
    "'hello'.charAt(4) == 'o'",
    "'hello'.charAt(5) == ''",
    "'hello mellow'.indexOf('') == 0",
    "'hello mellow'.indexOf('ello') == 1",
    "'hello mellow'.indexOf('jello') == -1",
    "'hello mellow'.indexOf('', 2) == 2",
    "'hello mellow'.indexOf('ello', 2) == 7",
    "'hello mellow'.lastIndexOf('') == 12",
    "'hello mellow'.lastIndexOf('ello') == 7",
    "'hello mellow'.lastIndexOf('jello') == -1",
    "'hello mellow'.lastIndexOf('ello', 6) == 1",
    "'TacoCat'.lowerAscii() == 'tacocat'",
    "'TacoCÆt Xii'.lowerAscii() == 'tacocÆt xii'",
    "'TacoCat'.upperAscii() == 'TACOCAT'",
    "'TacoCÆt Xii'.upperAscii() == 'TACOCÆT XII'",
    "'hello hello'.replace('he', 'we') == 'wello wello'",
    "'hello hello'.replace('he', 'we', -1) == 'wello wello'",
    "'hello hello'.replace('he', 'we', 1) == 'wello hello'",
    "'hello hello'.replace('he', 'we', 0) == 'hello hello'",
    "'hello hello hello'.split(' ') == ['hello', 'hello', 'hello']",
    "'hello hello hello'.split(' ', 0) == []",
    "'hello hello hello'.split(' ', 1) == ['hello hello hello']",
    "'hello hello hello'.split(' ', 2) == ['hello', 'hello hello']",
    "'hello hello hello'.split(' ', -1) == ['hello', 'hello', 'hello']",
    # Go's strings.SplitN on an empty separator splits code points, the rest in the last part.
    "'héllo'.split('') == ['h', 'é', 'l', 'l', 'o']",
    "'héllo'.split('', 2) == ['h', 'éllo']",
    "'tacocat'.substring(4) == 'cat'",
    "'tacocat'.substring(0, 4) == 'taco'",
    "'  \\ttrim\\n    '.trim() == 'trim'",
    "'\\u00a0x\\u3000'.trim() == 'x'",
    "['hello', 'mellow'].join() == 'hellomellow'",
    "['hello', 'mellow'].join(' ') == 'hello mellow'",
    "[].join('/') == ''",
    # On the object's own fields, as rules use them.
    "self.image.split('/')[1].split(':')[0] == 'trainer'",
    "int('2x2x4'.split('x')[2]) * 2 == 8",
])
def test_documented_examples_hold(rule):
    assert rule_errors(rule) == []


def test_a_false_rule_still_fails():
    assert rule_errors("self.image.split(':')[1] == 'v2'") == [
        'spec: Invalid value: "object": rule is false']


@pytest.mark.parametrize("rule", [
    "'hello'.charAt(-1) == ''",
    "'hello mellow'.indexOf('ello', 20) == -1",
    "'hello mellow'.lastIndexOf('ello', -1) == -1",
    "'tacocat'.substring(-1) == ''",
    "'tacocat'.substring(2, 1) == ''",
])
def test_out_of_range_indices_are_evaluation_errors(rule):
    (error,) = rule_errors(rule)
    assert error.startswith('spec: Invalid value: "object": ')
    assert "index out of range" in error or "invalid substring range" in error
