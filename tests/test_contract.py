"""The operator <-> trainer contract: environment, termination message, progress report."""

from __future__ import annotations

import json

import pytest
from tardigrade_contract import contract


def _environment(**overrides):
    values = dict(
        job_name="tiny-gpt", namespace="ml", attempt=3,
        coordinator_address="tiny-gpt-a3-0.tiny-gpt:8476", num_processes=2, process_id=1,
        checkpoint_path="gs://bucket/run", restore_step="40",
        checkpoint_interval_steps=25, checkpoint_interval_seconds=60.5,
        checkpoint_keep_last=3, checkpoint_keep_every=None, save_on_preemption=False,
        progress_port=8477, trainer_config={"steps": 200, "seed": 1},
        accelerator="nvidia-gpu",
    )
    values.update(overrides)
    return contract.TrainerEnvironment(**values)


def test_environment_round_trips():
    env = _environment()
    rendered = env.to_env()
    assert all(isinstance(v, str) for v in rendered.values())
    assert contract.ENV_CHECKPOINT_KEEP_EVERY not in rendered
    assert contract.TrainerEnvironment.from_env(rendered) == env


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({contract.ENV_NUM_PROCESSES: "zero"}, "not an integer"),
        ({contract.ENV_NUM_PROCESSES: "0"}, "must be >= 1"),
        ({contract.ENV_PROCESS_ID: "2"}, "outside 0..1"),
        ({contract.ENV_RESTORE_STEP: "newest"}, "not an integer"),
        ({contract.ENV_TRAINER_CONFIG: "[1]"}, "JSON object"),
        ({contract.ENV_TRAINER_CONFIG: "{"}, "not valid JSON"),
        ({contract.ENV_CHECKPOINT_PATH: ""}, "TARDIGRADE_CHECKPOINT_PATH is not set"),
        ({contract.ENV_ACCELERATOR: "gpu"}, "expected one of cpu, nvidia-gpu, tpu"),
    ],
)
def test_malformed_environment_is_named(change, error):
    rendered = _environment().to_env() | change
    with pytest.raises(contract.ContractError, match=error):
        contract.TrainerEnvironment.from_env(rendered)


def test_termination_message_round_trips_and_fits_the_kubelet_limit():
    message = contract.TerminationMessage(
        reason="PreemptedSaved", step=41, checkpoint_step=41, checkpoint_path="gs://b/r/41",
        message="x" * 10_000,
    )
    text = message.to_json()
    assert len(text.encode()) <= contract.TERMINATION_MESSAGE_LIMIT
    parsed = contract.TerminationMessage.from_json(text)
    assert parsed is not None
    assert (parsed.reason, parsed.checkpoint_step) == ("PreemptedSaved", 41)


def test_foreign_termination_messages_are_ignored():
    assert contract.TerminationMessage.from_json("Segmentation fault") is None
    assert contract.TerminationMessage.from_json(json.dumps({"other": 1})) is None


def test_progress_report_round_trips():
    report = contract.ProgressReport(step=7, loss=2.5, checkpoint_step=5)
    assert contract.ProgressReport.from_json(report.to_json()) == report


def test_progress_report_carries_phase_seconds_and_reads_trainers_without_them():
    report = contract.ProgressReport(step=7, attempt=2, accelerator_start_seconds=4.5,
                                     restore_seconds=1.25, compile_seconds=3.0,
                                     checkpoint_stall_seconds=0.5, train_seconds=12.0)
    assert contract.ProgressReport.from_json(report.to_json()) == report
    # An older trainer's report: no phase fields, all None.
    old = contract.ProgressReport.from_json(json.dumps({"step": 7, "loss": 1.0}))
    assert all(getattr(old, name) is None for name in contract.PHASE_SECONDS_FIELDS)
    for bad in (-1, "3", True, 1e999):
        text = json.dumps({"step": 7, "compile_seconds": bad}).replace("Infinity", "1e999")
        with pytest.raises(contract.MalformedReport, match="compile_seconds"):
            contract.ProgressReport.from_json(text)


def test_contract_module_imports_without_jax():
    import subprocess
    import sys
    from pathlib import Path

    trainer_dir = Path(contract.__file__).resolve().parent.parent
    code = (
        "import sys; import tardigrade_contract.contract; "
        "assert 'jax' not in sys.modules, 'contract pulled in jax'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={"PYTHONPATH": str(trainer_dir)})


def test_shutdown_window_defaults_to_gke_spots_regular_pod_share_and_is_checked():
    rendered = _environment(shutdown_window_seconds=42.5).to_env()
    assert rendered[contract.ENV_SHUTDOWN_WINDOW_SECONDS] == "42.5"
    assert contract.TrainerEnvironment.from_env(rendered).shutdown_window_seconds == 42.5
    del rendered[contract.ENV_SHUTDOWN_WINDOW_SECONDS]  # an operator older than the variable
    assert contract.TrainerEnvironment.from_env(rendered).shutdown_window_seconds == 15
    for bad, error in (("soon", "not a number"), ("0", "must be > 0")):
        rendered[contract.ENV_SHUTDOWN_WINDOW_SECONDS] = bad
        with pytest.raises(contract.ContractError,
                           match=f"{contract.ENV_SHUTDOWN_WINDOW_SECONDS}.*{error}"):
            contract.TrainerEnvironment.from_env(rendered)
