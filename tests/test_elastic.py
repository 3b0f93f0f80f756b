"""Restarts and multi-node launches, on this machine: torchrun's elastic restart after a worker is
killed, torchrun's c10d rendezvous across two "nodes" on 127.0.0.1, and the DeepSpeed launcher's
hostfile in its no-ssh mode (one launcher per "node", each told its --node_rank). The recipes
are docs/cluster.md's."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.launchers import BIN, ENTRY, REPO, free_port, kill_tree, run_training
from tests.test_preemption import wait_for_step
from tests.test_resume import STEPS, config_args, step_losses

ENGINES = {"fsdp": ["engine.kind=fsdp"], "deepspeed": ["engine.kind=deepspeed", "engine.zero_stage=2"]}
CASES = {
    "fsdp-transformer": ("fsdp", "transformer"),
    "deepspeed-transformer": ("deepspeed", "transformer"),
    "fsdp-pmnet": ("fsdp", "pmnet"),
    "deepspeed-vort": ("deepspeed", "vort"),
}


def environment() -> dict[str, str]:
    return dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def workers(pid: int) -> list[psutil.Process]:
    """The training processes below a launcher."""
    family = psutil.Process(pid).children(recursive=True)
    return [p for p in family if any(a.endswith("launch/pretrain.py") for a in p.cmdline()[:4])]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_torchrun_restarts_a_killed_worker_from_the_newest_checkpoint(case: str, demo_shards, tmp_path: Path) -> None:
    engine, model = CASES[case]
    straight, elastic = tmp_path / "straight", tmp_path / "elastic"
    extra = [*ENGINES[engine], "checkpoint.every=3"]
    run_training("torchrun", 2, config_args(demo_shards, straight, extra, model))
    expected = {step: values[0] for step, values in step_losses(straight).items()}

    command = [
        str(BIN / "torchrun"), "--nproc_per_node", "2", "--max-restarts", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}", ENTRY, *config_args(demo_shards, elastic, extra, model),
    ]
    log = tmp_path / "log.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=REPO, env=environment(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_for_step(proc, elastic, 5, log)
        first = workers(proc.pid)
        assert len(first) == 2, [p.cmdline()[:3] for p in first]
        first[-1].kill()
        proc.wait(timeout=600)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 0, log.read_text()[-4000:]
    output = log.read_text()
    assert "resumed from" in output, output[-4000:]
    got = step_losses(elastic)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert any(len(values) > 1 for values in got.values()), "no step was redone: the restart was not tested"
    for step, values in got.items():
        assert all(v == expected[step] for v in values), (case, step, values, expected[step])


def two_nodes(commands: list[list[str]], log: Path, timeout: float = 600) -> None:
    """Run one launcher per "node" at once; both must succeed."""
    procs = []
    with open(log, "w") as out:
        for command in commands:
            procs.append(subprocess.Popen(command, cwd=REPO, env=environment(), stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline = time.time() + timeout
        try:
            for proc in procs:
                proc.wait(timeout=max(1.0, deadline - time.time()))
        finally:
            for proc in procs:
                kill_tree(proc.pid)
    codes = [proc.returncode for proc in procs]
    assert codes == [0, 0], f"exit codes {codes}:\n{log.read_text()[-4000:]}"


SHORT = ["train.steps=4", "checkpoint.every=0"]


def assert_two_ranks_match_one_process(engine: str, run_dir: Path, demo_shards, tmp_path: Path) -> None:
    """The two "nodes" formed one job of 2 ranks, whose losses are a single process's."""
    assert f"engine {engine} on 2 rank(s)" in (tmp_path / "log.txt").read_text()
    run_training("python", 1, config_args(demo_shards, tmp_path / "single", ["engine.kind=single", *SHORT]))
    expected = {step: values[0] for step, values in step_losses(tmp_path / "single").items()}
    got = {step: values[0] for step, values in step_losses(run_dir).items()}
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4]
    assert all(got[s] == pytest.approx(expected[s], rel=1e-5) for s in got), (got, expected)


@pytest.mark.slow
def test_torchrun_c10d_rendezvous_of_two_nodes_on_loopback(demo_shards, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    endpoint = f"127.0.0.1:{free_port()}"
    commands = [
        [str(BIN / "torchrun"), "--nnodes", "2", "--nproc_per_node", "1", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", endpoint, "--rdzv-id", "two-nodes", ENTRY,
         *config_args(demo_shards, run_dir, ["engine.kind=fsdp", *SHORT])]
        for _ in range(2)
    ]
    two_nodes(commands, tmp_path / "log.txt")
    assert_two_ranks_match_one_process("fsdp", run_dir, demo_shards, tmp_path)


@pytest.mark.slow
def test_deepspeed_hostfile_without_ssh_on_two_local_nodes(demo_shards, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    port = str(free_port())
    commands = [
        [str(BIN / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node),
         "--master_addr", "127.0.0.1", "--master_port", port, ENTRY,
         *config_args(demo_shards, run_dir, ["engine.kind=deepspeed", *SHORT])]
        for node in range(2)
    ]
    two_nodes(commands, tmp_path / "log.txt")
    assert_two_ranks_match_one_process("deepspeed", run_dir, demo_shards, tmp_path)
