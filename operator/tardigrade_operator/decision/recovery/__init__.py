"""Recovery: how a gang that lost ranks, or must change, comes back."""
