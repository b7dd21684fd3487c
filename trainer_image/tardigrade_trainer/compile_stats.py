"""What JAX spent getting the programs ready: tracing, lowering, backend compilation (a hit in
the persistent compilation cache still pays the first two), and the cache's hits and misses.

Totals since `watch()`, from JAX's own monitoring events (jax._src.dispatch and compiler.py
record them), for the reference loop's `compiled` log line: a relaunch whose compilation phase
is long shows here whether it missed the cache or spent its time tracing.
"""

from __future__ import annotations

import threading
from typing import Any

_DURATIONS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_seconds",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_seconds",
    "/jax/core/compile/backend_compile_duration": "backend_compile_seconds",
    "/jax/compilation_cache/cache_retrieval_time_sec": "cache_retrieval_seconds",
}
_COUNTS = {
    "/jax/compilation_cache/compile_requests_use_cache": "cache_requests",
    "/jax/compilation_cache/cache_hits": "cache_hits",
}
_totals: dict[str, float] = {}
_lock = threading.Lock()
_watching = False


def _on_duration(event: str, duration_secs: float, **_: Any) -> None:
    if (name := _DURATIONS.get(event)) is not None:
        with _lock:
            _totals[name] = _totals.get(name, 0.0) + duration_secs


def _on_event(event: str, **_: Any) -> None:
    if (name := _COUNTS.get(event)) is not None:
        with _lock:
            _totals[name] = _totals.get(name, 0) + 1


def watch() -> None:
    """Start counting (once per process)."""
    global _watching
    from jax import monitoring

    with _lock:
        if _watching:
            return
        _watching = True
    monitoring.register_event_duration_secs_listener(_on_duration)
    monitoring.register_event_listener(_on_event)


def totals() -> dict[str, float]:
    """The totals so far, durations rounded to milliseconds."""
    with _lock:
        return {name: round(value, 3) if name.endswith("_seconds") else value
                for name, value in _totals.items()}
