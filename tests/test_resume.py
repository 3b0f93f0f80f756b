"""Kill-and-resume harness: a run SIGKILLed at a random step and resumed with `--resume auto`
logs a loss sequence bitwise identical to an uninterrupted run of the same config.

Run it for any engine: `pytest tests/test_resume.py -m "slow or not slow" -k deepspeed`. Each case
trains a tiny config (Transformer, VORT or PMNet) for 12 steps with a checkpoint every 3, once straight through and once
killed (the whole process group, mid-step or mid-save, wherever it happens to be) and resumed.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from pathlib import Path

import pytest

from tests.launchers import REPO, kill_tree, launch_command, run_training

STEPS = 12
CONFIGS = {
    "transformer": REPO / "configs" / "tiny.yaml",
    "vort": REPO / "configs" / "tiny-vort.yaml",
    "pmnet": REPO / "configs" / "tiny-pmnet.yaml",
}

DEEPSPEED = ["engine.kind=deepspeed", "engine.zero_stage=2"]
CARRY = ["train.carry_state=true"]
CASES = {
    "single": ("python", 1, ["engine.kind=single"], "transformer"),
    "deepspeed-2": ("deepspeed", 2, DEEPSPEED, "transformer"),
    "deepspeed-1": ("deepspeed", 1, DEEPSPEED, "transformer"),
    "fsdp-2": ("torchrun", 2, ["engine.kind=fsdp"], "transformer"),
    "fsdp-1": ("torchrun", 1, ["engine.kind=fsdp"], "transformer"),
    "deepspeed-2-vort": ("deepspeed", 2, DEEPSPEED, "vort"),
    "fsdp-2-vort": ("torchrun", 2, ["engine.kind=fsdp"], "vort"),
    "deepspeed-2-pmnet": ("deepspeed", 2, DEEPSPEED, "pmnet"),
    "fsdp-2-pmnet": ("torchrun", 2, ["engine.kind=fsdp"], "pmnet"),
    # the state carried across windows (train.carry_state): the carried states and the lanes'
    # position must come back exactly too
    "single-carry": ("python", 1, ["engine.kind=single", *CARRY], "vort"),
    "deepspeed-2-carry": ("deepspeed", 2, [*DEEPSPEED, *CARRY], "vort"),
    "fsdp-2-carry": ("torchrun", 2, ["engine.kind=fsdp", *CARRY], "vort"),
    # VORT's options for long contexts: learned temperatures and the gated read's parameters
    "single-vort-long": ("python", 1, ["engine.kind=single", "model.vort.learn_temperature=true",
                                       "model.vort.readout=norm_gate"], "vort"),
    # PMNet as shipped with a short convolution: the memory's addresses from the block's input before it
    "single-pmnet-conv": ("python", 1, ["engine.kind=single", "model.short_conv=3"], "pmnet"),
    # torch.compile on (pretrain/distributed/compiling.py): the resumed process compiles the same graphs again
    "single-vort-compile": ("python", 1, ["engine.kind=single", "train.compile=true"], "vort"),
    "deepspeed-2-pmnet-compile": ("deepspeed", 2, [*DEEPSPEED, "train.compile=true"], "pmnet"),
}
FAST = {"single", "deepspeed-2", "single-carry", "single-vort-long", "single-pmnet-conv"}


def step_losses(run_dir: Path, key: str = "train/loss") -> dict[int, list[float]]:
    """Every loss (or other metric `key`) logged for each step (a resumed run logs the steps after its
    checkpoint again)."""
    seen: dict[int, list[float]] = {}
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return seen
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the line being written when the process was killed
            continue
        if key in record:
            seen.setdefault(record["step"], []).append(record[key])
    return seen


def config_args(shards: dict[str, str], run_dir: Path, extra: list[str], model: str = "transformer") -> list[str]:
    """The tiny config of `model` made heavy enough (~0.1 s a step on a CPU) for the kill to land
    mid-run."""
    return [
        "--config", str(CONFIGS[model]), f"data.train=[{{path: {shards['train']}}}]", "data.valid=[]",
        f"run.dir={run_dir}", f"train.steps={STEPS}", "checkpoint.every=3", "checkpoint.keep_last=2",
        "model.d_model=128", "model.max_seq_len=256", "data.seq_len=256", "train.global_batch=16", *extra,
    ]


def kill_at_step(launcher: str, ranks: int, args: list[str], run_dir: Path, step: int, timeout: float = 600) -> int:
    """Start training and SIGKILL its whole process group once `step` has been logged; returns
    the last step logged before the kill."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{Path(launch_command('python', 1)[0]).parent}:{env['PATH']}"
    proc = subprocess.Popen(
        [*launch_command(launcher, ranks), *args], cwd=REPO, env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + timeout
    try:
        while max(step_losses(run_dir), default=0) < step:
            if proc.poll() is not None:
                raise AssertionError(f"training exited ({proc.returncode}) before step {step}")
            if time.time() > deadline:
                raise AssertionError(f"step {step} not reached in {timeout} s")
            time.sleep(0.01)
    finally:
        kill_tree(proc.pid)
        proc.wait()
    reached = max(step_losses(run_dir))
    assert reached < STEPS, f"the run finished (step {reached}) before the kill landed: nothing was tested"
    return reached


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=() if c in FAST else pytest.mark.slow) for c in CASES]
)
def test_sigkill_and_resume_is_bitwise_identical(case: str, demo_shards, tmp_path: Path) -> None:
    launcher, ranks, extra, model = CASES[case]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run_training(launcher, ranks, config_args(demo_shards, straight, extra, model))
    expected = {step: values[0] for step, values in step_losses(straight).items()}
    assert sorted(expected) == list(range(1, STEPS + 1))

    kill_step = random.Random(case).randint(4, STEPS - 2)
    reached = kill_at_step(launcher, ranks, config_args(demo_shards, killed, extra, model), killed, kill_step)
    run_training(launcher, ranks, [*config_args(demo_shards, killed, extra, model), "--resume", "auto"])

    got = step_losses(killed)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, values in got.items():
        assert all(v == expected[step] for v in values), (case, kill_step, step, values, expected[step])
    assert any(len(v) > 1 for v in got.values()) or reached % 3 == 0  # steps after the checkpoint were redone
