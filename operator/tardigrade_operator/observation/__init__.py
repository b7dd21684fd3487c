"""Observe: read what the cluster says about one job into one `Observed`, the decision's only
input. The reads that are not in kopf's indexes go through an injected reader (observe.py)."""
