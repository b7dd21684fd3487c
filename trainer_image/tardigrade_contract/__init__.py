"""The operator-trainer contract: what both sides of the wire must agree on.

`contract` holds the environment variables the operator renders into every trainer pod, the
exit codes and termination message a rank stops with, the progress report, and the constants
both sides time their actions by; `boundedjson` decodes what the other side wrote with bounded
nesting. The operator image installs this package and no other of the trainer's, so it imports
only the standard library (tests/test_package_layering.py).
"""
