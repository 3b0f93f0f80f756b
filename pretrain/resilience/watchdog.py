"""The hang watchdog: a thread that ends a rank stuck in one phase of training, so the job is requeued in
minutes rather than waiting out `engine.dist_timeout_s` and a person.

The training loop (and the engines, for the optimizer) say which phase the main thread enters: a step's
`data`, `forward_backward`, `optimizer` and `step_end` (the log step's reads and the stop agreement),
`evaluation` (every rank, up to a barrier after rank 0's tasks), `checkpoint_commit` (the join of the
previous asynchronous commit, up to a barrier), `checkpoint_save`, `checkpoint_load`, and `finish` (the
last commit, rank 0's closing of the metrics and wandb, the last barrier). A thread checks twice a second
how long the current phase has run. It is a thread, not a signal handler, because a hung rank is usually
blocked inside a C call (a collective waiting for a peer, a device sync, a read), where a Python signal
handler never runs; the thread runs whenever the blocked call has released the GIL, as collectives and
torch ops do. A hang that holds the GIL, or a rank stopped whole, stops that thread too; for them the
rank monitor, a process beside the rank (pretrain/resilience/monitor.py), gets a heartbeat at every phase
and ends the rank MONITOR_AFTER_S after the phase's deadline, once this thread has had its time to.

Past its deadline the thread, in this order and whatever fails: writes the phase, the step and the stacks
of every thread (faulthandler) to the rank's stderr (the job's log); gives each file it then writes
FILE_WAIT_S at most (the run directory may be on the stuck filesystem): `<run dir>/hang_rank<r>.log` and
the requeue marker (`--preempted-marker`, reason "hang"; pretrain/resilience/requeue.py) and
`<run dir>/collectives_rank<r>.json` (torch's flight recorder: the collectives in flight); gives an
asynchronous checkpoint commit in flight COMMIT_GRACE_S to finish, so the newest checkpoint is not lost;
and exits the process with code 3 (os._exit in a `finally`: the main thread is stuck and cannot unwind).
The launcher then ends the other ranks and the requeued job resumes from the newest verified checkpoint.
docs/cluster.md, "What happens when...", has the timeline.

Deadlines: `train.hang_timeout_s` for a step's phases, `eval.hang_timeout_s` for an evaluation,
`checkpoint.hang_timeout_s` for a save, a restore or a commit's join. Unset, each is derived from what has
been measured of that kind of work: MEASURED_FACTOR times the longest one so far, at least HANG_FLOOR_S;
and at least FIRST_TIME_FACTOR times the floor for the first of its kind in a process (a first step may
compile, a first save may create directories on a slow filesystem). The longest durations persist in
`<run dir>/deadlines.json` (rank 0 writes it at each save), so a requeued job starts from what the job
before it measured. A derived deadline stays below `engine.dist_timeout_s` (COLLECTIVE_MARGIN of it): past
that a collective fails by itself, with exit 1 and no requeue; the trainer says so at its start when this
clamps the first-time allowance.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pretrain.config import RunConfig
from pretrain.distributed.process_group import flight_record
from pretrain.resilience import monitor
from pretrain.resilience.monitor import bounded, say
from pretrain.resilience.requeue import EXIT_REQUEUE, HANG, write_marker

EXIT_HANG = EXIT_REQUEUE  # the requeue code, as after a preemption: the job resumes from its newest checkpoint
HANG_FLOOR_S = 300.0
MEASURED_FACTOR = 10.0
FIRST_TIME_FACTOR = 3.0
COLLECTIVE_MARGIN = 0.9
POLL_S = 0.5
FILE_WAIT_S = 10.0  # the most the watchdog waits on each file it writes
COMMIT_GRACE_S = 60.0  # the most it waits for an asynchronous checkpoint commit in flight
MONITOR_AFTER_S = 3 * FILE_WAIT_S + COMMIT_GRACE_S + 30.0  # the monitor process: after the deadline, this more
DEADLINES_FILE = "deadlines.json"
WHO = "hang watchdog"

KIND = {
    "data": "step", "forward_backward": "step", "optimizer": "step", "step_end": "step",
    "evaluation": "eval", "checkpoint_save": "checkpoint", "checkpoint_load": "checkpoint",
    "checkpoint_commit": "commit", "finish": "finish",
}
"""The deadline each phase is held to."""
CONFIG_KEY = {"step": "train.hang_timeout_s", "eval": "eval.hang_timeout_s", "checkpoint": "checkpoint.hang_timeout_s",
              "commit": "checkpoint.hang_timeout_s", "finish": "derived only"}


class Deadlines:
    """Each kind of phase's deadline in seconds: the configured one, else derived from the longest
    duration of that kind observed so far (the module docstring gives the rule)."""

    def __init__(self, configured: dict[str, float | None], collective_timeout_s: float,
                 longest: dict[str, float] | None = None) -> None:
        self.configured = configured
        self.cap = COLLECTIVE_MARGIN * collective_timeout_s
        self.longest: dict[str, float] = dict(longest or {})
        self.seen: set[str] = set()  # kinds finished at least once in this process

    def observe(self, kind: str, seconds: float) -> None:
        """Record one finished piece of work of `kind` (a whole step, an evaluation, a save)."""
        self.longest[kind] = max(seconds, self.longest.get(kind, 0.0))
        self.seen.add(kind)

    def first_time_s(self) -> float:
        """The allowance of a kind's first piece of work in a process, as clamped."""
        return min(FIRST_TIME_FACTOR * HANG_FLOOR_S, self.cap)

    def __call__(self, kind: str) -> float:
        configured = self.configured.get(kind)
        if configured is not None:
            return configured
        derived = max(HANG_FLOOR_S, MEASURED_FACTOR * self.longest.get(kind, 0.0))
        if kind not in self.seen:
            derived = max(derived, FIRST_TIME_FACTOR * HANG_FLOOR_S)
        return min(derived, self.cap)


