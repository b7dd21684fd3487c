"""The TPU slice shapes GKE can run: accelerator type, topology and chips per VM, one table.

A TPU host is one VM of a fixed machine type, and the machine type fixes its chips: a pod of a
multi-host slice must ask for exactly those chips (`google.com/tpu`), or two ranks of one slice
share a VM, or a gang counts more hosts than its slice has and never forms. Sources:

- AI-Hypercomputer/xpk `src/xpk/core/system_characteristics.py`
  (`UserFacingNameToSystemCharacteristics`, `generate_tpu_topologies`, `compute_chips_per_vm`):
  the machine types, the multi-host topologies of each type, and 4 chips on every VM of a
  multi-host slice (1 on a one-chip slice). Larger 3D slices are any AxBxC of multiples of 4 (at
  most 256) whose 4x4x4 cubes number at most `max_cubes`, sides non-decreasing for v5p and
  tpu7x.
- Cloud TPU "TPU v5e" and "TPU v6e" pages: single-host v5e/v6e VMs hold 1, 4 or 8 chips
  (ct5lp-hightpu-1t/4t/8t, ct6e-standard-1t/4t/8t), so 1x1, 2x2 and 2x4 run on one host, and
  2x4 also runs on two 4-chip hosts; "Deploy TPU Multislices in GKE" names ct5lp-hightpu-4t 2x2
  and ct4p-hightpu-4t 2x2x1 as single-host. tpu-v5-lite-device is the label of single-host v5e
  node pools only, 1x1, 2x2 and 2x4 (GKE "Plan TPUs in GKE", as SkyPilot's GKE TPU support
  quotes it: "Only Single-host v5e TPU configurations are allowed").

`AcceleratorSpec` turns this table into CEL (the API server and the models run the same rules),
so it is the only place a shape is written down.
"""

from __future__ import annotations

import dataclasses
import math

# The small 3D slices every 3D type offers besides its cube-built ones (xpk).
_SMALL_3D = ("2x2x1", "2x2x2", "2x2x4", "2x4x4")
MAX_SIDE = 256  # longest side of a cube-built slice (xpk generate_tpu_topologies)


