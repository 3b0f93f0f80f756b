"""The rank monitor: a small process beside each training rank that ends the rank when its hang watchdog
cannot.

The watchdog (pretrain/resilience/watchdog.py) is a thread of the rank. It cannot run while the rank
holds the GIL in C code (a regular expression that backtracks for hours, a C extension's loop) or while
the whole process is stopped (SIGSTOP, a debugger, a kernel that has frozen it). So the watchdog also
starts this process (`start`), and at every phase the rank writes its heartbeat into a 48-byte shared
memory page (`Heartbeat`): when the monitor must act (the phase's deadline plus the watchdog's own time
to report and exit), the phase and the step. Writing it costs no system call.

The monitor reads the page every POLL_S. Past the time written there, and still so POLL_S later (a torn
read is never acted on), it ends the rank, in this order and whatever fails:

1. writes a headline and the rank's state in the kernel (/proc: "T (stopped)", "D (disk sleep)" and what
   it waits in) to its stderr, which is the rank's (the job's log);
2. sends DUMP_SIGNAL, for which the rank has registered faulthandler (a C handler: it runs with the GIL
   held elsewhere) to write every thread's stack to its stderr, and SIGCONT (a stopped rank handles
   nothing until it runs again), then waits DUMP_WAIT_S;
3. writes the requeue marker (reason "hang", `"by": "monitor"`), FILE_WAIT_S at most;
4. sends EXIT_SIGNAL, SIGQUIT, whose C handler in the rank is libc's `_exit`: it is called with the
   signal's number, 3, which is the hang's exit code (EXIT_HANG); this too runs with the GIL held;
5. after EXIT_WAIT_S, SIGKILL (exit status 137) if the rank is still there.

The monitor leaves when its rank does, whichever way: its stdin is a pipe from the rank, which the
kernel closes when the rank exits (and `Monitor.stop` closes first on a normal end). It ignores the
signals a launcher or a terminal sends to the whole process group (SIGINT, SIGTERM, SIGUSR1): the rank
decides what they mean. It imports nothing heavy (no torch): eight ranks per node start eight monitors.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import math
import mmap
import os
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from pretrain.resilience.requeue import EXIT_REQUEUE, HANG, write_marker

POLL_S = 0.5
DUMP_WAIT_S = 2.0  # after asking the rank for its stacks
FILE_WAIT_S = 10.0  # the most the monitor waits on the marker's write (the filesystem may be stuck)
EXIT_WAIT_S = 5.0  # after SIGQUIT, before SIGKILL
DUMP_SIGNAL = signal.SIGUSR2
EXIT_SIGNAL = signal.SIGQUIT
if EXIT_SIGNAL != EXIT_REQUEUE:  # the rank's C handler exits with the signal's number
    raise AssertionError(f"SIGQUIT is {int(EXIT_SIGNAL)}, not the hang exit code {EXIT_REQUEUE}")
LAYOUT = struct.Struct("dd32s")  # act at (monotonic s; 0: nothing to watch), step, phase (ASCII)
IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
WHO = "rank monitor"


class Heartbeat:
    """The shared page: the rank writes, its monitor reads. Both use CLOCK_MONOTONIC, which is the
    machine's, not the process's."""

    def __init__(self, fileno: int) -> None:
        self.page = mmap.mmap(fileno, LAYOUT.size)

    def beat(self, act_at: float, step: int, phase: str) -> None:
        """From the rank: past `act_at` in phase `phase` of step `step`, the monitor ends it."""
        self.page[:] = LAYOUT.pack(act_at, float(step), phase.encode()[:32])

    def read(self) -> tuple[float, int, str]:
        act_at, step, phase = LAYOUT.unpack(self.page[:])
        return act_at, int(step), phase.rstrip(b"\0").decode(errors="replace")


class Monitor:
    """The rank's side: the monitor process it started and the page it beats into."""

    def __init__(self, process: subprocess.Popen, heartbeat: Heartbeat, restore: Callable[[], object]) -> None:
        self.process, self.heartbeat, self.restore = process, heartbeat, restore

    def stop(self) -> None:
        """The rank ends normally: nothing to watch, the pipe closed, the monitor gone, the rank's signal
        handlers as they were."""
        self.heartbeat.beat(0.0, 0, "")
        self.restore()
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=5 * POLL_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start(rank: int, marker: Path | None, stderr: IO[Any]) -> Monitor:
    """From the rank: arm its C handlers (DUMP_SIGNAL: faulthandler's stacks to `stderr`; EXIT_SIGNAL:
    libc's `_exit`) and start its monitor process, which writes `marker` when it acts."""
    faulthandler.register(DUMP_SIGNAL, file=stderr, all_threads=True, chain=False)
    libc = ctypes.CDLL(None)
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal.restype = ctypes.c_void_p
    before = libc.signal(int(EXIT_SIGNAL), ctypes.cast(libc._exit, ctypes.c_void_p))

    def restore() -> None:
        faulthandler.unregister(DUMP_SIGNAL)
        libc.signal(int(EXIT_SIGNAL), before)
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    # the page: a file in the local /tmp, unlinked at once; the mapping and the child's descriptor keep it
    with tempfile.TemporaryFile(prefix=f"heartbeat_rank{rank}_") as page:
        page.truncate(LAYOUT.size)
        heartbeat = Heartbeat(page.fileno())
        heartbeat.beat(0.0, 0, "")
        process = subprocess.Popen(
            [sys.executable, "-m", "pretrain.resilience.monitor", str(os.getpid()), str(rank), str(page.fileno()),
             str(marker or "")], stdin=subprocess.PIPE, pass_fds=[page.fileno()], env=env)
    return Monitor(process, heartbeat, restore)


