"""Resharding: an FSDP2 checkpoint saved at one world size resumes at another, with model,
optimizer and data order preserved, so the loss continues where it left off.

torch.distributed.checkpoint reshards the model and optimizer; the data loader's state is a
global sample count, valid at any world size. DeepSpeed ZeRO checkpoints do not reshard yet
(docs/checkpointing.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launchers import run_training
from tests.test_resume import STEPS, config_args, kill_at_step, step_losses


@pytest.mark.parametrize(
    ("save_ranks", "resume_ranks"), [(2, 1), pytest.param(1, 2, marks=pytest.mark.slow)]
)
def test_fsdp_checkpoint_resumes_at_another_world_size(save_ranks, resume_ranks, demo_shards, tmp_path: Path) -> None:
    extra = ["engine.kind=fsdp", "checkpoint.async_save=false"]
    straight, moved = tmp_path / "straight", tmp_path / "moved"
    run_training("torchrun", save_ranks, config_args(demo_shards, straight, extra))
    expected = {step: values[0] for step, values in step_losses(straight).items()}

    kill_at_step("torchrun", save_ranks, config_args(demo_shards, moved, extra), moved, 7)
    before = {step: values[0] for step, values in step_losses(moved).items()}
    run_training("torchrun", resume_ranks, [*config_args(demo_shards, moved, extra), "--resume", "auto"])
    after = {step: values[-1] for step, values in step_losses(moved).items()}

    assert sorted(after) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        # reduction order differs between world sizes: equal to float rounding, not bitwise
        assert after[step] == pytest.approx(expected[step], rel=1e-5), (step, after[step], expected[step])
    assert all(before[s] == expected[s] for s in before)  # the part before the move is the same run