@dataclasses.dataclass(frozen=True)
class Cubes:
    """AxBxC slices built of 4x4x4 cubes: sides multiples of 4 up to MAX_SIDE, at most
    `max_cubes` cubes, sides non-decreasing (A <= B <= C) where `ordered`."""

    max_cubes: int
    ordered: bool

    def offers(self, sides: tuple[int, ...]) -> bool:
        if len(sides) != 3 or any(s % 4 or s > MAX_SIDE for s in sides):
            return False
        if self.ordered and list(sides) != sorted(sides):
            return False
        return math.prod(s // 4 for s in sides) <= self.max_cubes

    def describe(self) -> str:
        order = ", A <= B <= C" if self.ordered else ""
        return (f"AxBxC with A, B, C multiples of 4 up to {MAX_SIDE}{order} and at most "
                f"{self.max_cubes} 4x4x4 cubes")


@dataclasses.dataclass(frozen=True)
class TpuVm:
    """One machine type of a TPU type: its chips, and the slice topologies built of it."""

    machine_type: str
    chips: int
    topologies: tuple[str, ...] = ()
    cubes: Cubes | None = None

    def offers(self, topology: str) -> bool:
        if topology in self.topologies:
            return True
        return self.cubes is not None and self.cubes.offers(sides(topology))


@dataclasses.dataclass(frozen=True)
class TpuType:
    """A value of the node label cloud.google.com/gke-tpu-accelerator."""

    name: str
    dims: int  # 2: AxB topologies; 3: AxBxC
    vms: tuple[TpuVm, ...]

    def vms_for(self, topology: str) -> list[TpuVm]:
        """The machine types a slice of `topology` runs on (several where GKE offers it on one
        host and across hosts: v5e/v6e 2x4)."""
        return [vm for vm in self.vms if vm.offers(topology)]

    def describe_topologies(self) -> str:
        listed = list(dict.fromkeys(t for vm in self.vms for t in vm.topologies))
        rules = [vm.cubes.describe() for vm in self.vms if vm.cubes is not None]
        return ", ".join(listed) + "".join(f", or {rule}" for rule in rules)


_V5E_4T = ("2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")

TPU_TYPES_TABLE: tuple[TpuType, ...] = (
    TpuType("tpu-v5-lite-podslice", 2, (
        TpuVm("ct5lp-hightpu-1t", 1, ("1x1",)),
        TpuVm("ct5lp-hightpu-4t", 4, _V5E_4T),
        TpuVm("ct5lp-hightpu-8t", 8, ("2x4",)),
    )),
    TpuType("tpu-v5-lite-device", 2, (
        TpuVm("ct5lp-hightpu-1t", 1, ("1x1",)),
        TpuVm("ct5lp-hightpu-4t", 4, ("2x2",)),
        TpuVm("ct5lp-hightpu-8t", 8, ("2x4",)),
    )),
    TpuType("tpu-v6e-slice", 2, (
        TpuVm("ct6e-standard-1t", 1, ("1x1",)),
        TpuVm("ct6e-standard-4t", 4, _V5E_4T),
        TpuVm("ct6e-standard-8t", 8, ("2x4",)),
    )),
    TpuType("tpu-v4-podslice", 3, (
        TpuVm("ct4p-hightpu-4t", 4, _SMALL_3D, Cubes(64, ordered=False)),
    )),
    TpuType("tpu-v5p-slice", 3, (
        TpuVm("ct5p-hightpu-4t", 4, _SMALL_3D, Cubes(140, ordered=True)),
    )),
    TpuType("tpu7x", 3, (
        TpuVm("tpu7x-standard-1t", 1, ("1x1x1",)),
        TpuVm("tpu7x-standard-4t", 4, _SMALL_3D, Cubes(144, ordered=True)),
    )),
)
TPU_TYPES = tuple(t.name for t in TPU_TYPES_TABLE)
_BY_NAME = {t.name: t for t in TPU_TYPES_TABLE}


def sides(topology: str) -> tuple[int, ...]:
    try:
        return tuple(int(side) for side in topology.split("x"))
    except ValueError:
        return ()


def chips(topology: str) -> int:
    return math.prod(sides(topology))


def tpu_type(name: str | None) -> TpuType | None:
    return _BY_NAME.get(name or "")


def counts_for(type_name: str, topology: str) -> list[int]:
    """The chip counts a host of a `type_name` slice of `topology` can have (empty: GKE has no
    such slice)."""
    kind = tpu_type(type_name)
    return [] if kind is None else [vm.chips for vm in kind.vms_for(topology)]


# ------------------------------------------------------------------------------------ CEL ---
# The same table as CEL over an AcceleratorSpec (`a`: the expression of the spec, "self" in
# its own rules). Topologies reach these rules only through the schema's
# pattern (digits and x), so int() of a side cannot fail; split is the API server's
# extended strings library (see api/cel.py).


def _quote(items: tuple[str, ...] | list[str]) -> str:
    return "[" + ", ".join(f"'{item}'" for item in items) + "]"


def _side(a: str, i: int) -> str:
    return f"int({a}.topology.split('x')[{i}])"


def _cel_cubes(a: str, cubes: Cubes) -> str:
    s = [_side(a, i) for i in range(3)]
    terms = [f"size({a}.topology.split('x')) == 3"]
    terms += [f"{side} % 4 == 0 && {side} <= {MAX_SIDE}" for side in s]
    terms.append(f"({s[0]} / 4) * ({s[1]} / 4) * ({s[2]} / 4) <= {cubes.max_cubes}")
    if cubes.ordered:
        terms.append(f"{s[0]} <= {s[1]} && {s[1]} <= {s[2]}")
    return "(" + " && ".join(terms) + ")"


def cel_vm_offers(a: str, vm: TpuVm) -> str:
    parts = []
    if vm.topologies:
        parts.append(f"{a}.topology in {_quote(vm.topologies)}")
    if vm.cubes is not None:
        parts.append(_cel_cubes(a, vm.cubes))
    return "(" + " || ".join(parts) + ")"


def cel_type_offers(a: str, kind: TpuType) -> str:
    return "(" + " || ".join(cel_vm_offers(a, vm) for vm in kind.vms) + ")"


def cel_dims_match(a: str, kind: TpuType) -> str:
    return f"size({a}.topology.split('x')) == {kind.dims}"


def cel_topology_rule(a: str) -> str:
    """Every TPU type/topology pair is a slice GKE offers (a wrong number of sides is left to
    the 2D/3D rule, which says so more plainly)."""
    per_type = [f"({a}.type != '{k.name}' || !({cel_dims_match(a, k)}) || "
                f"{cel_type_offers(a, k)})" for k in TPU_TYPES_TABLE]
    return (f"{a}.kind != 'tpu' || !has({a}.type) || !has({a}.topology) || "
            + " && ".join(per_type))


def _offer_groups(kind: TpuType) -> list[tuple[str, list[TpuVm]]]:
    """(CEL condition on the topology, the VMs offering it): the listed topologies grouped by
    the VMs that offer them, the group of a VM that also builds slices of cubes last."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for topology in dict.fromkeys(t for vm in kind.vms for t in vm.topologies):
        offering = tuple(vm.machine_type for vm in kind.vms_for(topology))
        groups.setdefault(offering, []).append(topology)
    by_machine = {vm.machine_type: vm for vm in kind.vms}
    out = [("{a}.topology in " + _quote(topologies), [by_machine[m] for m in offering])
           for offering, topologies in groups.items()]
    return sorted(out, key=lambda group: any(vm.cubes is not None for vm in group[1]))


def cel_count_rule(a: str) -> str:
    """accelerator.count is the chips of a VM the slice runs on (set, for TPUs). Shapes GKE
    does not offer pass here: the topology rule reports them."""
    per_type = []
    for k in TPU_TYPES_TABLE:
        chain = "true"
        for condition, vms in reversed(_offer_groups(k)):
            test = condition.format(a=a)
            cubes = [vm.cubes for vm in vms if vm.cubes is not None]
            if cubes:
                test = f"({test} || {_cel_cubes(a, cubes[0])})"
            counts = sorted({vm.chips for vm in vms})
            chain = f"({test} ? has({a}.count) && {a}.count in {counts} : {chain})"
        per_type.append(f"({a}.type != '{k.name}' || !({cel_dims_match(a, k)}) || {chain})")
    return (f"{a}.kind != 'tpu' || !has({a}.type) || !has({a}.topology) || "
            + " && ".join(per_type))


def _choice(vm: TpuVm, topology: str | None) -> str:
    """One count, in words: "4 (ct5lp-hightpu-4t, 2 hosts a slice)"; `topology` None: a slice
    built of cubes, whose hosts are its chips / 4."""
    if topology is None:
        return f"{vm.chips} ({vm.machine_type}, a host per {vm.chips} chips)"
    hosts = chips(topology) // vm.chips
    return f"{vm.chips} ({vm.machine_type}, {hosts} host{'s' if hosts > 1 else ''} a slice)"


def count_choices(kind: TpuType, topology: str) -> str:
    """The counts a `kind` slice of `topology` allows, in words (empty: none)."""
    return " or ".join(_choice(vm, topology if topology in vm.topologies else None)
                       for vm in kind.vms_for(topology))


def cel_count_choices(a: str) -> str:
    """CEL that renders the counts the spec's shape allows, e.g. "4 (ct5lp-hightpu-4t, 2
    hosts a slice) or 8 (ct5lp-hightpu-8t, 1 host a slice)": one static text per listed
    topology, and the cube-built VM's for the rest. Only for message expressions of rules that
    fail for shapes GKE offers. No string(int): kube-apiserver's cost estimator cannot bound
    it, and refuses a CRD whose message expression uses it."""
    expr = "''"
    for k in reversed(TPU_TYPES_TABLE):
        cubes = [vm for vm in k.vms if vm.cubes is not None]
        inner = f"'{_choice(cubes[0], None)}'" if cubes else "''"
        for topology in reversed(list(dict.fromkeys(t for vm in k.vms
                                                    for t in vm.topologies))):
            inner = (f"({a}.topology == '{topology}' ? '{count_choices(k, topology)}' : "
                     f"{inner})")
        expr = f"({a}.type == '{k.name}' ? {inner} : {expr})"
    return expr


def cel_topology_choices(a: str) -> str:
    """CEL that renders the topologies of the spec's TPU type, in words."""
    expr = "''"
    for k in reversed(TPU_TYPES_TABLE):
        expr = f"({a}.type == '{k.name}' ? '{k.describe_topologies()}' : {expr})"
    return expr
