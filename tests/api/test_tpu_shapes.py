"""TPU shapes GKE can run: the table against its sources, and the CEL rules generated from it
against the table, over every shape the schema's pattern lets through (sampled)."""

from __future__ import annotations

import itertools
import random

import pytest
from pydantic import ValidationError
from tardigrade_operator.api import cel, tpu_shapes
from tardigrade_operator.api.types import AcceleratorSpec

# (type, topology) -> the chips per host GKE offers it with, straight from the sources
# (tpu_shapes.py names them): xpk system_characteristics.py for multi-host shapes, the Cloud
# TPU v5e/v6e pages for one-host VMs of 1, 4 and 8 chips.
KNOWN = [
    ("tpu-v5-lite-podslice", "1x1", [1]),
    ("tpu-v5-lite-podslice", "2x2", [4]),
    ("tpu-v5-lite-podslice", "2x4", [4, 8]),  # 2 hosts of ct5lp-hightpu-4t, or one -8t
    ("tpu-v5-lite-podslice", "4x4", [4]),
    ("tpu-v5-lite-podslice", "16x16", [4]),
    ("tpu-v5-lite-podslice", "3x3", []),
    ("tpu-v5-lite-podslice", "16x32", []),
    ("tpu-v5-lite-device", "2x4", [8]),  # serving: one host only
    ("tpu-v5-lite-device", "4x4", []),
    ("tpu-v6e-slice", "1x1", [1]),
    ("tpu-v6e-slice", "2x4", [4, 8]),
    ("tpu-v6e-slice", "8x16", [4]),
    ("tpu-v4-podslice", "2x2x1", [4]),
    ("tpu-v4-podslice", "8x4x4", [4]),  # v4 sides need not be ordered
    ("tpu-v4-podslice", "16x16x16", [4]),  # 64 cubes, v4's largest
    ("tpu-v4-podslice", "16x16x20", []),
    ("tpu-v5p-slice", "2x2x1", [4]),
    ("tpu-v5p-slice", "4x4x4", [4]),
    ("tpu-v5p-slice", "8x4x4", []),
    ("tpu-v5p-slice", "16x20x28", [4]),  # 140 cubes
    ("tpu-v5p-slice", "16x24x24", []),  # 144 cubes
    ("tpu-v5p-slice", "4x4x6", []),
    ("tpu-v5p-slice", "1x1x1", []),
    ("tpu7x", "1x1x1", [1]),
    ("tpu7x", "2x4x4", [4]),
    ("tpu7x", "16x24x24", [4]),  # 144 cubes
    ("tpu7x", "4x4x260", []),  # a side past 256
]


@pytest.mark.parametrize(("kind", "topology", "counts"), KNOWN,
                         ids=[f"{k}-{t}" for k, t, _ in KNOWN])
def test_the_table_holds_what_the_sources_say(kind, topology, counts):
    assert sorted(tpu_shapes.counts_for(kind, topology)) == counts


def test_every_multi_host_vm_holds_four_chips():
    # xpk compute_chips_per_vm: 1 for a one-chip slice, else 4; 8-chip VMs are one host.
    for kind in tpu_shapes.TPU_TYPES_TABLE:
        for vm in kind.vms:
            multi_host = [t for t in vm.topologies if tpu_shapes.chips(t) > vm.chips]
            assert vm.chips == 4 or (not multi_host and vm.cubes is None), vm


def _topologies(dims: int, rng: random.Random) -> list[str]:
    """Shapes the schema's pattern admits: every listed one, the edges of the cube rules and
    a seeded sample of the rest (sides 1..999)."""
    edges = [1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 28, 32, 64, 116, 252, 256, 260, 999]
    listed = {t for k in tpu_shapes.TPU_TYPES_TABLE for vm in k.vms for t in vm.topologies
              if len(tpu_shapes.sides(t)) == dims}
    if dims == 2:
        grid = {f"{a}x{b}" for a, b in itertools.product(edges, repeat=2)}
    else:
        grid = {f"{a}x{b}x{c}" for a, b, c in itertools.product(edges[:12], repeat=3)}
        grid |= {"x".join(str(rng.choice(range(4, 260, 4))) for _ in range(3))
                 for _ in range(30)}
    # Where the cube rules turn: the largest slices, unordered sides, sides past 256.
    boundary = {t for _, t, _ in KNOWN if len(tpu_shapes.sides(t)) == dims}
    return sorted(listed | boundary | set(rng.sample(sorted(grid), 40)))


CASES = [(kind.name, topology, count)
         for kind in tpu_shapes.TPU_TYPES_TABLE
         for topology in _topologies(kind.dims, random.Random(kind.name))
         for count in (1, 4, 8)]


# The two rules the table generates, as the CRD publishes them (the others check the form).
SHAPE_RULES = [rule.rule for rule in AcceleratorSpec.cel_rules
               if rule.field_path in (".topology", ".count") and len(rule.rule) > 1000]


def test_the_cel_rules_accept_exactly_the_table():
    assert len(SHAPE_RULES) == 2
    wrong = []
    for kind, topology, count in CASES:
        offered = count in tpu_shapes.counts_for(kind, topology)
        spec = {"kind": "tpu", "type": kind, "topology": topology, "count": count}
        accepted = all(cel.evaluate(rule, spec) for rule in SHAPE_RULES)
        if offered != accepted:
            wrong.append((kind, topology, count, accepted))
    assert wrong == [], wrong[:10]
    assert len(CASES) > 700


@pytest.mark.parametrize(("kind", "topology", "count", "field", "says"), [
    ("tpu-v5-lite-podslice", "3x3", 4, "topology", "use 1x1, 2x2, 2x4, 4x4"),
    ("tpu-v5-lite-podslice", "2x4", 2, "count", "set it to 4 (ct5lp-hightpu-4t, 2 hosts a "
     "slice) or 8 (ct5lp-hightpu-8t, 1 host a slice)"),
    ("tpu-v5-lite-podslice", "2x4", None, "count", "count is required"),
    ("tpu7x", "4x4x4", 1, "count", "set it to 4 (tpu7x-standard-4t, a host per 4 chips)"),
    ("tpu7x", "2x2x4", 1, "count", "set it to 4 (tpu7x-standard-4t, 4 hosts a slice)"),
    ("tpu7x", "1x1x1", 4, "count", "set it to 1 (tpu7x-standard-1t, 1 host a slice)"),
    ("tpu-v5p-slice", "8x8x4", 4, "topology", "A <= B <= C"),
])
def test_a_refusal_names_the_field_and_the_fix(kind, topology, count, field, says):
    spec = {"kind": "tpu", "type": kind, "topology": topology}
    if count is not None:
        spec["count"] = count
    with pytest.raises(ValidationError) as err:
        AcceleratorSpec.model_validate(spec)
    first = err.value.errors()[0]
    assert first["ctx"]["field_path"] == field
    assert says in first["msg"]
