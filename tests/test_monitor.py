"""The rank monitor (pretrain/resilience/monitor.py): a process beside the rank that ends it when its
watchdog thread cannot run (the GIL held in C code, the whole process stopped), with the hang's exit code,
its stacks on stderr and the requeue marker; and that never outlives its rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from pretrain.resilience.monitor import DUMP_WAIT_S, POLL_S
from pretrain.resilience.requeue import EXIT_REQUEUE
from tests.launchers import REPO
from tests.test_hang import _blocked_rank

AFTER_S = 2.0
BOUND_S = AFTER_S + 2 * POLL_S + DUMP_WAIT_S + 10  # the monitor's wait, its steps, start-up on a loaded machine
ENV = dict(os.environ, PYTHONPATH=str(REPO))
BESIDE = """
    import os, re, signal, sys, time
    from pathlib import Path
    from pretrain.resilience import monitor
    beside = monitor.start(0, {marker}, sys.stderr)
    beside.heartbeat.beat(time.monotonic() + {after}, 7, "forward_backward")
"""


def test_a_rank_holding_the_gil_is_ended_by_its_monitor(tmp_path: Path) -> None:
    """A regular expression that backtracks for hours never releases the GIL, so no thread of the rank runs
    (its watchdog's neither): past the time in its heartbeat, the monitor has the rank dump its stacks (a C
    signal handler), writes the marker and ends it with the hang's code."""
    marker = tmp_path / "marker.json"
    script = textwrap.dedent(BESIDE.format(marker=f"Path({str(marker)!r})", after=AFTER_S)) + \
        "re.match(r'(a+)+$', 'a' * 64 + 'b')\n"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=120)
    took = time.monotonic() - started
    assert done.returncode == EXIT_REQUEUE, done.stderr[-3000:]
    assert took < BOUND_S, took
    assert json.loads(marker.read_text()) == {"step": 7, "reason": "hang", "phase": "forward_backward", "rank": 0,
                                              "by": "monitor"}
    headline = "rank monitor: rank 0 (pid "
    assert headline in done.stderr and "stayed in phase 'forward_backward' of step 7" in done.stderr
    stacks = done.stderr[done.stderr.index(headline):]
    assert "Current thread 0x" in stacks and " in match" in stacks  # the main thread, inside re.match
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.slow
@pytest.mark.parametrize("block", ["re.match(r'(a+)+$', 'a' * 64 + 'b')",
                                   "os.kill(os.getpid(), __import__('signal').SIGSTOP); os.read(os.pipe()[0], 1)"],
                         ids=["gil", "stopped"])
def test_the_watchdogs_monitor_ends_a_rank_its_thread_cannot(block: str, tmp_path: Path) -> None:
    """Through the watchdog (which beats at every phase): a rank holding the GIL, and a rank stopped whole
    (SIGSTOP: no thread of it runs), end with the hang's code within the deadline (1 s), MONITOR_AFTER_S
    (made 2 s) and the monitor's own steps; the stopped one is reported stopped in the kernel."""
    marker = tmp_path / "marker.json"
    done, took = _blocked_rank(tmp_path, marker, block, prelude=f"watchdog.MONITOR_AFTER_S = {AFTER_S}")
    assert done.returncode == EXIT_REQUEUE, done.stderr[-3000:]
    assert took < 1 + BOUND_S + 10, took  # and torch's import
    assert "rank monitor: rank 0" in done.stderr and "of step 7" in done.stderr and "Thread 0x" in done.stderr
    note = json.loads(marker.read_text())
    assert note["reason"] == "hang" and note["step"] == 7 and note["phase"] == "data"
    if "SIGSTOP" in block:
        assert "T (stopped)" in done.stderr
    else:
        assert note["by"] == "monitor" and "hang: rank 0 has been in phase" not in done.stderr


def _monitor_of(rank: subprocess.Popen) -> psutil.Process:
    """The monitor process the rank `rank` has started (once it runs the monitor's code)."""
    for _ in range(200):
        children = psutil.Process(rank.pid).children()
        if children and "pretrain.resilience.monitor" in children[0].cmdline():
            return children[0]
        time.sleep(0.05)
    raise AssertionError("the rank started no monitor")


def _gone(process: psutil.Process, seconds: float) -> bool:
    """Whether `process` has ended (a zombie left for its new parent to reap counts) within `seconds`."""
    try:
        process.wait(timeout=seconds)
        return True
    except psutil.TimeoutExpired:
        return process.status() == psutil.STATUS_ZOMBIE


def test_the_monitor_never_outlives_its_rank() -> None:
    """A rank that stops its monitor, one that leaves without stopping it, and one killed outright (SIGKILL:
    no code of it runs) each leave no monitor behind, and none was ended by it."""
    setup = textwrap.dedent(BESIDE.format(marker=None, after=600)) + "sys.stdin.readline()\n"
    for ending in ("beside.stop()", "pass", "time.sleep(600)"):
        rank = subprocess.Popen([sys.executable, "-c", setup + ending], cwd=REPO, env=ENV, stdin=subprocess.PIPE)
        monitor = _monitor_of(rank)
        if ending == "time.sleep(600)":
            rank.send_signal(signal.SIGKILL)
        else:
            rank.communicate(b"\n", timeout=30)
        assert rank.wait(timeout=30) == (-signal.SIGKILL if ending == "time.sleep(600)" else 0)
        assert _gone(monitor, 5 * POLL_S), (ending, monitor)


def test_a_stopped_monitor_leaves_the_ranks_signal_handlers_as_they_were() -> None:
    """After `stop`, SIGQUIT is back to its default (the rank's process dumps core and dies by it, rather
    than exiting 3) and SIGUSR2 is no longer faulthandler's. The rank starts with SIGQUIT at its default
    (a shell's background job inherits it ignored, which `stop` would rightly restore)."""
    start = "import signal\nsignal.signal(signal.SIGQUIT, signal.SIG_DFL)\n"
    script = start + textwrap.dedent(BESIDE.format(marker=None, after=600)) + textwrap.dedent("""
        beside.stop()
        import faulthandler, resource
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file
        assert not faulthandler.unregister(signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGQUIT)
        time.sleep(5)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == -signal.SIGQUIT, done.stderr[-2000:]
