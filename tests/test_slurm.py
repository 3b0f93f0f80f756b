"""The SLURM templates end to end, on stand-ins for sbatch, srun and scontrol that run the job on
this machine with 2 CPU ranks (tests/slurm_standins.py): SIGTERM to the whole job mid-run (what
SLURM sends on preemption) -> every rank saves -> the trainer's marker -> `scontrol requeue` ->
the requeued job resumes and finishes with the losses of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launchers import REPO, free_port, kill_tree, run_training
from tests.slurm_standins import install
from tests.test_preemption import wait_for_step
from tests.test_resume import STEPS, config_args, step_losses

CASES = {
    "deepspeed-transformer": ("deepspeed", "transformer"),
    "fsdp-vort": ("fsdp", "vort"),
    "deepspeed-pmnet": ("deepspeed", "pmnet"),
}
FAST = {"deepspeed-transformer"}


def submit(template: str, overrides: list[str], tmp_path: Path, restart: int, log: Path,
           python: str = sys.executable) -> subprocess.Popen:
    """`sbatch launch/slurm/<template>.sbatch` through the stand-ins, 1 node x 2 ranks (`python`: the
    template's PYTHON)."""
    bin_dir = tmp_path / "bin"
    install(bin_dir)
    env = dict(
        os.environ, PATH=f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}", PYTHON=python,
        OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", STANDIN_JOB_ID="777", STANDIN_RESTART_COUNT=str(restart),
        STANDIN_REQUEUE_LOG=str(tmp_path / "requeued"), PREEMPTED_MARKER=str(tmp_path / "preempted"),
        MASTER_PORT=str(free_port()),
    )
    command = [
        "sbatch", "--nodes=1", "--gpus-per-node=2", "--ntasks-per-node=2", f"launch/slurm/{template}.sbatch",
        *overrides,
    ]
    with open(log, "a") as out:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def requeues(tmp_path: Path) -> list[str]:
    path = tmp_path / "requeued"
    return path.read_text().split() if path.exists() else []


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c in FAST else pytest.mark.slow) for c in CASES])
def test_preempted_job_is_requeued_and_resumes_exactly(case: str, demo_shards, tmp_path: Path) -> None:
    engine, model = CASES[case]
    straight, job = tmp_path / "straight", tmp_path / "job"
    extra = [f"engine.kind={engine}", "checkpoint.every=0"]
    launcher = "deepspeed" if engine == "deepspeed" else "torchrun"
    run_training(launcher, 2, config_args(demo_shards, straight, extra, model))
    expected = {step: values[0] for step, values in step_losses(straight).items()}
    overrides = config_args(demo_shards, job, extra, model)[1:]  # the config file, then key=value
    log = tmp_path / "job.log"

    first = submit(engine, overrides, tmp_path, 0, log)
    try:
        wait_for_step(first, job, 4, log)
        os.killpg(first.pid, signal.SIGTERM)  # SLURM signals every process of the job
        first.wait(timeout=300)
    finally:
        kill_tree(first.pid)
    output = log.read_text()[-4000:]
    assert first.returncode == 0, output
    assert requeues(tmp_path) == ["777"], output
    marker = json.loads((tmp_path / "preempted").read_text())
    stopped = max(step_losses(job))
    assert stopped < STEPS, "the job finished before the signal: nothing was tested"
    assert marker == {"step": stopped, "checkpoint": f"step_{stopped:08d}", "reason": "SIGTERM"}
    saved = job / "checkpoints" / marker["checkpoint"]
    assert sorted(p.name for p in (saved / "rng").glob("*.json")) == ["rank_0.json", "rank_1.json"]
    if engine == "deepspeed":  # each rank wrote its own optimizer partition
        assert len(list((saved / "engine" / "ds").glob("*rank_[01]_mp_rank_00_optim_states.pt"))) == 2
    else:
        assert len(list((saved / "engine").glob("__[01]_0.distcp"))) == 2

    second = submit(engine, overrides, tmp_path, 1, log)
    try:
        second.wait(timeout=600)
    finally:
        kill_tree(second.pid)
    assert second.returncode == 0, log.read_text()[-4000:]
    assert requeues(tmp_path) == ["777"]  # finished: no second requeue
    assert not (tmp_path / "preempted").exists()
    got = step_losses(job)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, values in got.items():
        assert all(v == expected[step] for v in values), (case, step, values, expected[step])


def test_template_refuses_tasks_that_do_not_match_the_gpus(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    install(bin_dir)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON=sys.executable)
    proc = subprocess.run(
        ["sbatch", "--gpus-per-node=4", "--ntasks-per-node=1", "launch/slurm/fsdp.sbatch", "configs/tiny.yaml"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "--ntasks-per-node=1 but --gpus-per-node=4" in proc.stderr
