"""Preemption and failure: SIGTERM/SIGUSR1 and a first Ctrl-C (SIGINT) save and exit with
EXIT_PREEMPTED (a resumed run then equals an uninterrupted one bitwise), a second Ctrl-C stops at once,
the wall-clock limit saves before it is reached, and a dead rank takes the whole job down in bounded time."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from launch.pretrain import EXIT_ABORTED
from pretrain.trainer import EXIT_PREEMPTED
from tests.launchers import REPO, kill_tree, launch_command, run_training
from tests.test_resume import STEPS, config_args, step_losses


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


def test_ctrl_c_saves_and_the_resumed_run_equals_an_uninterrupted_one(demo_shards, tmp_path: Path) -> None:
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    run_training("python", 1, config_args(demo_shards, straight, ["checkpoint.every=0"]))
    expected = {step: values[0] for step, values in step_losses(straight).items()}
    marker, log = tmp_path / "requeue.json", tmp_path / "log.txt"
    args = config_args(demo_shards, interrupted, ["checkpoint.every=0"])
    with start("python", 1, [*args, "--preempted-marker", str(marker)], log) as proc:
        wait_for_step(proc, interrupted, 3, log)
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        proc.wait(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, log.read_text()[-3000:]
    stopped_at = max(step_losses(interrupted))
    assert 3 <= stopped_at < STEPS
    assert (interrupted / "checkpoints" / "latest").read_text() == f"step_{stopped_at:08d}"
    assert json.loads(marker.read_text()) == {"step": stopped_at, "checkpoint": f"step_{stopped_at:08d}",
                                              "reason": "SIGINT"}
    assert "Ctrl-C: saving a checkpoint after this step" in log.read_text() and "Traceback" not in log.read_text()
    run_training("python", 1, [*args, "--resume", "auto"])
    got = step_losses(interrupted)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert all(values == [expected[step]] for step, values in got.items()), got  # once each, bitwise equal


def test_a_second_ctrl_c_stops_at_once_without_saving(demo_shards, tmp_path: Path) -> None:
    log = tmp_path / "log.txt"
    args = config_args(demo_shards, tmp_path, ["checkpoint.every=0", "train.steps=400", "model.d_model=256"])
    with start("python", 1, args, log) as proc:
        wait_for_step(proc, tmp_path, 2, log)
        proc.send_signal(signal.SIGINT)
        deadline = time.time() + 60
        while "Ctrl-C: saving" not in log.read_text():  # the first one is being handled: the step goes on
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.005)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    text = log.read_text()
    errors = [line for line in text.splitlines() if " ERROR " in line]
    assert proc.returncode == EXIT_ABORTED and len(errors) == 1 and "stopped at once without saving" in errors[0], text
    assert not (tmp_path / "checkpoints" / "latest").exists()


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_ctrl_c_under_a_launcher_saves_within_its_30_s(launcher: str, demo_shards, tmp_path: Path) -> None:
    """Ctrl-C in a terminal reaches the launcher and its ranks (one process group); the launcher then sends
    the ranks SIGTERM and SIGKILL 30 s later. Both signals ask for the same save: on this small model it
    is committed, at the step the ranks stopped at, well before the SIGKILL."""
    engine = "engine.kind=deepspeed" if launcher == "deepspeed" else "engine.kind=fsdp"
    args = config_args(demo_shards, tmp_path, [engine, "checkpoint.every=0", "train.steps=400"])
    log = tmp_path / "log.txt"
    with start(launcher, 2, args, log) as proc:
        wait_for_step(proc, tmp_path, 3, log)
        interrupted = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        proc.wait(timeout=120)
        took = time.monotonic() - interrupted
    output = log.read_text()
    print(f"{launcher}: Ctrl-C to the end of the job {took:.1f} s")
    stopped_at = max(step_losses(tmp_path))
    assert stopped_at < 400
    assert (tmp_path / "checkpoints" / "latest").read_text() == f"step_{stopped_at:08d}", output[-3000:]
    assert took < 30, output[-3000:]