def load_longest(run_dir: Path) -> dict[str, float]:
    """The longest durations a job before this one measured (none when the file is absent or unreadable:
    the deadlines then start from the first-time allowance)."""
    try:
        raw = json.loads((run_dir / DEADLINES_FILE).read_text())
        return {str(k): float(v) for k, v in raw.items() if k in CONFIG_KEY}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


class Watchdog:
    """Ends this process with EXIT_HANG when its main thread stays in one phase past the phase's
    deadline. `enter` is called by the main thread only; the thread reads one tuple it replaces."""

    def __init__(self, deadlines: Deadlines, rank: int, run_dir: Path, marker: Path | None,
                 beside: monitor.Monitor | None = None) -> None:
        self.deadlines, self.rank, self.marker, self.monitor = deadlines, rank, marker, beside
        self.log_path = run_dir / f"hang_rank{rank}.log"
        self.flight_path = run_dir / f"collectives_rank{rank}.json"
        self.commit_grace: Callable[[float], object] | None = None  # waits for a commit in flight, bounded
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
        deadline = self.deadlines(kind)
        self._current = (phase, step, now, deadline)
        if self.monitor is not None:
            self.monitor.heartbeat.beat(now + deadline + MONITOR_AFTER_S, step, phase)

    def stop(self) -> None:
        """No more phases: the thread and the monitor end (the process is about to leave normally)."""
        if self.monitor is not None:
            self.monitor.stop()
        self._current = None
        self._stopped.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stopped.wait(POLL_S):
            current = self._current
            if current is not None and time.monotonic() - current[2] > current[3]:
                self._fire(*current)

    def _fire(self, phase: str, step: int, entered: float, deadline: float) -> None:
        """Report, mark for requeue and exit; never returns, whatever fails on the way."""
        try:
            elapsed = time.monotonic() - entered
            headline = (
                f"hang: rank {self.rank} has been in phase {phase!r} of step {step} for {elapsed:.0f} s, past its "
                f"deadline of {deadline:.0f} s ({CONFIG_KEY[KIND[phase]]}); writing the requeue marker and exiting "
                f"with code {EXIT_HANG}. Stacks of every thread:\n"
            )
            say(headline)
            faulthandler.dump_traceback(file=2, all_threads=True)
            bounded(lambda: self._write_log(headline), FILE_WAIT_S, f"writing {self.log_path}", WHO)
            if self.marker is not None:
                note = {"step": step, "reason": HANG, "phase": phase, "rank": self.rank}
                bounded(lambda: write_marker(self.marker, note, self.rank), FILE_WAIT_S,
                        f"writing the requeue marker {self.marker}", WHO)
            bounded(self._write_flight_record, FILE_WAIT_S, f"writing {self.flight_path}", WHO)
            if self.commit_grace is not None and phase != "checkpoint_commit":
                grace = self.commit_grace
                bounded(lambda: grace(COMMIT_GRACE_S), COMMIT_GRACE_S + 1.0, "the checkpoint commit in flight", WHO)
        finally:
            os._exit(EXIT_HANG)

    def _write_flight_record(self) -> None:
        """The collectives this rank made last, those in flight among them (torch's flight recorder)."""
        record = flight_record()
        if record is not None:
            self.flight_path.write_bytes(record)

    def _write_log(self, headline: str) -> None:
        with open(self.log_path, "a") as log:
            log.write(headline)
            log.flush()
            faulthandler.dump_traceback(file=log, all_threads=True)


_active: Watchdog | None = None


def start_for(cfg: RunConfig, rank: int, marker: Path | None) -> Deadlines:
    """Start the watchdog of this rank of the run `cfg` describes (the one `phase` reports to), from the
    longest durations a job before this one measured, and its monitor process; both write `marker` when
    they end the rank."""
    global _active
    configured = {"step": cfg.train.hang_timeout_s, "eval": cfg.eval.hang_timeout_s,
                  "checkpoint": cfg.checkpoint.hang_timeout_s, "commit": cfg.checkpoint.hang_timeout_s}
    run_dir = Path(cfg.run.dir)
    deadlines = Deadlines(configured, cfg.engine.dist_timeout_s, load_longest(run_dir))
    _active = Watchdog(deadlines, rank, run_dir, marker, monitor.start(rank, marker, _stderr_with_fd()))
    _active.start()
    return deadlines


def guard_commit(grace: Callable[[float], object]) -> None:
    """`grace(seconds)` waits that long at most for an asynchronous checkpoint commit in flight: the
    watchdog calls it before it exits, so that the newest checkpoint is not lost."""
    if _active is not None:
        _active.commit_grace = grace


def save_longest(run_dir: Path) -> None:
    """Write the active watchdog's longest durations to `<run dir>/deadlines.json` (rank 0, at a save)."""
    if _active is None:
        return
    tmp = run_dir / f"{DEADLINES_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(_active.deadlines.longest, sort_keys=True) + "\n")
    os.replace(tmp, run_dir / DEADLINES_FILE)


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


def _stderr_with_fd() -> Any:
    """sys.stderr if it is backed by a file descriptor (faulthandler writes to one from a C handler), else
    the process's original stderr (a captured or redirected sys.stderr, as under pytest's capsys)."""
    try:
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, OSError, ValueError):
        return sys.__stderr__
