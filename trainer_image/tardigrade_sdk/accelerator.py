"""The accelerator the job asked for, checked at start-up: never train on the CPU instead.

JAX picks the best backend it can initialize and falls back to the CPU with no more than a log
line when a GPU or TPU backend does not come up: a CUDA jaxlib that cannot load `libcuda.so.1`
(on GKE the device plugin mounts the driver at /usr/local/nvidia and sets no environment for
it: container-engine-accelerators `cmd/nvidia_gpu/nvidia_gpu.go`, `-container-path`, and
`pkg/gpu/nvidia/beta_plugin.go`, `Allocate`, which returns devices and mounts only), a pod
without the `nvidia.com/gpu` or `google.com/tpu` request, TPU devices the container cannot open.
Such a job would train on the host's CPUs at accelerator prices. So each rank compares JAX's
backend with `spec.accelerator.kind` (TARDIGRADE_ACCELERATOR) once `jax.distributed` is up, and
stops with the config-error exit code and a termination message that says what is missing.

Only an explicit choice overrides it: JAX_PLATFORMS set (spec.env) to platforms that leave the
job's accelerator out, e.g. `cpu` to try a GPU job's code on CPU nodes that pose as GPU ones.
The rank then runs where it was told to, with a warning. JAX_PLATFORMS that names the
accelerator (`cuda`, `cuda,cpu`, `tpu`) keeps the check: a fallback it allows is still refused.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

# spec.accelerator.kind -> the platform JAX must run on (jax.default_backend()).
PLATFORM_OF_KIND = {"nvidia-gpu": "gpu", "tpu": "tpu"}
# The JAX_PLATFORMS names of those platforms.
PLATFORM_NAMES = {"gpu": frozenset({"gpu", "cuda"}), "tpu": frozenset({"tpu"})}

_HINTS = {
    "nvidia-gpu": (
        "the pod must request nvidia.com/gpu (spec.accelerator.count), the image must carry a "
        "CUDA jaxlib (jax[cuda12]), and on GKE the driver the device plugin mounts at "
        "/usr/local/nvidia must be on the library path: LD_LIBRARY_PATH=/usr/local/nvidia/lib64 "
        "(set in Tardigrade's GPU image)"),
    "tpu": (
        "the pod must request google.com/tpu (spec.accelerator.count), the image must carry "
        "libtpu (jax[tpu]), and the container must be able to open the TPU devices "
        "(/dev/vfio/* or /dev/accel*) the device plugin hands it"),
}


class AcceleratorUnavailable(RuntimeError):
    """The job asked for an accelerator that JAX does not run on in this container."""


def check(kind: str | None, platform: str | None, why: str | None = None) -> None:
    """Raise AcceleratorUnavailable unless a job of accelerator `kind` may run on JAX
    `platform` (None: no backend came up at all, `why` says why)."""
    wanted = PLATFORM_OF_KIND.get(kind or "")
    if wanted is None or platform == wanted:
        return
    running = f"JAX runs on {platform}" if platform else "no JAX backend came up"
    detail = f" ({why.strip()})" if why else ""
    raise AcceleratorUnavailable(
        f"spec.accelerator.kind is {kind}, but {running}: the {wanted.upper()} backend is not "
        f"available{detail}. Refusing to train on the CPU instead; {_HINTS[kind or '']}")


def chosen_elsewhere(kind: str | None, environ: Mapping[str, str]) -> str | None:
    """The JAX_PLATFORMS value when it explicitly leaves out `kind`'s platform, else None."""
    wanted = PLATFORM_OF_KIND.get(kind or "")
    value = environ.get("JAX_PLATFORMS", "")
    named = {p.strip().lower() for p in value.split(",") if p.strip()}
    if wanted is None or not named or named & PLATFORM_NAMES[wanted]:
        return None
    return value


def verify(kind: str | None, backend: Callable[[], str] | None = None,
           devices: Callable[[str], object] | None = None,
           environ: Mapping[str, str] | None = None) -> None:
    """Check JAX's backend in this process against `kind`; after jax.distributed.initialize
    (the first backend call initializes them). `backend` and `devices` default to JAX's own,
    `environ` to the process's."""
    if PLATFORM_OF_KIND.get(kind or "") is None:
        return
    chosen = chosen_elsewhere(kind, os.environ if environ is None else environ)
    if chosen is not None:
        log.warning("spec.accelerator.kind is %s, but JAX_PLATFORMS=%s: running on what "
                    "JAX_PLATFORMS names, as set", kind, chosen)
        return
    import jax

    backend = backend or jax.default_backend
    devices = devices or jax.devices
    wanted = PLATFORM_OF_KIND[kind or ""]
    try:
        platform: str | None = backend()
    except Exception as err:  # JAX_PLATFORMS names a backend that cannot start (RuntimeError,
        # or an AssertionError where its plugin is not even installed)
        check(kind, None, f"{type(err).__name__}: {err}".rstrip(": "))
        return
    why = None
    if platform != wanted:
        # Asking for the platform by name raises JAX's reason it did not come up.
        try:
            devices(wanted)
        except Exception as err:
            why = f"{type(err).__name__}: {err}".rstrip(": ")
    check(kind, platform, why)
