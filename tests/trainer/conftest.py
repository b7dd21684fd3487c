"""Fixtures shared by the trainer's tests."""

from __future__ import annotations

from collections.abc import Iterator

import jax
import pytest
from jax._src import compilation_cache


@pytest.fixture
def without_jax_persistent_cache() -> Iterator[None]:
    """For tests that judge where a compiled step came from. An in-process trainer session
    earlier in the same worker turns JAX's persistent cache on for its checkpoint root (the
    trainer's default): toy programs would then come from it ("jax_cache"), not be compiled
    and stored in the step cache. Off here, restored after."""
    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    # JAX decides once per process whether its cache is in use (compilation_cache.is_cache_used
    # memoizes it): without a reset, a cache an earlier test turned on stays on.
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", before)
    compilation_cache.reset_cache()
