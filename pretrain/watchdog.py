"""The hang watchdog: a thread that ends a rank stuck in one phase of training, so the job is requeued in
minutes rather than waiting out `engine.dist_timeout_s` and a person.

The training loop (and the engines, for the optimizer) say which phase the main thread enters: a step's
`data`, `forward_backward`, `optimizer` and `step_end` (the log step's reads and the stop agreement),
`evaluation`, `checkpoint_save`, `checkpoint_load`. A thread checks twice a second how long the current
phase has run. It is a thread, not a signal handler, because a hung rank is usually blocked inside a C
call (a collective waiting for a peer, a device sync, a read), where a Python signal handler never runs;
the thread runs whenever the blocked call has released the GIL, as collectives and torch ops do.

Past its deadline the thread writes the phase, the step and the stacks of every thread (faulthandler) to
the rank's stderr (the job's log) and to `<run dir>/hang_rank<r>.log`, writes the requeue marker the
batch scripts already requeue on (`--preempted-marker`, reason "hang"), and exits the process with
code 3 (os._exit: the main thread is stuck and cannot unwind). The launcher then ends the other ranks
(srun --kill-on-bad-exit, the DeepSpeed launcher, torchrun) and the requeued job resumes from the newest
verified checkpoint. docs/cluster.md, "What happens when...", has the timeline.

Deadlines: `train.hang_timeout_s` for a step's phases, `eval.hang_timeout_s` for an evaluation,
`checkpoint.hang_timeout_s` for a save or a restore. Unset, each is derived from what this process has
measured of that kind of work: MEASURED_FACTOR times the longest one so far, at least HANG_FLOOR_S; and
FIRST_TIME_FACTOR times the floor while nothing has been measured yet (a first step may compile, a first
save may create directories on a slow filesystem). A derived deadline stays below
`engine.dist_timeout_s` (COLLECTIVE_MARGIN of it): past that a collective fails by itself, with exit 1
and no requeue.
"""

from __future__ import annotations

import faulthandler
import json
import os
import threading
import time
from pathlib import Path

from pretrain.config import RunConfig

EXIT_HANG = 3  # the requeue code, as after a preemption: the job resumes from its newest checkpoint
HANG_FLOOR_S = 300.0
MEASURED_FACTOR = 10.0
FIRST_TIME_FACTOR = 3.0
COLLECTIVE_MARGIN = 0.9
POLL_S = 0.5

KIND = {
    "data": "step", "forward_backward": "step", "optimizer": "step", "step_end": "step",
    "evaluation": "eval", "checkpoint_save": "checkpoint", "checkpoint_load": "checkpoint",
}
"""The deadline each phase is held to: the step's, the evaluation's or the checkpoint's."""
CONFIG_KEY = {"step": "train.hang_timeout_s", "eval": "eval.hang_timeout_s", "checkpoint": "checkpoint.hang_timeout_s"}


def write_requeue_marker(path: Path, note: dict[str, object]) -> None:
    """Atomically write the JSON note on which the batch scripts requeue the job (launch/slurm/job.sh)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(note) + "\n")
    os.replace(tmp, path)


class Deadlines:
    """Each kind of phase's deadline in seconds: the configured one, else derived from the longest
    duration of that kind observed so far (the module docstring gives the rule)."""

    def __init__(self, configured: dict[str, float | None], collective_timeout_s: float) -> None:
        self.configured = configured
        self.cap = COLLECTIVE_MARGIN * collective_timeout_s
        self.longest: dict[str, float] = {}

    def observe(self, kind: str, seconds: float) -> None:
        """Record one finished piece of work of `kind` (a whole step, an evaluation, a save)."""
        self.longest[kind] = max(seconds, self.longest.get(kind, 0.0))

    def __call__(self, kind: str) -> float:
        configured = self.configured.get(kind)
        if configured is not None:
            return configured
        if kind in self.longest:
            derived = max(HANG_FLOOR_S, MEASURED_FACTOR * self.longest[kind])
        else:
            derived = FIRST_TIME_FACTOR * HANG_FLOOR_S
        return min(derived, self.cap)


class Watchdog:
    """Ends this process with EXIT_HANG when its main thread stays in one phase past the phase's
    deadline. `enter` is called by the main thread only; the thread reads one tuple it replaces."""

    def __init__(self, deadlines: Deadlines, rank: int, run_dir: Path, marker: Path | None) -> None:
        self.deadlines, self.rank, self.marker = deadlines, rank, marker
        self.log_path = run_dir / f"hang_rank{rank}.log"
        self._current: tuple[str, int, float, float] | None = None  # phase, step, entered, deadline
        self._unit: tuple[str, float] | None = None  # the kind of work under way and when it began
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def enter(self, phase: str, step: int | None = None) -> None:
        """The main thread begins `phase` of step `step` (the step being made, or the last one made;
        None: the step of the phase before). A new step (`data`) or a change of kind closes the work
        under way and records its duration."""
        now = time.monotonic()
        if step is None:
            step = self._current[1] if self._current is not None else 0
        kind = KIND[phase]
        if self._unit is not None and (phase == "data" or kind != self._unit[0]):
            self.deadlines.observe(self._unit[0], now - self._unit[1])
            self._unit = None
        if self._unit is None:
            self._unit = (kind, now)
        self._current = (phase, step, now, self.deadlines(kind))

    def stop(self) -> None:
        """No more phases: the thread ends (the process is about to leave normally)."""
        self._current = None
        self._stopped.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stopped.wait(POLL_S):
            current = self._current
            if current is not None and time.monotonic() - current[2] > current[3]:
                self._fire(*current)

    def _fire(self, phase: str, step: int, entered: float, deadline: float) -> None:
        """Report, mark for requeue and exit; never returns."""
        elapsed = time.monotonic() - entered
        headline = (
            f"hang: rank {self.rank} has been in phase {phase!r} of step {step} for {elapsed:.0f} s, past its "
            f"deadline of {deadline:.0f} s ({CONFIG_KEY[KIND[phase]]}); writing the requeue marker and exiting "
            f"with code {EXIT_HANG}. Stacks of every thread:\n"
        )
        with open(self.log_path, "a") as log:
            for fd in (2, log.fileno()):
                os.write(fd, headline.encode())
                faulthandler.dump_traceback(file=fd, all_threads=True)
        if self.marker is not None:
            write_requeue_marker(self.marker, {"step": step, "reason": "hang", "phase": phase, "rank": self.rank})
        os._exit(EXIT_HANG)


_active: Watchdog | None = None


def start_for(cfg: RunConfig, rank: int, marker: Path | None) -> None:
    """Start the watchdog of this rank of the run `cfg` describes (the one `phase` reports to); it writes
    `marker` when it fires."""
    global _active
    configured = {"step": cfg.train.hang_timeout_s, "eval": cfg.eval.hang_timeout_s,
                  "checkpoint": cfg.checkpoint.hang_timeout_s}
    _active = Watchdog(Deadlines(configured, cfg.engine.dist_timeout_s), rank, Path(cfg.run.dir), marker)
    _active.start()


def stop() -> None:
    """Stop the active watchdog (if any)."""
    global _active
    if _active is not None:
        _active.stop()
        _active = None


def phase(name: str, step: int | None = None) -> None:
    """Tell the active watchdog (none in a process that is not training) the main thread enters `name`
    (of step `step`; None: the step it is in)."""
    if _active is not None:
        _active.enter(name, step)


def deadline(kind: str) -> float | None:
    """The active watchdog's deadline now for phases of `kind` ("step", "eval", "checkpoint"); None
    without a watchdog."""
    return None if _active is None else _active.deadlines(kind)
