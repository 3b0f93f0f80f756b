"""How a job ends and whether it comes back: the exit codes, the stop signals (`StopFlag`), the requeue
marker, and the bounded requeue.

The trainer (after a preemption save) or a rank's hang watchdog writes the **requeue marker**, a JSON
note at the path `--preempted-marker` names; the batch script (launch/slurm/job.sh) requeues the job on
it. A requeue that cannot help must not loop: a hang repeated at the same step, or a watchdog that
misfires the same way every time, would otherwise requeue forever, each turn redoing up to
`checkpoint.every` steps. So the batch script asks this module before it requeues:

    python -m pretrain.resilience.requeue begin  --config C [key=value ...]   # before the job's ranks start
    python -m pretrain.resilience.requeue decide --config C --marker M [key=value ...]   # after they end

`begin` records in `<run dir>/requeue.json` the newest committed checkpoint step as the job starts (a
fresh submission, SLURM_RESTART_COUNT 0, also clears the count). `decide` compares the newest committed
step now with it: a job that committed a newer step made progress and is requeued (the count goes back
to 0); a preemption is requeued and never counted; any other requeue (a hang) without progress adds one
to the count, and past `train.max_no_progress_requeues` the job stops with exit EXIT_NO_PROGRESS and the
line "no progress since step N after K requeues: <reason>". The state lives in the run directory, so it
survives requeues; the answer is the exit status (0: requeue).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

EXIT_DONE = 0  # trained to train.steps, or nothing was left to do
EXIT_BAD_INPUT = 2  # bad config, data, a held run or an unusable checkpoint: nothing computed or written
EXIT_REQUEUE = 3  # preempted or interrupted after a save, or a rank hung past its deadline: requeue the job
EXIT_DIVERGED = 4  # non-finite loss under nan_policy=stop (or too many skipped steps), or spikes past the budget
EXIT_NO_PROGRESS = 5  # the batch script: requeued train.max_no_progress_requeues times without a newer checkpoint
EXIT_ABORTED = 130  # the shell's code for a process ended by SIGINT: a second Ctrl-C, nothing saved

STATE_FILE = "requeue.json"
HANG = "hang"


def write_marker(path: Path, note: dict[str, Any], rank: int = 0) -> None:
    """Atomically write the JSON note the batch scripts requeue on. The temporary file is this rank's and
    this process's own, so that ranks writing at once never replace each other's half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.rank{rank}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(note) + "\n")
    os.replace(tmp, path)


def write_preempted_marker(path: Path, step: int, checkpoint: str | None, signum: int | None) -> None:
    """Atomically write the JSON note that asks the batch script to requeue this job."""
    reason = signal.Signals(signum).name if signum else "max_runtime"
    write_marker(path, {"step": step, "checkpoint": checkpoint, "reason": reason})


def describe(note: dict[str, Any]) -> str:
    """One line for a marker: why the job stopped, and where."""
    if note.get("reason") == HANG:
        return (f"rank {note.get('rank', '?')} hung in phase {note.get('phase', '?')!r} of step "
                f"{note.get('step', '?')}")
    return f"stopped by {note.get('reason', 'an unknown reason')} at step {note.get('step', '?')}"


class StopFlag:
    """Set by SIGTERM / SIGUSR1, and by a first SIGINT (Ctrl-C): checked (and agreed on by all ranks)
    at step boundaries, where the run saves and exits with EXIT_REQUEUE. A second SIGINT raises
    KeyboardInterrupt at once: stop without saving."""

    def __init__(self) -> None:
        self.signal: int | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGINT:
            if self.signal == signal.SIGINT:
                raise KeyboardInterrupt
            os.write(2, b"Ctrl-C: saving a checkpoint after this step, then stopping (Ctrl-C again: stop now, "
                        b"unsaved)\n")
        self.signal = signum


@dataclass
class RequeueState:
    """What `<run dir>/requeue.json` holds: the newest committed step when the current job started, and
    how many requeues in a row found no newer one."""

    committed_step: int = 0
    no_progress_requeues: int = 0


def load_state(run_dir: Path) -> RequeueState:
    path = run_dir / STATE_FILE
    if not path.exists():
        return RequeueState()
    try:
        raw = json.loads(path.read_text())
        return RequeueState(int(raw["committed_step"]), int(raw["no_progress_requeues"]))
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a requeue state ({err}); expected JSON with integer keys "
                         "committed_step and no_progress_requeues; delete the file to start the count afresh") from err


def save_state(run_dir: Path, state: RequeueState) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f"{STATE_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(asdict(state)) + "\n")
    os.replace(tmp, run_dir / STATE_FILE)


def newest_committed_step(checkpoint_root: str) -> int:
    """The step of the newest committed checkpoint under `checkpoint_root` (0: none). Listing only: a batch
    script cannot afford to hash a large checkpoint, and the trainer verifies what it resumes from."""
    from pretrain.checkpoint.layout import step_number
    from pretrain.checkpoint.manifest import committed_steps

    names = committed_steps(checkpoint_root)
    return step_number(names[0]) if names else 0


def begin(run_dir: Path, committed: int, restart_count: int) -> RequeueState:
    """A job starts: remember the newest committed step; a fresh submission also clears the count."""
    state = load_state(run_dir)
    state.committed_step = committed
    if restart_count == 0:
        state.no_progress_requeues = 0
    save_state(run_dir, state)
    return state


def decide(run_dir: Path, committed: int, note: dict[str, Any], limit: int) -> tuple[bool, str]:
    """A job ended with the requeue marker `note`: (requeue?, the line that says why)."""
    state = load_state(run_dir)
    why = describe(note)
    if committed > state.committed_step:
        verdict = (True, f"requeue: {why}; the newest checkpoint moved from step {state.committed_step} to {committed}")
        state.no_progress_requeues = 0
    elif note.get("reason") != HANG:
        verdict = (True, f"requeue: {why}; a preemption is not counted as no progress "
                         f"({state.no_progress_requeues} requeue(s) without progress so far)")
    elif state.no_progress_requeues >= limit:
        verdict = (False, f"no progress since step {state.committed_step} after {state.no_progress_requeues} "
                          f"requeues: {why} (train.max_no_progress_requeues={limit}); not requeued")
    else:
        state.no_progress_requeues += 1
        verdict = (True, f"requeue: {why}; no checkpoint newer than step {state.committed_step}: requeue "
                         f"{state.no_progress_requeues} of train.max_no_progress_requeues={limit} without progress")
    state.committed_step = committed
    save_state(run_dir, state)
    return verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("begin", "decide"))
    parser.add_argument("--config", required=True)
    parser.add_argument("--marker", help="decide: the requeue marker the job left")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args(argv)
    from pretrain.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:  # the trainer says the same at its start, and exits 2
        print(f"requeue {args.action}: config error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    run_dir = Path(cfg.run.dir)
    committed = newest_committed_step(cfg.checkpoint.dir or str(run_dir / "checkpoints"))
    try:
        if args.action == "begin":
            state = begin(run_dir, committed, int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0))
            print(f"requeue state ({run_dir / STATE_FILE}): newest checkpoint at step {state.committed_step}, "
                  f"{state.no_progress_requeues} requeue(s) without progress so far")
            return EXIT_DONE
        note = json.loads(Path(args.marker).read_text())
        requeue, line = decide(run_dir, committed, note, cfg.train.max_no_progress_requeues)
    except (OSError, ValueError) as err:
        print(f"requeue {args.action}: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(line)
    return EXIT_DONE if requeue else EXIT_NO_PROGRESS


if __name__ == "__main__":
    sys.exit(main())
