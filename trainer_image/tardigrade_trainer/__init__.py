"""Tardigrade trainer: distributed start-up, sharded checkpoints and a reference JAX trainer.

Importing this package must stay cheap and jax-free: the operator imports
`tardigrade_trainer.contract` without having jax installed.
"""
