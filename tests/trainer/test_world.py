"""Restart in place: a kept pod's restarted trainer takes the new world from TARDIGRADE_WORLD
(the pod annotation through a fieldRef env var) over its launch-time environment."""

from __future__ import annotations

import json

import pytest
from tardigrade_contract import contract


def _launched() -> dict[str, str]:
    return contract.TrainerEnvironment(
        job_name="j", namespace="ns", attempt=1, coordinator_address="j-a1-0.j:8476",
        num_processes=4, process_id=3, checkpoint_path="gs://b/run", restore_step="40",
    ).to_env()


def test_world_overrides_size_rank_attempt_coordinator_and_restore_step():
    world = {"attempt": 2, "numProcesses": 3, "processId": 1,
             "coordinatorAddress": "j-a2-0.j:8476", "restoreStep": "60"}
    env = contract.TrainerEnvironment.from_env(
        _launched() | {contract.ENV_WORLD: json.dumps(world)})
    assert (env.attempt, env.num_processes, env.process_id, env.coordinator_address,
            env.restore_step) == (2, 3, 1, "j-a2-0.j:8476", "60")
    assert env.checkpoint_path == "gs://b/run"  # what the world does not name stays
    # Before any restart the annotation is missing, which a fieldRef renders as "".
    first = contract.TrainerEnvironment.from_env(_launched() | {contract.ENV_WORLD: ""})
    assert (first.attempt, first.num_processes, first.process_id) == (1, 4, 3)


@pytest.mark.parametrize("text, error", [
    ("{", "TARDIGRADE_WORLD is not valid JSON"),
    ("[1]", "TARDIGRADE_WORLD must be a JSON object"),
    ('{"rank": 1}', r"TARDIGRADE_WORLD: unknown keys \['rank'\]"),
    ('{"processId": true}', "TARDIGRADE_WORLD.processId must be a string or an integer"),
    # The world is checked like the launch environment: a rank outside the new size.
    ('{"numProcesses": 2}', "TARDIGRADE_PROCESS_ID=3 is outside 0..1"),
])
def test_bad_world_is_named(text, error):
    with pytest.raises(contract.ContractError, match=error):
        contract.TrainerEnvironment.from_env(_launched() | {contract.ENV_WORLD: text})
