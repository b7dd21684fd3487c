"""Decide: one observation -> one plan, as a pure function (decide.py) and the rules it is made
of. Nothing in this package does I/O (tests/operator/test_decision_is_pure.py)."""
