"""Resharding: a checkpoint saved at one world size resumes at another, with model, optimizer
and data order preserved, so the loss continues as an uninterrupted run at the new size would.

FSDP2: torch.distributed.checkpoint reshards the model and optimizer. DeepSpeed ZeRO 1-3: a
checkpoint written at another data-parallel size or ZeRO stage is converted to DeepSpeed's
universal format and loaded from there (pretrain/engine_checkpoint.py, which also repairs two
faults of the ZeRO-3 universal loader); the stage may change between ZeRO-1 and ZeRO-2 the same way.
The data loader's state is a global sample count, valid at any world size. docs/cluster.md, "A changed allocation".
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pretrain.checkpoint.consolidate import read_engine_weights
from tests.launchers import run_training
from tests.test_resume import STEPS, config_args, kill_at_step, step_losses

FSDP = ["engine.kind=fsdp", "checkpoint.async_save=false"]


def deepspeed(stage: int) -> list[str]:
    return ["engine.kind=deepspeed", f"engine.zero_stage={stage}", "checkpoint.async_save=false"]


def move(demo_shards, tmp_path: Path, before: tuple[str, int, list[str]], after: tuple[str, int, list[str]]) -> None:
    """Train `before` until a kill after step 7, resume the same run directory as `after`, and
    compare every loss and gradient norm before clipping, and the final weights, with an uninterrupted
    run of `after`. The gradient norms catch what the losses cannot: clipping hides a constant scale of
    every gradient from the loss curve."""
    straight, moved = tmp_path / "straight", tmp_path / "moved"
    launcher, ranks, extra = after
    run_training(launcher, ranks, config_args(demo_shards, straight, extra))
    expected = {step: values[0] for step, values in step_losses(straight).items()}

    launcher, ranks, extra = before
    kill_at_step(launcher, ranks, config_args(demo_shards, moved, extra), moved, 7)
    first = {step: values[0] for step, values in step_losses(moved).items()}
    launcher, ranks, extra = after
    run_training(launcher, ranks, [*config_args(demo_shards, moved, extra), "--resume", "auto"])
    resumed = {step: values[-1] for step, values in step_losses(moved).items()}
    norms = {step: values[-1] for step, values in step_losses(moved, "train/grad_norm").items()}
    expected_norms = {step: values[0] for step, values in step_losses(straight, "train/grad_norm").items()}

    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert any(len(values) > 1 for values in step_losses(moved).values()) or max(first) % 3 == 0
    for step in range(1, STEPS + 1):
        # reduction order differs between world sizes: equal to float rounding, not bitwise
        assert resumed[step] == pytest.approx(expected[step], rel=1e-5), (step, resumed[step], expected[step])
        assert norms[step] == pytest.approx(expected_norms[step], rel=1e-5), (step, norms[step], expected_norms[step])
    assert all(first[s] == pytest.approx(expected[s], rel=1e-5) for s in first)
    final = [run / "checkpoints" / f"step_{STEPS:08d}" / "engine" for run in (straight, moved)]
    weights = [read_engine_weights(path) for path in final]
    assert sorted(weights[0]) == sorted(weights[1])
    for name, value in weights[0].items():
        torch.testing.assert_close(weights[1][name], value, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    ("save_ranks", "resume_ranks"), [(2, 1), pytest.param(1, 2, marks=pytest.mark.slow)]
)
def test_fsdp_checkpoint_resumes_at_another_world_size(save_ranks, resume_ranks, demo_shards, tmp_path: Path) -> None:
    move(demo_shards, tmp_path, ("torchrun", save_ranks, FSDP), ("torchrun", resume_ranks, FSDP))


@pytest.mark.parametrize(
    ("stage", "save_ranks", "resume_ranks"),
    [
        (2, 2, 1),
        (3, 2, 1),
        pytest.param(3, 1, 2, marks=pytest.mark.slow),
        pytest.param(1, 2, 1, marks=pytest.mark.slow),
        pytest.param(1, 1, 2, marks=pytest.mark.slow),
        pytest.param(2, 1, 2, marks=pytest.mark.slow),
    ],
)
def test_deepspeed_checkpoint_resumes_at_another_world_size(
    stage: int, save_ranks: int, resume_ranks: int, demo_shards, tmp_path: Path
) -> None:
    before, after = ("deepspeed", save_ranks, deepspeed(stage)), ("deepspeed", resume_ranks, deepspeed(stage))
    move(demo_shards, tmp_path, before, after)


@pytest.mark.slow
@pytest.mark.parametrize(("save_stage", "resume_stage"), [(2, 1)])
def test_deepspeed_checkpoint_resumes_at_another_zero_stage(
    save_stage: int, resume_stage: int, demo_shards, tmp_path: Path
) -> None:
    move(demo_shards, tmp_path, ("deepspeed", 2, deepspeed(save_stage)), ("deepspeed", 2, deepspeed(resume_stage)))
