"""Executors of a sweep's cells: local processes K at a time, a SLURM job array, or printed commands.

Every executor launches only the cells that are not finished; an interrupted cell restarts with
`checkpoint.resume=auto` and continues from its newest verified checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pretrain.sweeps.results import cell_status, final_loss
from pretrain.sweeps.spec import Cell, Sweep, cell_arguments, cell_shell_command

REPO = Path(__file__).resolve().parents[2]
EXIT_PREEMPTED = 3
STATUS_EVERY_S = 60.0

SLURM_DEFAULTS = {
    "nodes": 1, "gpus_per_node": 8, "cpus_per_task": 32, "time": "24:00:00", "max_parallel": 8,
    "signal_seconds": 300, "extra": [],
}


def _bar(done: int, total: int, width: int = 30) -> str:
    filled = int(width * done / max(total, 1))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def _last_step(run_dir: Path) -> int:
    """The newest step logged in a run's metrics (0 before the first log line)."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return 0
    step = 0
    for line in metrics.read_text().splitlines()[-5:]:
        with contextlib.suppress(json.JSONDecodeError, KeyError):
            step = max(step, int(json.loads(line)["step"]))
    return step


def core_slots(parallel: int, cores: list[int] | None = None) -> list[list[int]]:
    """The machine's cores divided into `parallel` disjoint groups (shared when there are too few)."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    if parallel >= len(cores):
        return [[cores[i % len(cores)]] for i in range(parallel)]
    per = len(cores) // parallel
    return [cores[i * per:(i + 1) * per] for i in range(parallel)]


class LocalExecutor:
    """Runs unfinished cells as child processes, `parallel` at a time, each pinned to its own cores
    with as many OpenMP/numba threads as it has cores. SIGINT/SIGTERM are passed on to the cells
    (which save a checkpoint and exit 3) before the sweep stops."""

    def __init__(self, sweep: Sweep, parallel: int, say: Callable[[str], None] = print):
        if parallel < 1:
            raise ValueError(f"--parallel: must be >= 1, got {parallel}")
        self.sweep, self.parallel, self.say = sweep, parallel, say
        self.stopping = False

    def _launch(self, cell: Cell, cores: list[int]) -> subprocess.Popen:
        run_dir = Path(cell.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        threads = str(len(cores))
        env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, NUMBA_NUM_THREADS=threads,
                   PYTHONUNBUFFERED="1")
        words = shlex.split(os.path.expandvars(self.sweep.launcher))
        launcher = [sys.executable if w == "python" else w for w in words]
        with open(run_dir / "train.log", "ab") as log:
            return subprocess.Popen(
                [*launcher, *cell_arguments(self.sweep, cell)], stdout=log, stderr=subprocess.STDOUT, env=env,
                preexec_fn=lambda: os.sched_setaffinity(0, cores), start_new_session=True,
            )

    def _stop(self, signum: int, _frame: object) -> None:
        self.stopping = True
        self.say(f"signal {signum}: asking the running cells to save and stop")

    def run(self, cells: list[Cell]) -> int:
        """0 when every cell is finished, 3 when stopped by a signal, 1 when a cell failed."""
        total = len(cells)
        done = [c for c in cells if cell_status(c) == "done"]
        queue = [c for c in cells if cell_status(c) != "done"]
        if done:
            self.say(f"{len(done)}/{total} cells already finished: skipped")
        previous = {sig: signal.signal(sig, self._stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        slots: list[tuple[Cell, subprocess.Popen, float] | None] = [None] * self.parallel
        cores = core_slots(self.parallel)
        failed: list[str] = []
        signalled: set[int] = set()
        finished = len(done)
        started, last_status = time.time(), time.time()
        try:
            while queue or any(slots):
                for i, slot in enumerate(slots):
                    if slot is None and queue and not self.stopping:
                        cell = queue.pop(0)
                        state = "resume" if cell_status(cell) == "partial" else "start"
                        slots[i] = (cell, self._launch(cell, cores[i]), time.time())
                        self.say(f"{state:>6} {cell.name}: {cell.steps} steps, {cell.flops:.3g} FLOPs, "
                                 f"cores {cores[i]}, log {cell.run_dir}/train.log")
                    elif slot is not None and self.stopping and slot[1].pid not in signalled:
                        signalled.add(slot[1].pid)  # once: the trainer saves and exits 3 on its own
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(slot[1].pid, signal.SIGTERM)
                for i, slot in enumerate(slots):
                    if slot is None or slot[1].poll() is None:
                        continue
                    cell, proc, begin = slot
                    slots[i] = None
                    seconds = time.time() - begin
                    if proc.returncode == 0 and cell_status(cell) == "done":
                        finished += 1
                        metric, value = final_loss(Path(cell.run_dir), cell.steps)
                        self.say(f"  done {cell.name} in {seconds:.0f} s: {metric} {value:.4f}")
                    elif proc.returncode == EXIT_PREEMPTED or self.stopping:
                        self.say(f"stopped {cell.name} at step {_last_step(Path(cell.run_dir))} "
                                 f"(exit {proc.returncode}): resumes on re-run")
                    else:
                        failed.append(cell.name)
                        self.say(f"FAILED {cell.name}: exit {proc.returncode}, see {cell.run_dir}/train.log")
                    self.say(f"{_bar(finished, total)} {finished}/{total} done, {sum(s is not None for s in slots)} "
                             f"running, {len(failed)} failed, {time.time() - started:.0f} s")
                if time.time() - last_status > STATUS_EVERY_S:
                    last_status = time.time()
                    running = ", ".join(f"{s[0].name} step {_last_step(Path(s[0].run_dir))}/{s[0].steps}"
                                        for s in slots if s is not None)
                    self.say(f"{_bar(finished, total)} {finished}/{total} done; running: {running}")
                if self.stopping:
                    queue.clear()
                time.sleep(0.5)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if failed:
            self.say(f"{len(failed)} cell(s) failed: {', '.join(failed)}")
            return 1
        return EXIT_PREEMPTED if finished < total else 0


def print_commands(sweep: Sweep, cells: list[Cell], say: Callable[[str], None] = print) -> int:
    """One shell line per unfinished cell, to hand to any scheduler (run from the repository root)."""
    for cell in cells:
        if cell_status(cell) != "done":
            say(cell_shell_command(sweep, cell))
    return 0


def slurm_script(sweep: Sweep, commands_file: Path, n_cells: int) -> str:
    """An sbatch job array with one task per line of `commands_file`; a task that saves and exits 3
    (preempted, or SIGUSR1 before the time limit) requeues itself and resumes from its checkpoint."""
    s = {**SLURM_DEFAULTS, **sweep.slurm}
    log_dir = Path(sweep.out) / "slurm"
    extra = "".join(f"#SBATCH {line}\n" for line in s["extra"])
    return f"""#!/bin/bash
