"""Run launch/pretrain.py the way users do: plain python, the deepspeed launcher, torchrun."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
ENTRY = str(REPO / "launch" / "pretrain.py")
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_tree(pid: int) -> None:
    """SIGKILL a launcher and every process below it. torchrun starts its workers in sessions of
    their own, so killing the launcher's process group alone would leave them running."""
    try:
        family = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    for proc in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(family, timeout=30)


def launch_command(launcher: str, ranks: int, entry: str = ENTRY) -> list[str]:
    """The command prefix for `launcher` in {"python", "deepspeed", "torchrun"} with `ranks` ranks,
    running the script `entry` (the trainer's entry point unless given)."""
    if launcher == "python":
        return [sys.executable, entry]
    if launcher == "deepspeed":
        return [str(BIN / "deepspeed"), "--num_gpus", str(ranks), "--master_port", str(free_port()), entry]
    if launcher == "torchrun":
        return [
            str(BIN / "torchrun"), "--nproc_per_node", str(ranks), "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), entry,
        ]
    raise ValueError(launcher)


def run_training(
    launcher: str, ranks: int, args: list[str], timeout: float = 600, check: bool = True, entry: str = ENTRY
) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with subprocess.Popen(
        [*launch_command(launcher, ranks, entry), *args], cwd=REPO, env=env, text=True, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    ) as popen:
        try:
            stdout, stderr = popen.communicate(timeout=timeout)
        finally:  # the launcher's ranks go too, even on a timeout or an interrupt
            kill_tree(popen.pid)
            popen.wait()
    proc = subprocess.CompletedProcess(popen.args, popen.returncode, stdout, stderr)
    if check and proc.returncode != 0:
        output = f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        raise AssertionError(f"{launcher} x{ranks} exited {proc.returncode}:\n{output}")
    return proc


def logged(run_dir: Path, key: str) -> list[float]:
    """The values of one metric in metrics.jsonl, in the order they were logged."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in records if key in r]


def losses(run_dir: Path) -> list[float]:
    """The training loss of every logged step, in order."""
    return logged(run_dir, "train/loss")
