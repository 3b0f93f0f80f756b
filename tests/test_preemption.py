"""Preemption and failure: SIGTERM/SIGUSR1 save and exit with EXIT_PREEMPTED, the wall-clock
limit saves before it is reached, and a dead rank takes the whole job down in bounded time."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from pretrain.trainer import EXIT_PREEMPTED
from tests.launchers import REPO, kill_tree, launch_command, run_training
from tests.test_resume import config_args, step_losses


@contextlib.contextmanager
def start(launcher: str, ranks: int, args: list[str], log: Path) -> Iterator[subprocess.Popen]:
    """Launch in a new session, output to `log` (a pipe nobody reads would block the job); the
    whole process group is killed on the way out, whatever the test did."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{Path(launch_command('python', 1)[0]).parent}:{env['PATH']}"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*launch_command(launcher, ranks), *args], cwd=REPO, env=env, start_new_session=True,
            stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        yield proc
    finally:
        kill_tree(proc.pid)
        proc.wait()


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, log: Path, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while max(step_losses(run_dir), default=0) < step:
        assert proc.poll() is None, f"exited early with {proc.returncode}: {log.read_text()[-3000:]}"
        assert time.time() < deadline, f"step {step} not reached: {log.read_text()[-3000:]}"
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_saves_and_exits_with_requeue_code(sig: signal.Signals, demo_shards, tmp_path: Path) -> None:
    args = config_args(demo_shards, tmp_path, ["checkpoint.every=0", "train.steps=400"])
    log = tmp_path / "log.txt"
    with start("python", 1, args, log) as proc:
        wait_for_step(proc, tmp_path, 3, log)
        proc.send_signal(sig)
        proc.wait(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, log.read_text()[-3000:]
    stopped_at = max(step_losses(tmp_path))
    assert stopped_at < 400
    assert (tmp_path / "checkpoints" / "latest").read_text() == f"step_{stopped_at:08d}"


def test_max_runtime_saves_before_the_limit(demo_shards, tmp_path: Path) -> None:
    args = config_args(demo_shards, tmp_path, ["checkpoint.every=0", "train.steps=100000", "train.max_runtime=20"])
    started = time.time()
    proc = run_training("python", 1, args, check=False)
    assert proc.returncode == EXIT_PREEMPTED, proc.stdout[-3000:]
    assert (tmp_path / "checkpoints" / "latest").exists()
    assert time.time() - started < 120


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_dead_rank_ends_the_job_in_bounded_time(launcher: str, demo_shards, tmp_path: Path) -> None:
    extra = ["engine.kind=deepspeed"] if launcher == "deepspeed" else ["engine.kind=fsdp"]
    log = tmp_path / "log.txt"
    args = config_args(demo_shards, tmp_path, [*extra, "train.steps=100000", "checkpoint.every=0"])
    with start(launcher, 2, args, log) as proc:
        wait_for_step(proc, tmp_path, 2, log)
        family = psutil.Process(proc.pid).children(recursive=True)
        workers = [p for p in family if any(a.endswith("launch/pretrain.py") for a in p.cmdline()[:3])]
        assert workers, f"no rank processes among {[p.cmdline()[:3] for p in family]}"
        workers[-1].kill()
        killed_at = time.time()
        proc.wait(timeout=120)
        assert proc.returncode != 0
        assert time.time() - killed_at < 120
        time.sleep(2)
        leftover = [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not leftover, f"processes left behind: {[p.cmdline()[:3] for p in leftover]}"
