"""One trainer per run: the run directory's lock and the object-store lease (pretrain/checkpoint/run_lock.py)."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import time
from pathlib import Path

import fsspec
import pytest

from launch.pretrain import EXIT_BAD_INPUT, main
from pretrain.checkpoint import run_lock
from pretrain.checkpoint.run_lock import LEASE_FILE, LOCK_FILE, RunLock, RunLockedError
from tests.test_trainer import TINY, data_overrides

REPO = Path(__file__).resolve().parents[1]

HOLD = """
import sys, time
from pathlib import Path
from pretrain.checkpoint.run_lock import RunLock
lock = RunLock(Path(sys.argv[1]), sys.argv[1] + "/checkpoints")
lock.acquire()
print("held", flush=True)
time.sleep(120)
"""


@pytest.fixture
def holder(tmp_path: Path):
    """A live process of its own holding the run directory tmp_path/run."""
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield run, proc.pid
    proc.kill()
    proc.wait()


def test_a_second_trainer_is_refused_and_writes_nothing(holder, demo_shards: dict[str, str], capsys) -> None:
    run, pid = holder
    (run / "config.yaml").write_text("theirs\n")
    assert main(["--config", TINY, *data_overrides(demo_shards, run)]) == EXIT_BAD_INPUT
    captured = capsys.readouterr()
    assert f"pid {pid}" in captured.out + captured.err and str(run / LOCK_FILE) in captured.out + captured.err
    assert (run / "config.yaml").read_text() == "theirs\n"
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()


def test_the_lock_is_free_again_once_its_holder_dies(tmp_path: Path, holder, caplog) -> None:
    run, pid = holder
    with pytest.raises(RunLockedError, match=f"in use by another trainer .*pid {pid}"):
        RunLock(run, str(run / "checkpoints")).acquire()
    subprocess.run(["kill", "-9", str(pid)], check=True)
    time.sleep(0.2)
    lock = RunLock(run, str(run / "checkpoints"))
    with caplog.at_level(logging.WARNING):
        lock.acquire()  # the kernel let go when the holder died, as after a SIGKILL or a node crash
    assert f"pid {pid}" in caplog.text and "gone" in caplog.text
    lock.release()


def test_a_dead_holders_lock_is_taken_over_with_a_warning(tmp_path: Path, caplog) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": 999_999_999}))
    lock = RunLock(run, str(run / "checkpoints"))
    with caplog.at_level(logging.WARNING):
        lock.acquire()
    assert "trainer that is gone" in caplog.text and "999999999" in caplog.text
    lock.release()
    assert (run / LOCK_FILE).read_text() == ""  # a clean end: the next start has nothing to take over
    again = RunLock(run, str(run / "checkpoints"))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        again.acquire()
    assert "gone" not in caplog.text
    again.release()


def _plant_lease(root: str, **holder) -> None:
    fs, path = fsspec.core.url_to_fs(f"{root}/{LEASE_FILE}")
    fs.pipe_file(path, json.dumps({"host": "node-7", "pid": 4321, "job": None, "token": "x",
                                   "heartbeat": time.time(), **holder}).encode())


@pytest.fixture
def remote(tmp_path: Path, monkeypatch) -> str:
    monkeypatch.setattr(run_lock, "SETTLE_S", 0.0)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    return f"memory://leases/{tmp_path.name}"


def test_a_live_foreign_lease_is_refused_naming_its_holder(tmp_path: Path, remote: str) -> None:
    _plant_lease(remote)
    lock = RunLock(tmp_path / "run", remote)
    with pytest.raises(RunLockedError, match=r"leased by another trainer .*node-7.* pid 4321"):
        lock.acquire()
    RunLock(tmp_path / "run", str(tmp_path / "run" / "checkpoints")).acquire()  # the directory was let go


@pytest.mark.parametrize("case", ["expired", "same job", "dead pid here"])
def test_a_stale_lease_is_taken_over(tmp_path: Path, remote: str, monkeypatch, caplog, case: str) -> None:
    if case == "expired":
        _plant_lease(remote, heartbeat=time.time() - run_lock.LEASE_TTL_S - 5)
    elif case == "same job":
        monkeypatch.setenv("SLURM_JOB_ID", "8812")  # a requeued job keeps its id
        _plant_lease(remote, job="SLURM_JOB_ID=8812")
    else:
        _plant_lease(remote, host=socket.gethostname(), pid=999_999_999)
    lock = RunLock(tmp_path / "run", remote)
    with caplog.at_level(logging.WARNING):
        lock.acquire()
    assert "taking over the lease" in caplog.text
    fs, path = fsspec.core.url_to_fs(f"{remote}/{LEASE_FILE}")
    assert json.loads(fs.cat_file(path))["token"] == lock.me["token"]
    lock.release()
    assert not fs.exists(path)


def test_the_lease_is_renewed_while_the_run_lives(tmp_path: Path, remote: str, monkeypatch) -> None:
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    lock = RunLock(tmp_path / "run", remote)
    lock.acquire()
    fs, path = fsspec.core.url_to_fs(f"{remote}/{LEASE_FILE}")
    first = json.loads(fs.cat_file(path))["heartbeat"]
    time.sleep(0.3)
    assert json.loads(fs.cat_file(path))["heartbeat"] > first
    lock.release()


def test_a_lease_overwritten_while_starting_is_a_refusal(tmp_path: Path, remote: str, monkeypatch) -> None:
    real_write = RunLock._write_lease

    def racing_write(self: RunLock) -> None:
        real_write(self)
        _plant_lease(remote, token="theirs")  # another trainer wrote just after this one

    monkeypatch.setattr(RunLock, "_write_lease", racing_write)
    with pytest.raises(RunLockedError, match="took the lease while this one started"):
        RunLock(tmp_path / "run", remote).acquire()