def say(text: str) -> None:
    """Write `text` to stderr's descriptor, whatever sys.stderr is, and never fail."""
    with contextlib.suppress(OSError):
        os.write(2, text.encode())


def _kernel_state(pid: int) -> str:
    """The rank's state and wait channel in the kernel (what a rank stuck there is waiting in)."""
    try:
        state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State"))
        return f"{state.strip()}, waiting in {Path(f'/proc/{pid}/wchan').read_text() or '-'}"
    except (OSError, StopIteration):
        return "state unknown"


def bounded(action: Callable[[], object], seconds: float, what: str, who: str) -> bool:
    """Run `action` in a daemon thread and wait for it `seconds` at most (a write to a stuck filesystem
    blocks in the kernel, where nothing can interrupt it; the thread is left behind). Whether it finished
    without an error; a line on stderr from `who` says what went wrong otherwise."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            action()
        except BaseException as err:  # reported below, whatever it is: the caller must go on
            failure.append(err)

    thread = threading.Thread(target=run, name=f"{who}-{what}", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        say(f"{who}: gave up on {what} after {seconds:.0f} s (a stuck filesystem?)\n")
        return False
    if failure:
        say(f"{who}: {what} failed: {failure[0]!r}\n")
        return False
    return True


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _running(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie waiting for its parent has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _alive(pid: int, seconds: float) -> bool:
    """Whether `pid` is still running after waiting `seconds` at most for it to exit."""
    until = time.monotonic() + seconds
    while _running(pid) and time.monotonic() < until:
        time.sleep(0.05)
    return _running(pid)


def end_rank(pid: int, rank: int, marker: Path | None, beat: tuple[float, int, str]) -> None:
    """Report, mark and end the rank `pid`, which stayed in one phase past its time (the module
    docstring lists the steps)."""
    act_at, step, phase = beat
    say(f"{WHO}: rank {rank} (pid {pid}) stayed in phase {phase!r} of step {step} "
         f"{time.monotonic() - act_at:.0f} s past its deadline and the time its watchdog had to end it; it is "
         f"{_kernel_state(pid)}. Asking it for its stacks, writing the requeue marker and ending it with code "
         f"{int(EXIT_SIGNAL)}.\n")
    _signal(pid, DUMP_SIGNAL)
    _signal(pid, signal.SIGCONT)
    _alive(pid, DUMP_WAIT_S)
    if marker is not None:
        note = {"step": step, "reason": HANG, "phase": phase, "rank": rank, "by": "monitor"}
        bounded(lambda: write_marker(marker, note, rank), FILE_WAIT_S, f"writing the requeue marker {marker}",
                WHO)
    _signal(pid, EXIT_SIGNAL)
    if _alive(pid, EXIT_WAIT_S):
        say(f"{WHO}: rank {rank} did not exit on SIGQUIT; SIGKILL\n")
        _signal(pid, signal.SIGKILL)


def watch(pid: int, rank: int, heartbeat: Heartbeat, marker: Path | None, rank_pipe: int) -> None:
    """The monitor's loop: until the rank's pipe closes, end the rank once it is past its time."""
    due: tuple[float, int, str] | None = None
    while True:
        readable, _, _ = select.select([rank_pipe], [], [], POLL_S)
        if readable and not os.read(rank_pipe, 4096):
            return  # the rank has ended, or stopped its monitor
        beat = heartbeat.read()
        past = 0.0 < beat[0] < math.inf and time.monotonic() > beat[0]
        if past and beat == due:  # the same past-due heartbeat twice, POLL_S apart
            end_rank(pid, rank, marker, beat)
            return
        due = beat if past else None


def main(argv: list[str]) -> None:
    pid, rank, fileno, marker = int(argv[0]), int(argv[1]), int(argv[2]), argv[3]
    for sig in IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    watch(pid, rank, Heartbeat(fileno), Path(marker) if marker else None, sys.stdin.fileno())


if __name__ == "__main__":
    main(sys.argv[1:])
