"""The SLURM task variables become torch.distributed's, and only under an srun job step."""

from __future__ import annotations

import os

import pytest

from pretrain.distributed.process_group import adopt_slurm_environment

SLURM_TASK = {
    "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "MASTER_ADDR": "node-1", "MASTER_PORT": "29500",
}
SET = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture
def slurm_task(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in SET:
        # setenv first so that monkeypatch restores the variable's absence after the test, also
        # when adopt_slurm_environment (not monkeypatch) has set it meanwhile
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    for name, value in SLURM_TASK.items():
        monkeypatch.setenv(name, value)
    return monkeypatch


def test_srun_task_gets_rank_world_and_local_rank(slurm_task: pytest.MonkeyPatch) -> None:
    assert adopt_slurm_environment()
    assert [os.environ[n] for n in SET] == ["5", "8", "1", "4"]


def test_a_launcher_s_rank_wins(slurm_task: pytest.MonkeyPatch) -> None:
    slurm_task.setenv("RANK", "0")
    assert not adopt_slurm_environment()
    assert "WORLD_SIZE" not in os.environ


def test_batch_shell_outside_a_step_is_left_alone(slurm_task: pytest.MonkeyPatch) -> None:
    slurm_task.delenv("SLURM_STEP_ID")
    assert not adopt_slurm_environment()


def test_missing_rendezvous_address_is_named(slurm_task: pytest.MonkeyPatch) -> None:
    slurm_task.delenv("MASTER_ADDR")
    with pytest.raises(RuntimeError, match="MASTER_ADDR is not set"):
        adopt_slurm_environment()
