"""`TrainingSession`: the loops of docs/trainer.md, run as written, through a preemption (SIGTERM
to one rank of two), a resize (resumed on one rank) and a restore of the step the operator
chose; for our checkpoint format and for Orbax's."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tardigrade_contract import contract

from tests.trainer.trainer_harness import REPO, SOURCE_PATHS, launch, wait_for

DOC = REPO / "docs" / "trainer.md"
LOOPS = {"tardigrade": "own-loop", "orbax": "orbax-loop"}


def doc_example(name: str) -> str:
    """The code block under `<!-- example: NAME -->` in docs/trainer.md, verbatim."""
    found = re.search(rf"<!-- example: {re.escape(name)} -->\n```python\n(.*?)\n```\n",
                      DOC.read_text(), re.DOTALL)
    assert found is not None, f"docs/trainer.md has no example {name!r}"
    return found.group(1) + "\n"


def _losses(gang, rank: int = 0) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in gang.events("step", rank)}


def _run(workdir: Path, loop: Path, checkpoints: Path, steps: int, processes: int = 1,
         restore: str = contract.RESTORE_LATEST):
    gang = launch(workdir, processes=processes, checkpoint_path=str(checkpoints),
                  config={"steps": steps}, restore_step=restore, interval_steps=7, keep_last=10,
                  argv=[sys.executable, str(loop)])
    return gang, gang.wait()


@pytest.mark.parametrize("backend", sorted(LOOPS))
def test_the_documented_loop_survives_preemption_and_resize_with_no_step_lost(tmp_path, backend):
    loop = tmp_path / "loop.py"
    loop.write_text(doc_example(LOOPS[backend]))
    checkpoints = tmp_path / "checkpoints"

    # Two ranks; SIGTERM reaches one of them only, as when one node is reclaimed.
    first = launch(tmp_path / "first", processes=2, checkpoint_path=str(checkpoints),
                   config={"steps": 1_000_000}, interval_steps=7, keep_last=10,
                   argv=[sys.executable, str(loop)])
    wait_for(lambda: len(first.events("step")) >= 10 or first.procs[0].poll() is not None,
             180, "the loop to train 10 steps")
    first.signal(signal.SIGTERM, ranks=[1])
    assert first.wait() == [contract.EXIT_PREEMPTED_SAVED] * 2, first.describe()
    notes = [first.termination(rank) for rank in (0, 1)]
    stopped, saved = notes[0].step, notes[0].checkpoint_step
    assert all(n is not None and n.reason == "PreemptedSaved" for n in notes), notes
    assert [(n.step, n.checkpoint_step) for n in notes] == [(stopped, saved)] * 2
    # The agreed step, or the interval save in flight when the gang reached it: committed,
    # with no second save behind it (docs/trainer.md, "A notice at any moment").
    assert saved == stopped or (saved % 7 == 0 and stopped - 7 < saved < stopped), notes
    assert max(_losses(first)) == stopped
    # In the backend's own format: Orbax's step directories, or ours with its commit marker.
    marker = (checkpoints / str(saved) if backend == "orbax"
              else checkpoints / f"step_{saved:08d}" / "metadata.json")
    assert marker.exists(), sorted(p.name for p in checkpoints.iterdir())

    # Resized to one rank: it restores the agreed step and trains on from the next one.
    total = saved + 10
    resumed, codes = _run(tmp_path / "resumed", loop, checkpoints, total)
    assert codes == [contract.EXIT_SUCCEEDED], resumed.describe()
    assert [e["step"] for e in resumed.events("checkpoint_restored")] == [saved]
    assert min(_losses(resumed)) == saved + 1
    assert resumed.termination(0).reason == "Succeeded"
    assert resumed.termination(0).checkpoint_step == total

    # The operator's pin is a floor (the newest checkpoint it saw committed): pinned at the
    # preemption save, older than the final one, the rank restores the newest committed step
    # at or after it, never an older one.
    pinned, codes = _run(tmp_path / "pinned", loop, checkpoints, total + 2, restore=str(saved))
    assert codes == [contract.EXIT_SUCCEEDED], pinned.describe()
    assert [e["step"] for e in pinned.events("checkpoint_restored")] == [total]
    assert min(_losses(pinned)) == total + 1

    # Against one uninterrupted run: the same loss at every step, none missing, none twice.
    reference, codes = _run(tmp_path / "reference", loop, tmp_path / "reference-ckpt", total)
    assert codes == [contract.EXIT_SUCCEEDED], reference.describe()
    expected = _losses(reference)
    stitched = {**_losses(first), **_losses(resumed)}
    assert sorted(stitched) == list(range(1, total + 1))
    for step, loss in expected.items():
        assert abs(stitched[step] - loss) <= 1e-6 * max(1.0, abs(loss)), (step, stitched[step],
                                                                          loss)
    reference_on, codes = _run(tmp_path / "reference", loop, tmp_path / "reference-ckpt",
                               total + 2)
    assert codes == [contract.EXIT_SUCCEEDED], reference_on.describe()
    for step, loss in _losses(pinned).items():
        wanted = _losses(reference_on)[step]
        assert abs(loss - wanted) <= 1e-6 * max(1.0, abs(loss)), (step, loss)


def test_a_pin_above_every_committed_step_exits_as_missing_naming_the_floor(tmp_path):
    # The operator's pin is a floor (restore_choice): nothing at or after it -> missing.
    loop = tmp_path / "loop.py"
    loop.write_text(doc_example(LOOPS["tardigrade"]))
    gang, codes = _run(tmp_path / "run", loop, tmp_path / "empty", 5, restore="3")
    assert codes == [contract.EXIT_CHECKPOINT_CORRUPT], gang.describe()
    note = gang.termination(0)
    assert note is not None and note.reason == "CheckpointMissing"
    assert "must restore step 3 or newer" in note.message


def test_the_orbax_backend_imports_without_orbax_and_says_what_to_install(tmp_path):
    # `None` in sys.modules makes `import orbax...` fail as if it were not installed.
    probe = (
        "import sys\n"
        "sys.modules['orbax'] = sys.modules['orbax.checkpoint'] = None\n"
        "from tardigrade_sdk import orbax_backend, session\n"
        "from tardigrade_contract.contract import TrainerEnvironment\n"
        "env = TrainerEnvironment(job_name='j', namespace='n', attempt=0,\n"
        "    coordinator_address='127.0.0.1:1', num_processes=1, process_id=0,\n"
        f"    checkpoint_path={str(tmp_path)!r})\n"
        "try:\n"
        "    orbax_backend.OrbaxCheckpoints.from_env(env)\n"
        "except ImportError as err:\n"
        "    print(err)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=120, env={"PYTHONPATH": ":".join(SOURCE_PATHS),
                                              "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr
    assert "pip install 'tardigrade[orbax]'" in result.stdout


def test_an_unknown_backend_name_is_refused_with_the_choices():
    from tardigrade_sdk.session import TrainingSession

    with pytest.raises(ValueError, match="use one of tardigrade, orbax"):
        TrainingSession("zarr")
