"""Multislice: which slice and which worker each rank is, and the environment libtpu and
multislice JAX read, pure.

Ranks are numbered slice by slice (slice s holds ranks s*H .. s*H+H-1 for H hosts a slice), the
order in which multislice JAX numbers processes, so a slice's hosts are contiguous ranks.
Per host:
- `TPU_WORKER_ID` (its index inside its slice) and `TPU_WORKER_HOSTNAMES` (its slice's hosts,
  comma-separated, in worker order): what GKE injects for Indexed Jobs and libtpu reads to
  form one slice over ICI;
- with more than one slice, `MEGASCALE_COORDINATOR_ADDRESS` (host:port of slice 0's worker 0),
  `MEGASCALE_NUM_SLICES`, `MEGASCALE_SLICE_ID` and `MEGASCALE_PORT`: what libtpu reads to join
  slices over the data-center network. The port is 8081, the default of Ray's TPU support
  (`ray.util.tpu.get_tpu_coordinator_env_vars`); JobSet/xpk set the same four variables.

`TPU_WORKER_HOSTNAMES` is one environment string, and Linux refuses to exec a process with a
single `NAME=value` string longer than MAX_ARG_STRLEN (32 pages = 131072 bytes,
include/uapi/linux/binfmts.h): `hostnames_too_long` tells a job whose name would overflow it.
"""

from __future__ import annotations

import dataclasses

from tardigrade_operator import naming
from tardigrade_operator.api.types import AcceleratorSpec, TrainingJobSpec

MEGASCALE_PORT = 8081
MAX_ARG_STRLEN = 131072  # bytes of one "NAME=value" string, its terminating NUL included
HOSTNAMES_VAR = "TPU_WORKER_HOSTNAMES"
# Attempts are part of pod names; the length check allows for this many digits of them.
ATTEMPT_DIGITS = 6


@dataclasses.dataclass(frozen=True)
class SliceLayout:
    slices: int
    hosts_per_slice: int

    @property
    def hosts(self) -> int:
        return self.slices * self.hosts_per_slice

    def slice_of(self, rank: int) -> int:
        return rank // self.hosts_per_slice

    def worker_of(self, rank: int) -> int:
        return rank % self.hosts_per_slice


def hosts_per_slice(accel: AcceleratorSpec) -> int | None:
    """Hosts of one TPU slice: topology chips / chips per host; None when not a TPU slice or
    the chips do not split into whole hosts."""
    chips = accel.topology_chips()
    if accel.kind != "tpu" or chips is None or accel.count is None or chips % accel.count:
        return None
    return chips // accel.count


def layout_for(accel: AcceleratorSpec, replicas: int) -> SliceLayout | None:
    """`replicas` hosts as whole slices; None when they are not whole slices (or not TPU)."""
    per_slice = hosts_per_slice(accel)
    if per_slice is None or replicas % per_slice:
        return None
    return SliceLayout(replicas // per_slice, per_slice)


def whole_slice_hosts(accel: AcceleratorSpec, hosts: int) -> int:
    """The most hosts of whole slices among `hosts` (all of them when not a TPU slice)."""
    per_slice = hosts_per_slice(accel)
    return hosts if per_slice is None else hosts - hosts % per_slice


def _host(job: str, attempt: int, rank: int) -> str:
    # <hostname>.<subdomain> resolves through the pod's DNS search path (as for JAX's coordinator).
    return f"{naming.pod_name(job, attempt, rank)}.{naming.service_name(job)}"


def tpu_environment(job: str, attempt: int, layout: SliceLayout, rank: int) -> dict[str, str]:
    slice_id = layout.slice_of(rank)
    first = slice_id * layout.hosts_per_slice
    env = {
        "TPU_WORKER_ID": str(layout.worker_of(rank)),
        HOSTNAMES_VAR: ",".join(_host(job, attempt, r)
                                for r in range(first, first + layout.hosts_per_slice)),
    }
    if layout.slices > 1:
        env.update({
            "MEGASCALE_COORDINATOR_ADDRESS": f"{_host(job, attempt, 0)}:{MEGASCALE_PORT}",
            "MEGASCALE_NUM_SLICES": str(layout.slices),
            "MEGASCALE_SLICE_ID": str(slice_id),
            "MEGASCALE_PORT": str(MEGASCALE_PORT),
        })
    return env


def hostnames_bytes(job: str, hosts_per_slice: int, max_hosts: int) -> int:
    """The longest `TPU_WORKER_HOSTNAMES=...` string (with its NUL) any slice of a job of up to
    `max_hosts` hosts can get, with an attempt number of ATTEMPT_DIGITS digits."""
    attempt = 10 ** ATTEMPT_DIGITS - 1
    last_slice_first = (max_hosts // hosts_per_slice - 1) * hosts_per_slice
    names = [_host(job, attempt, r)
             for r in range(last_slice_first, last_slice_first + hosts_per_slice)]
    return len(HOSTNAMES_VAR) + 1 + len(",".join(names)) + 1


def hostnames_too_long(job: str, hosts_per_slice: int, max_hosts: int) -> str | None:
    """Why `job` cannot run slices of `hosts_per_slice` hosts (up to `max_hosts` in all), or
    None: its hosts' names must fit one environment string."""
    size = hostnames_bytes(job, hosts_per_slice, max_hosts)
    if size <= MAX_ARG_STRLEN:
        return None
    longest = len(job)
    while longest > 1 and hostnames_bytes("j" * longest, hosts_per_slice, max_hosts) \
            > MAX_ARG_STRLEN:
        longest -= 1
    return (f"{HOSTNAMES_VAR} for a slice of {hosts_per_slice} hosts would be {size} bytes, "
            f"above Linux's {MAX_ARG_STRLEN}-byte limit for one environment string "
            f"(MAX_ARG_STRLEN): shorten metadata.name to at most {longest} characters")


def job_name_error(job: str, spec: TrainingJobSpec) -> str | None:
    """The hostnames check for a TPU job named `job`, at its largest size (maxReplicas)."""
    per_slice = hosts_per_slice(spec.accelerator)
    if per_slice is None:
        return None
    return hostnames_too_long(job, per_slice, max(spec.replicas, spec.max_replicas or 0))
