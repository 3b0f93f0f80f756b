"""The hang watchdog (pretrain/resilience/watchdog.py) against hangs made from outside the trainer: one rank of a
2-rank run stopped with SIGSTOP mid-training. The other rank, blocked in a collective, must end the job
within `train.hang_timeout_s` plus a margin, with the stacks of every thread in the log and the requeue
marker saying "hang"; the rerun resumes from the newest checkpoint and logs the uninterrupted run's
losses, bitwise. The SLURM case goes through the templates on the stand-ins of tests/slurm_standins.py
and must be requeued."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from pretrain.resilience.watchdog import (
    COMMIT_GRACE_S,
    EXIT_HANG,
    FILE_WAIT_S,
    FIRST_TIME_FACTOR,
    HANG_FLOOR_S,
    MEASURED_FACTOR,
    Deadlines,
)
from tests.launchers import REPO, kill_tree, run_training
from tests.test_preemption import start, wait_for_step
from tests.test_resume import STEPS, config_args, step_losses
from tests.test_slurm import requeues, submit

HANG_TIMEOUT_S = 20.0
"""Long enough for a step of the test's config on a loaded 2-core machine, short enough for a test."""
MARGIN_S = 60.0
"""What the issue allows beyond the timeout: the watchdog's poll, the write, and the launcher's teardown
of the stopped rank (the DeepSpeed launcher and torchrun give it 30 s after SIGTERM, then SIGKILL)."""
FIFO_MARGIN_S = 90.0
"""What the issue allows beyond the deadline when the files the watchdog writes block on open."""


def test_watchdog_fires_while_the_main_thread_is_blocked_in_a_c_call(tmp_path: Path) -> None:
    """The main thread blocks in os.read on a pipe nobody writes to (a C call: no Python signal handler
    runs there); the watchdog thread reports the phase, the step and every thread's stack, writes the
    marker and exits with 3."""
    marker = tmp_path / "marker.json"
    script = textwrap.dedent(f"""
        import os
        from pretrain.resilience import watchdog
        from pretrain.config import load_config
        cfg = load_config({str(REPO / 'configs' / 'tiny.yaml')!r}, ["run.dir={tmp_path}", "train.hang_timeout_s=1"])
        watchdog.start_for(cfg, 0, __import__("pathlib").Path({str(marker)!r}))
        watchdog.phase("data", 7)
        watchdog.phase("forward_backward")
        read_end, _ = os.pipe()
        os.read(read_end, 1)
    """)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert done.returncode == EXIT_HANG, done.stderr[-3000:]
    assert time.monotonic() - started < 30
    assert json.loads(marker.read_text()) == {"step": 7, "reason": "hang", "phase": "forward_backward", "rank": 0}
    for log in (done.stderr, (tmp_path / "hang_rank0.log").read_text()):
        assert "rank 0 has been in phase 'forward_backward' of step 7" in log
        assert "train.hang_timeout_s" in log
        assert 'Thread 0x' in log and "os.read(read_end, 1)" not in log  # faulthandler names lines, not code
        assert "line 10 in <module>" in log  # the main thread's frame: the os.read line
        assert "in _fire" in log  # and the watchdog's own thread



def _blocked_rank(tmp_path: Path, marker: Path, block: str, prelude: str = "") -> tuple[subprocess.CompletedProcess,
                                                                                       float]:
    """A process whose watchdog (train.hang_timeout_s=1) watches a main thread stuck in `block`; its run
    and how long it took."""
    script = textwrap.dedent(f"""
        import os, pathlib, re
        from pretrain.resilience import watchdog
        from pretrain.config import load_config
        {prelude}
        cfg = load_config({str(REPO / 'configs' / 'tiny.yaml')!r}, ["run.dir={tmp_path}", "train.hang_timeout_s=1"])
        watchdog.start_for(cfg, 0, pathlib.Path({str(marker)!r}))
        watchdog.phase("data", 7)
        {block}
    """)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=200,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    return done, time.monotonic() - started


