"""The reference trainer: `python -m tardigrade_trainer`, a JAX language model trained through
the SDK (`tardigrade_sdk`) with our checkpoint library (`tardigrade_checkpoint`).

The SDK, the checkpoint library and the contract used to live in this package; their old
names still import, with a DeprecationWarning (moved.py). Importing this package must stay
cheap and jax-free.
"""

from tardigrade_trainer import moved

moved.install()
