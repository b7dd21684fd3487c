"""Continuous saving (spec.checkpoint.interval.continuous): the policy objects and the
contract (the API's side: tests/api/test_continuous_interval.py)."""

from __future__ import annotations

import itertools

import pytest
from tardigrade_checkpoint.policy import AnySave, ContinuousSaving, SaveContext, SaveInterval
from tardigrade_contract import contract


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_first_save_starts_at_once_and_never_beside_one_in_flight():
    policy = ContinuousSaving(0.05, clock=Clock())
    assert policy.should_save(SaveContext(step=1, saving=False))
    assert not policy.should_save(SaveContext(step=1, saving=True))


def test_the_next_save_waits_until_the_last_ones_hold_on_the_loop_fits_the_budget():
    clock = Clock()
    policy = ContinuousSaving(0.05, clock=clock)
    policy.saved(started_at=100.0, blocked_seconds=0.2)  # 0.2 s is 5% of 4 s
    clock.now = 103.99
    assert not policy.should_save(SaveContext(step=9, saving=False))
    clock.now = 104.0
    assert policy.should_save(SaveContext(step=10, saving=False))
    assert not policy.should_save(SaveContext(step=10, saving=True))  # still committing


def test_a_save_that_held_the_loop_for_nothing_is_followed_as_soon_as_it_is_done():
    clock = Clock()
    policy = ContinuousSaving(0.05, clock=clock)
    policy.saved(started_at=100.0, blocked_seconds=0.0)
    assert not policy.should_save(SaveContext(step=2, saving=True))
    assert policy.should_save(SaveContext(step=3, saving=False))  # back to back


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_a_budget_outside_0_to_1_is_refused(fraction):
    with pytest.raises(ValueError, match="max_loop_fraction"):
        ContinuousSaving(fraction)


def test_policies_compose_and_every_one_hears_of_each_save():
    clock = Clock()
    continuous = ContinuousSaving(0.5, clock=clock)
    every_10 = SaveInterval(steps=10, clock=clock)
    policy = AnySave((every_10, continuous))
    continuous.saved(started_at=100.0, blocked_seconds=1.0)  # next at 102
    assert not policy.should_save(SaveContext(step=3, saving=False))
    assert policy.should_save(SaveContext(step=10, saving=True))  # the step interval's word
    clock.now = 102.0
    assert policy.should_save(SaveContext(step=11, saving=False))
    policy.saved(started_at=102.0, blocked_seconds=2.0)
    clock.now = 105.9
    assert not policy.should_save(SaveContext(step=12, saving=False))
    clock.now = 106.0
    assert policy.should_save(SaveContext(step=13, saving=False))


def _env(**changes: str) -> dict[str, str]:
    env = contract.TrainerEnvironment(
        job_name="j", namespace="n", attempt=0, coordinator_address="h:1", num_processes=1,
        process_id=0, checkpoint_path="/ckpt").to_env()
    return {**env, **changes}


def test_the_budget_travels_through_the_contract_and_a_bad_one_names_the_field():
    name = contract.ENV_CHECKPOINT_CONTINUOUS_MAX_LOOP_FRACTION
    assert contract.TrainerEnvironment.from_env(_env()).checkpoint_continuous_max_loop_fraction \
        is None
    parsed = contract.TrainerEnvironment.from_env(_env(**{name: "0.05"}))
    assert parsed.checkpoint_continuous_max_loop_fraction == 0.05
    assert contract.TrainerEnvironment.from_env(parsed.to_env()) == parsed
    for bad in ("0", "0.75", "nan", "inf"):
        with pytest.raises(contract.ContractError,
                           match=r"spec\.checkpoint\.interval\.continuous\.maxLoopFraction"):
            contract.TrainerEnvironment.from_env(_env(**{name: bad}))


@pytest.mark.slow
def test_the_trainer_saves_back_to_back_within_the_budget(tmp_path):
    from trainer_harness import committed_steps, launch

    fraction = 0.2
    ckpt = tmp_path / "ckpt"
    gang = launch(tmp_path, processes=2, checkpoint_path=str(ckpt),
                  config={"steps": 80, "devices_per_process": 1}, keep_last=2,
                  extra_env={contract.ENV_CHECKPOINT_CONTINUOUS_MAX_LOOP_FRACTION: str(fraction)})
    assert gang.wait() == [0, 0], gang.describe()
    for rank in (0, 1):
        records = gang.records(rank)
        started = [(i, r) for i, r in enumerate(records) if r.get("event") == "checkpoint_started"]
        committed = {r["step"]: i for i, r in enumerate(records)
                     if r.get("event") == "checkpoint_committed"}
        steps = [r["step"] for _, r in started]
        assert len(steps) >= 3 and steps == sorted(steps) and steps[-1] == 80, steps
        assert sorted(committed) == steps  # every save committed
        for (_, previous), (at, following) in itertools.pairwise(started):
            # Never two at once: each save starts once the one before it committed...
            assert committed[previous["step"]] < at, (previous, following)
            if following["step"] == 80 or rank != 0:
                continue  # the last step is saved whatever the budget; process 0's clock
            # ... and, by process 0's clock, which decides, no sooner than the save's hold on
            # the loop allows (the gang's longest hold; the log's times are taken after each
            # snapshot, hence the (1/f - 1); the log has milliseconds).
            gap = following["time"] - previous["time"]
            assert gap >= previous["blocked_s"] * (1 / fraction - 1) - 0.002, (previous,
                                                                             following)
    assert [e["step"] for e in gang.events("checkpoint_started", 1)] == [
        e["step"] for e in gang.events("checkpoint_started", 0)]  # one decision for all
    assert committed_steps(ckpt)[-1] == 80
