"""Preemption notice: all hosts agree on one step at which to save, then stop.

Kubernetes sends SIGTERM to each pod of a preempted gang, possibly not all at once. In a
distributed run JAX's preemption sync manager (installed by `jax.distributed.initialize`)
catches SIGTERM on any host and makes `reached_preemption_sync_point` return True on every
host at the same step. Without it (plain single-process use) a Python handler stands in.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

from jax._src import distributed as jax_distributed
from jax.experimental import multihost_utils


class PreemptionWatcher:
    def __init__(self) -> None:
        self._local = threading.Event()
        self._calls = 0
        self._uses_jax = (
            jax_distributed.global_state.client is not None
            and jax_distributed.global_state.preemption_sync_manager is not None
        )
        if not self._uses_jax:
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self._local.set()

    def should_stop(self, step: int) -> bool:
        """Call at every step on every host; True at the one agreed step to save and stop."""
        self._calls += 1
        if self._uses_jax:
            # Count calls, not steps (every host starts at the same step and calls once per
            # step, so the counts agree). JAX's counter starts at 0: with step numbers, a
            # notice that arrives before the first call (during a restore or compilation)
            # would set a sync point of 1, which a resumed run never reaches.
            return bool(multihost_utils.reached_preemption_sync_point(self._calls))
        return self._local.is_set()
