import os
import sys

# In-process checkpoint tests need several CPU devices; XLA reads this once, at jax import.
if "jax" not in sys.modules:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
