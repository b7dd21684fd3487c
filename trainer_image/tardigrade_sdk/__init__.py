"""The trainer SDK: what a user's own JAX training loop imports to run under the operator.

`session.TrainingSession` is the entry point (start the gang, restore, save on schedule and on
notice, report progress, stop with the right exit code); `distributed` joins the gang,
`preemption` watches for notices, `checkpoint_backend` / `orbax_backend` put our checkpoint
library (`tardigrade_checkpoint`) or Orbax's behind the session. It imports the contract and the
checkpoint library, never the reference trainer (tests/test_package_layering.py); importing
the package itself is cheap and jax-free.
"""
