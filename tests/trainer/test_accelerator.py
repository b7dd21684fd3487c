"""A GPU or TPU job whose accelerator did not come up stops at start-up with a clear reason and
the config-error exit code, instead of training on the CPU (this machine has neither)."""

from __future__ import annotations

import pytest
from tardigrade_contract import contract
from tardigrade_sdk.accelerator import AcceleratorUnavailable, check, verify

from tests.trainer.trainer_harness import launch


@pytest.mark.parametrize(("kind", "platform", "runs"), [
    ("nvidia-gpu", "gpu", True),
    ("nvidia-gpu", "cpu", False),  # the silent fallback of a CUDA jaxlib without libcuda
    ("nvidia-gpu", "tpu", False),
    ("nvidia-gpu", None, False),  # no backend at all (JAX_PLATFORMS=cuda that cannot start)
    ("tpu", "tpu", True),
    ("tpu", "cpu", False),
    ("cpu", "cpu", True),
    ("cpu", "gpu", True),  # a CPU job asks for nothing: whatever JAX found will do
    (None, "cpu", True),  # run outside the operator: no check
])
def test_a_job_runs_only_on_the_backend_it_asked_for(kind, platform, runs):
    if runs:
        check(kind, platform)
        return
    with pytest.raises(AcceleratorUnavailable, match=f"spec.accelerator.kind is {kind}"):
        check(kind, platform)


def test_the_reason_names_jax_s_own_error_and_the_fix():
    def no_gpu(platform: str) -> object:
        raise RuntimeError(f"Unable to initialize backend '{platform}': libcuda.so.1: cannot "
                           "open shared object file")

    with pytest.raises(AcceleratorUnavailable) as err:
        verify("nvidia-gpu", backend=lambda: "cpu", devices=no_gpu, environ={})
    text = str(err.value)
    assert "JAX runs on cpu" in text and "libcuda.so.1: cannot open" in text
    assert "LD_LIBRARY_PATH=/usr/local/nvidia/lib64" in text
    assert "Refusing to train on the CPU" in text

    def unstartable() -> str:
        raise RuntimeError("Unable to initialize backend 'tpu': open(/dev/vfio/0): Permission "
                           "denied")

    with pytest.raises(AcceleratorUnavailable) as err:
        verify("tpu", backend=unstartable, environ={})
    assert "no JAX backend came up" in str(err.value)
    assert "/dev/vfio/0): Permission denied" in str(err.value)
    assert "google.com/tpu" in str(err.value)


@pytest.mark.parametrize(("kind", "platforms", "checked"), [
    ("nvidia-gpu", "", True),  # JAX picks: a CPU fallback is refused
    ("nvidia-gpu", "cuda", True),
    ("nvidia-gpu", "cuda,cpu", True),  # a fallback it allows is still refused
    ("nvidia-gpu", "cpu", False),  # told to run on the CPU: the user's explicit choice
    ("tpu", "tpu", True),
    ("tpu", "cpu", False),
    ("tpu", "CUDA", False),
])
def test_only_an_explicit_jax_platforms_elsewhere_overrides_the_check(kind, platforms, checked):
    def cpu_only(platform: str) -> object:
        raise RuntimeError(f"Unknown backend: '{platform}' requested")

    run = lambda: verify(kind, backend=lambda: "cpu", devices=cpu_only,  # noqa: E731
                         environ={"JAX_PLATFORMS": platforms})
    if checked:
        with pytest.raises(AcceleratorUnavailable):
            run()
    else:
        run()


@pytest.mark.slow
@pytest.mark.parametrize("platforms", ["", "cuda"])
def test_a_gpu_job_on_a_machine_without_one_exits_with_the_reason(tmp_path, platforms):
    # "": JAX picks and comes up on the CPU only, as a CUDA jaxlib without its driver does;
    # cuda: the platform pinned to the GPU, which cannot start here.
    gang = launch(tmp_path / "run", processes=1, checkpoint_path=str(tmp_path / "ckpt"),
                  config={"steps": 5},
                  extra_env={contract.ENV_ACCELERATOR: "nvidia-gpu", "JAX_PLATFORMS": platforms})
    assert gang.wait() == [contract.EXIT_CONFIG_ERROR], gang.describe()
    message = gang.termination(0)
    assert message is not None and message.reason == "AcceleratorUnavailable"
    assert "spec.accelerator.kind is nvidia-gpu" in message.message
    assert "LD_LIBRARY_PATH=/usr/local/nvidia/lib64" in message.message
    assert gang.events("step") == []  # not one step on the CPU
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())