def test_a_log_file_that_blocks_on_open_still_ends_the_rank_with_its_marker(tmp_path: Path) -> None:
    """A FIFO planted where the watchdog writes its log: opening it blocks (as on a stuck filesystem). The
    stacks are on stderr before the open, the wait on it is bounded, the marker is written and the rank ends
    within the deadline plus FILE_WAIT_S and a margin."""
    os.mkfifo(tmp_path / "hang_rank0.log")
    marker = tmp_path / "marker.json"
    done, took = _blocked_rank(tmp_path, marker, "os.read(os.pipe()[0], 1)")
    assert done.returncode == EXIT_HANG, done.stderr[-3000:]
    assert took < 1 + FILE_WAIT_S + 30, took
    assert "has been in phase 'data' of step 7" in done.stderr and "Thread 0x" in done.stderr
    assert done.stderr.index("Thread 0x") < done.stderr.index("gave up on writing")  # stacks first
    assert f"gave up on writing {tmp_path / 'hang_rank0.log'} after {FILE_WAIT_S:.0f} s" in done.stderr
    assert json.loads(marker.read_text())["reason"] == "hang"
    assert not list(tmp_path.glob("*.tmp"))


def test_a_marker_that_cannot_be_written_still_ends_the_rank(tmp_path: Path) -> None:
    """An error in the handler (the marker's directory is a file) is reported; the exit still happens."""
    (tmp_path / "not_a_dir").write_text("")
    done, _ = _blocked_rank(tmp_path, tmp_path / "not_a_dir" / "marker.json", "os.read(os.pipe()[0], 1)")
    assert done.returncode == EXIT_HANG, done.stderr[-3000:]
    assert "writing the requeue marker" in done.stderr and "failed" in done.stderr
    assert "has been in phase 'data' of step 7" in (tmp_path / "hang_rank0.log").read_text()



def test_the_commit_in_flight_gets_its_grace_before_the_exit(tmp_path: Path) -> None:
    """Before it exits, the watchdog waits for the asynchronous commit in flight (bounded by COMMIT_GRACE_S),
    so that the newest checkpoint is not lost: the stand-in commit's wait runs, and finishes, first."""
    waited = tmp_path / "waited"
    commit = f"lambda s: (time.sleep(1), pathlib.Path({str(waited)!r}).write_text(str(s)))"
    done, _ = _blocked_rank(tmp_path, tmp_path / "marker.json",
                            f"import time; watchdog.guard_commit({commit}); os.read(os.pipe()[0], 1)")
    assert done.returncode == EXIT_HANG, done.stderr[-3000:]
    assert float(waited.read_text()) == COMMIT_GRACE_S

def test_deadlines_come_from_the_config_or_the_measured_times() -> None:
    deadlines = Deadlines({"step": None, "eval": 42.0, "checkpoint": None}, collective_timeout_s=1800.0)
    assert deadlines("eval") == 42.0
    assert deadlines("step") == FIRST_TIME_FACTOR * HANG_FLOOR_S  # nothing measured yet
    deadlines.observe("step", 2.0)
    assert deadlines("step") == HANG_FLOOR_S  # 10 x 2 s is under the floor
    deadlines.observe("step", 45.0)
    deadlines.observe("step", 3.0)
    assert deadlines("step") == MEASURED_FACTOR * 45.0  # the longest step so far
    deadlines.observe("step", 400.0)
    assert deadlines("step") == 0.9 * 1800.0  # capped below the collectives' own timeout
    assert Deadlines({"step": None}, collective_timeout_s=100.0)("step") == 90.0


