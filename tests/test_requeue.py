"""The bounded requeue (pretrain/resilience/requeue.py, launch/slurm/job.sh): a job requeues only while the
newest committed checkpoint moves forward; after train.max_no_progress_requeues requeues without progress
the batch script stops with exit 5 and the no-progress line; a preemption never counts; the state lives in
the run directory. Driven through the SLURM templates on the stand-ins of tests/slurm_standins.py: with a
stand-in trainer that leaves a chosen marker and checkpoint (fast), and with the real trainer whose rank 1
is stopped with SIGSTOP at the same step on every requeue (slow)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pretrain.resilience.requeue import EXIT_NO_PROGRESS, begin, decide, load_state
from tests.launchers import REPO, kill_tree
from tests.test_hang import _rank_process
from tests.test_resume import config_args, step_losses
from tests.test_slurm import requeues, submit

HANG = {"step": 5, "reason": "hang", "phase": "forward_backward", "rank": 0}


def test_progress_resets_the_count_a_preemption_is_not_counted_and_the_limit_stops(tmp_path: Path) -> None:
    begin(tmp_path, committed=0, restart_count=0)
    assert decide(tmp_path, 4, HANG, limit=1)[0]  # step 0 -> 4: progress
    assert load_state(tmp_path).no_progress_requeues == 0
    assert decide(tmp_path, 4, {"step": 6, "reason": "SIGTERM"}, limit=1)[0]  # a preemption: not counted
    assert load_state(tmp_path).no_progress_requeues == 0
    requeue, line = decide(tmp_path, 4, HANG, limit=1)
    assert requeue and "requeue 1 of train.max_no_progress_requeues=1" in line
    requeue, line = decide(tmp_path, 4, HANG, limit=1)
    assert not requeue
    assert line.startswith("no progress since step 4 after 1 requeues: rank 0 hung in phase 'forward_backward' of "
                           "step 5"), line
    assert decide(tmp_path, 8, HANG, limit=1)[0]  # a newer checkpoint: requeued again, the count back to 0
    assert load_state(tmp_path).no_progress_requeues == 0
    decide(tmp_path, 8, HANG, limit=1)
    begin(tmp_path, committed=8, restart_count=0)  # a fresh submission starts the count afresh
    assert load_state(tmp_path).no_progress_requeues == 0


def test_a_corrupt_state_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "requeue.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"requeue\.json: not a requeue state"):
        decide(tmp_path, 4, HANG, limit=1)


STANDIN_TRAINER = """
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
marker = Path(args[args.index("--preempted-marker") + 1])
run_dir = Path(next(a.split("=", 1)[1] for a in args if a.startswith("run.dir=")))
if os.environ["SLURM_PROCID"] == "0":
    commit = int(os.environ.get("STANDIN_COMMIT") or 0)
    if commit:
        (run_dir / "checkpoints" / f"step_{commit:08d}").mkdir(parents=True, exist_ok=True)
    marker.write_text(os.environ["STANDIN_MARKER"])
    sys.exit(3)
"""


def _python_with_standin_trainer(tmp_path: Path) -> Path:
    """A PYTHON for the templates that runs the stand-in trainer for launch/pretrain.py, python otherwise."""
    trainer = tmp_path / "standin_trainer.py"
    trainer.write_text(STANDIN_TRAINER)
    wrapper = tmp_path / "python"
    wrapper.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        if [ "$1" = "launch/pretrain.py" ]; then shift; exec "{sys.executable}" "{trainer}" "$@"; fi
        exec "{sys.executable}" "$@"
    """))
    wrapper.chmod(0o755)
    return wrapper


def test_the_template_stops_after_the_requeues_without_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four jobs of one run, max_no_progress_requeues=1: a hang after a new checkpoint (requeued), a
    preemption with none (requeued, not counted), a hang with none (requeued, counted), the same hang again
    (stopped: exit 5, the no-progress line, no requeue)."""
    python = str(_python_with_standin_trainer(tmp_path))
    run_dir, log = tmp_path / "run", tmp_path / "job.log"
    overrides = [str(REPO / "configs" / "tiny.yaml"), f"run.dir={run_dir}", "train.max_no_progress_requeues=1"]
    preempted = json.dumps({"step": 6, "checkpoint": "step_00000004", "reason": "SIGTERM"})
    jobs = [("4", json.dumps(HANG)), ("", preempted), ("", json.dumps(HANG)), ("", json.dumps(HANG))]
    codes = []
    for restart, (commit, marker) in enumerate(jobs):
        monkeypatch.setenv("STANDIN_COMMIT", commit)
        monkeypatch.setenv("STANDIN_MARKER", marker)
        job = submit("deepspeed", overrides, tmp_path, restart, log, python)
        codes.append(job.wait(timeout=120))
    output = log.read_text()
    assert codes == [0, 0, 0, EXIT_NO_PROGRESS], output[-3000:]
    assert requeues(tmp_path) == ["777"] * 3, output[-3000:]
    assert "the newest checkpoint moved from step 0 to 4" in output
    assert "a preemption is not counted as no progress" in output
    assert ("no progress since step 4 after 1 requeues: rank 0 hung in phase 'forward_backward' of step 5 "
            "(train.max_no_progress_requeues=1); not requeued") in output
    assert json.loads((run_dir / "requeue.json").read_text()) == {"committed_step": 4, "no_progress_requeues": 1}


def _wait_for_logged(proc: subprocess.Popen, run_dir: Path, step: int, times: int, log: Path) -> None:
    """Wait until step `step` has been logged `times` times (once per job that reached it)."""
    deadline = time.time() + 300
    while len(step_losses(run_dir).get(step, [])) < times:
        assert proc.poll() is None, f"exited early with {proc.returncode}: {log.read_text()[-3000:]}"
        assert time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)


@pytest.mark.slow
def test_a_hang_repeated_at_the_same_step_stops_the_requeues(demo_shards: dict[str, str], tmp_path: Path) -> None:
    """The real trainer under the DeepSpeed template, rank 1 stopped once step 5 is logged, in every job;
    checkpoints every 4 steps, so every job after the first resumes from step 4 and commits nothing newer.
    max_no_progress_requeues=1: the first job made progress (requeued), the second did not (requeued,
    counted), the third stops with exit 5 and the no-progress line."""
    job_dir, log = tmp_path / "job", tmp_path / "job.log"
    overrides = config_args(demo_shards, job_dir, ["engine.kind=deepspeed", "train.hang_timeout_s=10",
                                                   "checkpoint.every=4", "train.max_no_progress_requeues=1"])[1:]
    codes = []
    for restart in range(3):
        proc = submit("deepspeed", overrides, tmp_path, restart, log)
        try:
            _wait_for_logged(proc, job_dir, 5, restart + 1, log)
            _rank_process(proc.pid, 1).send_signal(signal.SIGSTOP)
            codes.append(proc.wait(timeout=200))
        finally:
            kill_tree(proc.pid)
    output = log.read_text()
    print(output[-2000:])
    assert codes == [0, 0, EXIT_NO_PROGRESS], output[-3000:]
    assert requeues(tmp_path) == ["777", "777"], output[-3000:]
    assert "no progress since step 4 after 1 requeues: rank 0 hung in phase" in output
    assert os.path.isdir(job_dir / "checkpoints" / "step_00000004")
