"""The pin, lineage, ownership and fencing rules of a checkpoint root (issue 14, points 1-3),
in process on 4 CPU devices; docs/checkpoint-format.md is the specification."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tardigrade_checkpoint import (
    CheckpointManager,
    CheckpointMissingError,
    FencedError,
    ForeignRootError,
    KeepLast,
)
from tardigrade_checkpoint.lineage import Branch, Fence, MarkerLine, admitted, on_line
from tardigrade_checkpoint.manager import COMMIT_FILE, step_dir
from tardigrade_checkpoint.rootrecord import ROOT_FILE
from tardigrade_contract import contract
from tardigrade_sdk import restore_choice

FIXTURE = Path(__file__).parent / "fixtures" / "checkpoint_format1"


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))


def _state(value: float) -> dict[str, jax.Array]:
    mesh = _mesh()
    return {"w": jax.device_put(np.full((8, 6), value, np.float32),
                                NamedSharding(mesh, PartitionSpec("data", "model")))}


def _target() -> dict[str, jax.ShapeDtypeStruct]:
    sharding = NamedSharding(_mesh(), PartitionSpec("data"))
    return {"w": jax.ShapeDtypeStruct((8, 6), np.float32, sharding=sharding)}


def _value(manager: CheckpointManager, step: int) -> float:
    restored, _ = manager.restore(step, _target())
    return float(np.asarray(restored["w"])[0, 0])


def _env(root: Path, *, name: str = "job", uid: str = "uid-1", attempt: int = 1,
         restore: str = contract.RESTORE_LATEST, **extra: object) -> contract.TrainerEnvironment:
    return contract.TrainerEnvironment(
        job_name=name, namespace="ns", attempt=attempt, coordinator_address="127.0.0.1:1",
        num_processes=1, process_id=0, checkpoint_path=str(root), restore_step=restore,
        job_uid=uid, **extra)  # type: ignore[arg-type]


def _start(root: Path, keep: int = 5, **env: object) -> tuple[CheckpointManager,
                                                              restore_choice.RestoreChoice]:
    """What a starting gang does: take the root over and choose what to restore."""
    manager = CheckpointManager(str(root), keep=KeepLast(keep))
    return manager, restore_choice.choose(_env(root, **env), manager)  # type: ignore[arg-type]


def _commit(manager: CheckpointManager, step: int, value: float | None = None) -> None:
    manager.save(step, _state(step if value is None else value))
    manager.wait()


# --- compatibility --------------------------------------------------------------------------


def test_a_checkpoint_written_by_format_1_still_restores_and_its_root_is_adopted(tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, root)
    rng = np.random.default_rng(14)
    w = rng.standard_normal((8, 6)).astype(np.float32)
    b = rng.standard_normal((6,)).astype(np.float32)
    manager, choice = _start(root)
    assert choice == restore_choice.RestoreChoice(12)
    target = {"b": jax.ShapeDtypeStruct((6,), np.float32,
                                        sharding=NamedSharding(_mesh(), PartitionSpec())),
              "count": jax.ShapeDtypeStruct((), np.int32,
                                            sharding=NamedSharding(_mesh(), PartitionSpec())),
              "w": _target()["w"]}
    restored, info = manager.restore(12, target)
    assert np.array_equal(np.asarray(restored["w"]), w)
    assert np.array_equal(np.asarray(restored["b"]), b)
    assert int(restored["count"]) == 12 and info.extra == {"data_position": 13}
    # The job that started on it owns it now, and continues its (legacy) line.
    record = json.loads((root / ROOT_FILE).read_text())
    assert record["owner"] == {"namespace": "ns", "name": "job", "uid": "uid-1"}
    manager.save(13, restored)
    manager.wait()
    assert manager.line_steps() == [12, 13]
    marker = json.loads((root / step_dir(13) / COMMIT_FILE).read_text())
    assert marker["format"] == "tardigrade-checkpoint/2"
    assert (marker["lineage"], marker["attempt"]) == ("", 1)
    manager.close()


# --- point 1: the operator's pin ------------------------------------------------------------


def test_a_pinned_step_deleted_by_the_keep_policy_resumes_from_a_newer_one(tmp_path):
    manager, _ = _start(tmp_path, keep=1)
    for step in (10, 20, 30):  # several commits between two progress polls
        _commit(manager, step)
    assert manager.list_steps()[0] == [30]
    manager.close()
    # The operator saw step 10 last: the relaunch resumes from the newest step at or after it.
    relaunched, choice = _start(tmp_path, keep=1, attempt=2, restore="10")
    assert choice == restore_choice.RestoreChoice(30)
    assert _value(relaunched, 30) == 30.0
    relaunched.close()


def test_a_pin_newer_than_anything_committed_says_why_and_how_to_go_on(tmp_path):
    manager, _ = _start(tmp_path)
    _commit(manager, 10)
    manager.close()
    shutil.rmtree(tmp_path / step_dir(10))  # committed work removed behind the trainer's back
    with pytest.raises(CheckpointMissingError, match=r"step 10 or newer.*no committed"):
        _start(tmp_path, attempt=2, restore="10")
    manager, _ = _start(tmp_path, attempt=3)
    _commit(manager, 5)
    manager.close()
    with pytest.raises(CheckpointMissingError, match=r"spec\.checkpoint\.restoreStep: 5"):
        _start(tmp_path, attempt=4, restore="10")


# --- point 2: lineage -----------------------------------------------------------------------


def test_a_rollback_starts_a_line_that_supersedes_the_abandoned_one(tmp_path):
    manager, _ = _start(tmp_path)
    for step in (10, 20, 30):
        _commit(manager, step)
    manager.close()
    rollback = {"rollback_step": 10, "rollback_request": "a2"}
    manager, choice = _start(tmp_path, attempt=2, **rollback)
    assert choice == restore_choice.RestoreChoice(10)
    assert manager.latest_committed() == 10  # the switch itself: 20 and 30 are off the line
    _commit(manager, 20, value=-20.0)  # the abandoned line's step 20 is overwritten, not kept
    assert manager.latest_committed() == 20
    assert _value(manager, 20) == -20.0
    assert 30 in manager.list_steps()[0] and manager.line_steps() == [10, 20]
    manager.close()
    # The request is applied once: the next relaunch resumes the new line.
    manager, choice = _start(tmp_path, attempt=3, restore="20", **rollback)
    assert choice == restore_choice.RestoreChoice(20)
    _commit(manager, 30, value=-30.0)
    assert manager.line_steps() == [10, 20, 30] and _value(manager, 30) == -30.0
    manager.close()


def test_another_host_judges_an_abandoned_step_on_the_marker_it_read(tmp_path):
    """In a gang, process 0 deletes an abandoned line's step (marker first) while the other
    hosts look at the same step: a host that read the marker must decide on that read, not
    read it again and find it gone (which failed the save as "not committed")."""
    manager, _ = _start(tmp_path)
    for step in (10, 20):
        _commit(manager, step)
    manager.close()
    manager, _ = _start(tmp_path, attempt=2, rollback_step=10, rollback_request="a2")
    host = CheckpointManager(str(tmp_path))  # another host of the gang, its own caches
    host.reload_root()
    seen = host.store.marker_if_any(host.store.handles, 20, None)
    assert seen is not None
    manager.store.delete_dir(step_dir(20))  # process 0 supersedes step 20
    assert host.store.marker_if_any(host.store.handles, 20, None) is None
    assert not host.on_current_line(seen)
    host.close()
    manager.close()


def test_restore_none_starts_a_line_from_nothing(tmp_path):
    manager, _ = _start(tmp_path)
    _commit(manager, 10)
    manager.close()
    manager, choice = _start(tmp_path, attempt=2, restore=contract.RESTORE_NONE)
    assert choice == restore_choice.RestoreChoice(-1)
    assert manager.latest_committed() is None
    _commit(manager, 5)
    assert manager.latest_committed() == 5 and _value(manager, 5) == 5.0
    manager.close()


def test_restoring_a_step_that_was_never_committed_is_a_clear_error(tmp_path):
    manager, _ = _start(tmp_path)
    _commit(manager, 10)
    manager.close()
    with pytest.raises(CheckpointMissingError,
                       match=r"restoreStep: 15 is not a committed checkpoint.*\[10\]"):
        _start(tmp_path, attempt=2, rollback_step=15, rollback_request="a2")


# --- point 3: ownership ---------------------------------------------------------------------


def test_a_foreign_root_is_refused_naming_both_jobs_and_the_fix(tmp_path):
    manager, _ = _start(tmp_path)
    _commit(manager, 10)
    manager.close()
    with pytest.raises(ForeignRootError) as refused:
        _start(tmp_path, name="other", uid="uid-9")
    text = str(refused.value)
    assert "ns/job (uid uid-1)" in text and "ns/other (uid uid-9)" in text
    assert "initFrom" in text
    assert manager.line_steps() == [10]


def test_initfrom_starts_from_another_jobs_root_without_writing_to_it(tmp_path):
    source_root = tmp_path / "a"
    source, _ = _start(source_root)
    _commit(source, 10)
    _commit(source, 20)
    source.close()
    before = {p: p.read_bytes() for p in source_root.rglob("*") if p.is_file()}
    manager, choice = _start(tmp_path / "b", name="other", uid="uid-9",
                             init_from_path=str(source_root))
    assert choice == restore_choice.RestoreChoice(20, restore_choice.INIT_FROM)
    assert {p: p.read_bytes() for p in source_root.rglob("*") if p.is_file()} == before
    _commit(manager, 21)
    manager.close()
    # Once it has a line of its own, it resumes from that, not from the source.
    _, choice = _start(tmp_path / "b", name="other", uid="uid-9", attempt=2,
                       init_from_path=str(source_root))
    assert choice == restore_choice.RestoreChoice(21)


def test_a_recreated_job_adopts_its_root_and_the_deleted_one_is_fenced_off(tmp_path):
    old, _ = _start(tmp_path, uid="uid-1", attempt=4)
    _commit(old, 10)
    # Deleted and re-applied: same namespace/name, new uid, attempts counted from 1 again.
    new, choice = _start(tmp_path, uid="uid-2", attempt=1)
    assert choice == restore_choice.RestoreChoice(10)
    # The deleted job's gang, still alive, can neither commit nor start again.
    old.save(20, _state(20))
    with pytest.raises(FencedError, match="took checkpoint root"):
        old.wait()
    assert not (tmp_path / step_dir(20) / COMMIT_FILE).exists()
    with pytest.raises(FencedError, match="deleted and re-created"):
        _start(tmp_path, uid="uid-1", attempt=5)
    _commit(new, 20)
    assert new.line_steps() == [10, 20]


# --- fencing by attempt ---------------------------------------------------------------------


def test_an_older_attempt_cut_off_by_a_partition_cannot_commit(tmp_path):
    stale, _ = _start(tmp_path, attempt=1)
    _commit(stale, 10)
    relaunched, choice = _start(tmp_path, attempt=2)
    assert choice == restore_choice.RestoreChoice(10)
    stale.save(20, _state(20))
    with pytest.raises(FencedError, match="attempt 2 took checkpoint root"):
        stale.wait()
    assert relaunched.latest_committed() == 10
    with pytest.raises(FencedError, match=r"attempt 2 of .* started"):
        _start(tmp_path, attempt=1)
    _commit(relaunched, 20)
    assert relaunched.line_steps() == [10, 20]


def test_a_line_is_its_branch_plus_its_ancestors_up_to_each_fork_point():
    # "" committed 10..50; "a" forked from "" at 30 and committed 40, 50; "b" from "a" at 40.
    branches = {"": Branch(), "a": Branch("", 30), "b": Branch("a", 40)}
    line = [(m, s) for m, s in [("", 10), ("", 30), ("", 40), ("a", 40), ("a", 50), ("b", 60)]
            if on_line(branches, "b", m, s)]
    assert line == [("", 10), ("", 30), ("a", 40), ("b", 60)]
    assert not on_line(branches, "b", "unknown", 1)
    # Fenced: past the base step, only the owner's current attempt (or newer) counts.
    fence = Fence("uid-2", attempt=3, base_step=40)
    assert admitted(fence, MarkerLine(40, "", "uid-1", 9))
    assert not admitted(fence, MarkerLine(50, "", "uid-2", 2))
    assert not admitted(fence, MarkerLine(50, "", "uid-1", 9))
    assert admitted(fence, MarkerLine(50, "", "uid-2", 3))