def test_measured_deadlines_carry_over_and_the_first_step_keeps_its_allowance() -> None:
    """A requeued job starts from the durations the job before measured (deadlines.json): its first step
    gets the larger of the first-time allowance and the measured deadline; the default dist_timeout_s leaves
    the allowance unclamped."""
    from pretrain.config import EngineSection

    default_cap = EngineSection().dist_timeout_s
    slow = Deadlines({}, default_cap, longest={"step": 120.0, "commit": 30.0})
    assert slow("step") == MEASURED_FACTOR * 120.0  # above the 900 s allowance
    assert slow("commit") == FIRST_TIME_FACTOR * HANG_FLOOR_S  # 300 s measured, below it
    assert Deadlines({}, default_cap)("step") == FIRST_TIME_FACTOR * HANG_FLOOR_S == slow.first_time_s()
    assert Deadlines({}, 600.0).first_time_s() == 540.0  # clamped: the trainer warns at its start


def test_the_measured_durations_are_read_back_from_the_run_directory(tmp_path: Path) -> None:
    from pretrain.resilience.watchdog import DEADLINES_FILE, load_longest

    assert load_longest(tmp_path) == {}  # a first job
    (tmp_path / DEADLINES_FILE).write_text(json.dumps({"step": 120.5, "eval": 30, "unknown": 1}))
    assert load_longest(tmp_path) == {"step": 120.5, "eval": 30.0}
    (tmp_path / DEADLINES_FILE).write_text("{cut short")  # a file left half-written: start from the allowance
    assert load_longest(tmp_path) == {}


def _rank_process(launcher_pid: int, rank: int) -> psutil.Process:
    """The training process of `rank` below a launcher (found by its RANK variable)."""
    for proc in psutil.Process(launcher_pid).children(recursive=True):
        try:
            if any(a.endswith("launch/pretrain.py") for a in proc.cmdline()[:3]) and proc.environ().get(
                    "RANK", proc.environ().get("SLURM_PROCID")) == str(rank):
                return proc
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no process of rank {rank} under {launcher_pid}")


def _stopped_job_ends(proc: subprocess.Popen, run_dir: Path, log: Path, rank: int = 1) -> tuple[float, int]:
    """SIGSTOP `rank` once step 5 is logged; returns how long the job took to end after it, and the last
    step logged."""
    wait_for_step(proc, run_dir, 5, log)
    victim = _rank_process(proc.pid, rank)
    victim.suspend()  # SIGSTOP: the process stops where it is, as a rank whose device stopped answering
    stopped_at = time.monotonic()
    proc.wait(timeout=HANG_TIMEOUT_S + MARGIN_S + 60)
    return time.monotonic() - stopped_at, max(step_losses(run_dir))


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_a_stopped_rank_ends_the_job_marked_for_requeue_and_the_rerun_is_exact(
    launcher: str, demo_shards: dict[str, str], tmp_path: Path
) -> None:
    engine = "engine.kind=deepspeed" if launcher == "deepspeed" else "engine.kind=fsdp"
    straight, hung = tmp_path / "straight", tmp_path / "hung"
    run_training(launcher, 2, config_args(demo_shards, straight, [engine]))
    expected = {step: values[0] for step, values in step_losses(straight).items()}

    marker, log = tmp_path / "marker.json", tmp_path / "log.txt"
    args = [*config_args(demo_shards, hung, [engine, f"train.hang_timeout_s={HANG_TIMEOUT_S}"]),
            "--preempted-marker", str(marker)]
    with start(launcher, 2, args, log) as proc:
        took, reached = _stopped_job_ends(proc, hung, log)
    output = log.read_text()
    print(f"{launcher}: the job ended {took:.1f} s after SIGSTOP (hang_timeout_s={HANG_TIMEOUT_S})")
    assert reached < STEPS, "the run finished before the stop: nothing was tested"
    assert took < HANG_TIMEOUT_S + MARGIN_S, output[-3000:]
    # torchrun reports 1 for any failed worker; the DeepSpeed launcher passes the rank's code on
    assert proc.returncode == (EXIT_HANG if launcher == "deepspeed" else 1), output[-3000:]
    note = json.loads(marker.read_text())
    assert note["reason"] == "hang" and note["rank"] == 0 and note["step"] >= 5, note
    assert "rank 0 has been in phase" in output and "Stacks of every thread" in output
    assert "Thread 0x" in output and "most recent call first" in output
    assert "distributed_c10d.py" in (hung / "hang_rank0.log").read_text()  # blocked in a collective

    run_training(launcher, 2, [*config_args(demo_shards, hung, [engine]), "--resume", "auto"])
    got = step_losses(hung)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, values in got.items():
        assert all(v == expected[step] for v in values), (launcher, step, values, expected[step])


