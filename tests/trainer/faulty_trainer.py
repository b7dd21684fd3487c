"""Test-only entry point: the reference trainer with faults injected at named points.

    python tests/trainer/faulty_trainer.py HOOKS_JSON MARKER_DIR

Everything else is the image's entry point (`python -m tardigrade_trainer`), configured by
the operator contract's environment; see injected_faults.py for HOOKS_JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests.*

from tardigrade_trainer.__main__ import main

from tests.trainer.injected_faults import ScriptedFaults

if __name__ == "__main__":
    hooks, marker_dir = json.loads(sys.argv[1]), sys.argv[2]
    sys.exit(main([], faults=ScriptedFaults(hooks, marker_dir)))