#SBATCH --job-name={sweep.name}
#SBATCH --array=0-{n_cells - 1}%{s['max_parallel']}
#SBATCH --nodes={s['nodes']}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={s['gpus_per_node']}
#SBATCH --cpus-per-task={s['cpus_per_task']}
#SBATCH --time={s['time']}
#SBATCH --signal=B:USR1@{s['signal_seconds']}
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={log_dir}/%A_%a.out
{extra}
# Written by `python launch/sweep.py run --executor slurm`: task i runs line i+1 of
# {commands_file}; re-running the sweep command submits only the cells not yet finished.
set -uo pipefail
cd {shlex.quote(str(REPO))}
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export HEAD
COMMAND=$(sed -n "$((SLURM_ARRAY_TASK_ID + 1))p" {shlex.quote(str(commands_file))})
if [ -z "$COMMAND" ]; then
  echo "no command for array task $SLURM_ARRAY_TASK_ID in {commands_file}" >&2
  exit 2
fi
eval "srun --kill-on-bad-exit=1 $COMMAND" &
PID=$!
trap 'kill -USR1 $PID' USR1
wait $PID; STATUS=$?
while [ $STATUS -gt 128 ] && kill -0 $PID 2>/dev/null; do wait $PID; STATUS=$?; done
if [ "$STATUS" -eq 3 ]; then
  scontrol requeue "${{SLURM_ARRAY_JOB_ID}}_${{SLURM_ARRAY_TASK_ID}}"
fi
exit "$STATUS"
"""


def submit_slurm(sweep: Sweep, cells: list[Cell], say: Callable[[str], None] = print) -> int:
    """Write the commands file and the array script under `<out>/slurm/`, then `sbatch` it."""
    todo = [c for c in cells if cell_status(c) != "done"]
    if not todo:
        say("every cell is finished: nothing to submit")
        return 0
    directory = Path(sweep.out) / "slurm"
    directory.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    commands = directory / f"cells-{stamp}.txt"
    commands.write_text("".join(cell_shell_command(sweep, c) + "\n" for c in todo))
    script = directory / f"array-{stamp}.sbatch"
    script.write_text(slurm_script(sweep, commands.resolve(), len(todo)))
    for cell in todo:
        Path(cell.run_dir).mkdir(parents=True, exist_ok=True)
    try:
        result = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        say(f"sbatch not found on PATH; submit {script} yourself")
        return 2
    if result.returncode != 0:
        say(f"sbatch failed (exit {result.returncode}): {result.stderr.strip()}")
        return result.returncode
    say(f"submitted job array {result.stdout.strip()}: {len(todo)} cells ({len(cells) - len(todo)} already "
        f"finished); script {script}")
    return 0