def test_slurm_job_with_a_stopped_rank_is_requeued_and_resumes(demo_shards: dict[str, str], tmp_path: Path) -> None:
    """The templates on the stand-ins, 1 node x 2 DeepSpeed ranks: rank 1 stopped mid-run; rank 0's
    watchdog exits 3 with the marker, srun kills the stopped rank at once (--kill-on-bad-exit) and the
    batch script requeues; the requeued job resumes and finishes. Rank 0's hang log is a FIFO (opening it
    blocks, as on a stuck filesystem): the job still ends within the deadline plus FIFO_MARGIN_S."""
    job = tmp_path / "job"
    job.mkdir()
    os.mkfifo(job / "hang_rank0.log")
    overrides = config_args(demo_shards, job, ["engine.kind=deepspeed", "train.hang_timeout_s=10"])[1:]
    log = tmp_path / "job.log"
    first = submit("deepspeed", overrides, tmp_path, 0, log)
    try:
        took, reached = _stopped_job_ends(first, job, log)
    finally:
        kill_tree(first.pid)
    output = log.read_text()
    print(f"slurm: the job ended {took:.1f} s after SIGSTOP (hang_timeout_s=10)")
    assert first.returncode == 0, output[-3000:]  # the batch script requeued and exited 0
    assert requeues(tmp_path) == ["777"], output[-3000:]
    assert took < 10 + FIFO_MARGIN_S
    assert f"gave up on writing {job / 'hang_rank0.log'}" in output
    record = json.loads((job / "collectives_rank0.json").read_text())  # torch's flight recorder, gloo here
    in_flight = [e["profiling_name"] for e in record["entries"] if not e["retired"]]  # the one it waits in
    print("collectives in flight on rank 0:", in_flight)
    assert in_flight, record["entries"][-3:]
    assert "rank 0 hung in phase" in output and "requeueing job 777" in output and '"reason": "hang"' in output
    assert reached < STEPS

    second = submit("deepspeed", overrides, tmp_path, 1, log)
    try:
        second.wait(timeout=600)
    finally:
        kill_tree(second.pid)
    assert second.returncode == 0, log.read_text()[-3000:]
    assert requeues(tmp_path) == ["777"]
    assert sorted(step_losses(job)) == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_an_evaluation_slower_than_the_step_deadline_is_not_a_hang(demo_shards: dict[str, str], tmp_path: Path) -> None:
    """2 DeepSpeed ranks; rank 0 alone runs the evaluation's tasks, made slower (many long examples) than
    train.hang_timeout_s, while rank 1 waits for it. Both wait under the evaluation's deadline, at a barrier
    inside it, so the run finishes with no hang; the evaluation took longer than the step deadline
    (deadlines.json, the longest durations the run measured)."""
    run = tmp_path / "run"
    step_deadline = 4.0
    args = config_args(demo_shards, run, [
        "engine.kind=deepspeed", "train.steps=4", "checkpoint.every=0", "eval.every=2", "eval.tasks=[copy]",
        "eval.task_examples=384", "eval.task_len=4096", f"train.hang_timeout_s={step_deadline}",
        "eval.hang_timeout_s=300",
    ])
    proc = run_training("deepspeed", 2, args, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "hang:" not in output
    longest = json.loads((run / "deadlines.json").read_text())
    print(f"longest evaluation {longest['eval']:.1f} s, longest step {longest['step']:.2f} s "
          f"(train.hang_timeout_s={step_deadline})")
    assert longest["eval"] > step_deadline, longest
    assert len([line for line in (run / "metrics.jsonl").read_text().splitlines() if "eval/copy_exact" in line]) == 2
