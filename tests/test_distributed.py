"""The SLURM task variables become torch.distributed's, and only under an srun job step."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pretrain.distributed.process_group import (
    FLIGHT_RECORDER,
    NCCL_FLIGHT_RECORDER,
    adopt_slurm_environment,
    enable_flight_recorder,
)
from tests.launchers import REPO, free_port

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


def test_every_group_made_after_the_default_one_gets_its_timeout() -> None:
    """torch gives a group made without a timeout 30 minutes, whatever the default group's; the project's
    `new_group` (the host group, the sequence-parallel groups) passes engine.dist_timeout_s on."""
    script = textwrap.dedent("""
        import datetime, os, torch
        import torch.distributed as dist
        from pretrain.distributed import process_group as pg
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"], RANK="0", WORLD_SIZE="1")
        pg.init_process_group("gloo", datetime.timedelta(seconds=123))
        ours, bare = pg.new_group(backend="gloo"), dist.new_group(backend="gloo")
        for group in (ours, bare):
            print(group._get_backend(torch.device("cpu")).options._timeout.total_seconds())
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO), PORT=str(free_port())))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["123.0", "1800.0"], done.stdout


def test_the_flight_recorder_is_enabled_as_documented(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """On GPUs NCCL's recorder is turned on with its dumps in the run directory; on CPU only the
    backend-neutral one; a variable the user set is never replaced."""
    names = [*FLIGHT_RECORDER, *NCCL_FLIGHT_RECORDER, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]
    for name in names:
        monkeypatch.delenv(name, raising=False)
    assert enable_flight_recorder(tmp_path, cuda=False) == {"TORCH_FR_BUFFER_SIZE": "2000"}
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "500")  # the user's
    chosen = enable_flight_recorder(tmp_path, cuda=True)
    assert chosen == {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                      "TORCH_NCCL_ENABLE_TIMING": "1",
                      "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "nccl_trace_rank_")}
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "500"
    assert all(os.environ[name] == value for name, value in chosen.items())
