"""Tardigrade operator: reconciles TrainingJobs into gangs of JAX trainer pods."""
