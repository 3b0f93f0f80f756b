"""Loss-spike rollback (pretrain/resilience/spike.py, the trainer's `_roll_back`) on spikes made by the data, not
by a hook: shards built with `data_pipeline.build` from a play with a block of a thousand random bytes
in it, read in order (`data.shuffle_buffer: 1`, one shard). The run must roll back to the checkpoint
before the block, skip the samples read since, finish, and equal bitwise a run resumed from that
checkpoint with `data.skip_samples` over the same range, with the same data state at the end."""

from __future__ import annotations

import json
import math
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.spike_ratios import ratios
from data_pipeline.build import build_shards
from pretrain.config import SpikeSection
from pretrain.resilience.spike import SpikeDetector
from pretrain.telemetry.metrics import MetricsLogger
from pretrain.telemetry.progress import Pace
from pretrain.trainer import EXIT_DIVERGED, EXIT_PREEMPTED
from tests.launchers import REPO, run_training
from tests.test_preemption import start

SEQ, BATCH = 64, 16  # a step reads BATCH samples of SEQ bytes: 1,024 bytes of the stream
BLOCK = 1000
BLOCK_STEPS = (26, 33)  # the steps whose batch holds a block (the first, or both)
STEPS = 40


def spike_shards(root: Path, blocks: int) -> tuple[str, list[tuple[int, int]]]:
    """One shard of Hamlet with `blocks` blocks of random bytes, each inside the batch of a step of
    BLOCK_STEPS; returns the shard directory and each block's stream positions [start, end)."""
    text = (REPO / "data" / "demo" / "train" / "hamlet.txt").read_bytes()
    rng = np.random.default_rng(0)
    stream, spans, used = bytearray(), [], 0
    for step in BLOCK_STEPS[:blocks]:
        at = (step - 1) * BATCH * SEQ + 12  # 12 bytes into the step's first sample
        take = at - len(stream)
        stream += text[used: used + take]
        used += take
        stream += rng.integers(0, 256, BLOCK, dtype=np.uint8).tobytes()
        spans.append((at, at + BLOCK))
    stream += text[used:]
    (root / "corpus").mkdir(parents=True)
    (root / "corpus" / "hamlet.txt").write_bytes(bytes(stream))
    build_shards([str(root / "corpus" / "hamlet.txt")], str(root / "shards"), tokenizer="bytes",
                 shard_tokens=10_000_000)
    return str(root / "shards"), spans


def args(shards: str, run_dir: Path, extra: list[str]) -> list[str]:
    return [
        "--config", str(REPO / "configs" / "tiny.yaml"), f"data.train=[{{path: {shards}}}]", "data.valid=[]",
        f"run.dir={run_dir}", f"train.steps={STEPS}", f"data.seq_len={SEQ}", f"train.global_batch={BATCH}",
        "train.micro_batch=4", "data.shuffle_buffer=1", "checkpoint.every=5", "checkpoint.keep_last=100",
        "train.spike.window=10", *extra,
    ]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_rule_flags_a_rise_over_the_median_of_the_window() -> None:
    detector = SpikeDetector(SpikeSection(window=4, factor=2.0, max_rollbacks=1))
    losses = list(enumerate([9.0, 5.0, 4.0, 3.5, 3.0, math.nan, 3.25, 6.125, 7.0], start=1))
    for step, loss in losses:
        detector.record(step, torch.tensor(loss), end_sample=8 * step)
    spike = detector.check()
    # the medians before steps 5, 7 (the NaN of step 6 is passed over), 8 and 9 are 4.5, 3.75, 3.375 and
    # 3.375: step 8's 6.125 stays under 2 x 3.375, step 9's 7.0 does not
    assert spike is not None and (spike.step, spike.loss, spike.median, spike.end_sample) == (9, 7.0, 3.375, 72)
    assert list(detector.history) == [3.0, 3.25, 6.125, 7.0]
    assert ratios(losses, 4) == [(5, 3.0 / 4.5), (7, 3.25 / 3.75), (8, 6.125 / 3.375), (9, 7.0 / 3.375)]
    saved = detector.state_dict()
    detector.rollback_steps.append(9)
    detector.load_state_dict(saved, keep_rollbacks=True)
    assert detector.rollback_steps == [9] and list(detector.history) == [3.0, 3.25, 6.125, 7.0]
    detector.load_state_dict({"history": [1.0], "rollbacks": 2})  # an older checkpoint: a count, no steps
    assert detector.rollback_steps == [] and not detector.exhausted(100)
    off = SpikeDetector(SpikeSection(max_rollbacks=0))
    off.record(1, torch.tensor(1.0), 8)
    assert off.check() is None and not off.history  # off: nothing recorded, no collective at log steps


def test_the_rollback_budget_is_per_window_of_steps() -> None:
    detector = SpikeDetector(SpikeSection(max_rollbacks=2, rollback_window=100))
    detector.rollback_steps += [150, 230]
    assert detector.exhausted(249) and detector.exhausted(230)  # both within the 100 steps up to it
    assert not detector.exhausted(250)  # step 150 has left the window
    assert detector.rollbacks_near(400) == 0
    restored = SpikeDetector(SpikeSection(max_rollbacks=2, rollback_window=100))
    restored.load_state_dict(detector.state_dict())
    assert restored.rollback_steps == [150, 230]  # the budget survives a resume


def test_the_time_left_is_right_after_a_rollback() -> None:
    pace = Pace(total=100, first=0, started=0.0)
    pace.counting_from = time.time() - 10.0  # 10 steps made in 10 s
    assert pace.left(10) == pytest.approx(90.0, rel=0.05)
    pace.rewind(since=10, to=5)  # rolled back to step 5: 95 steps to go at the same second a step
    assert pace.left(5) == pytest.approx(95.0, rel=0.05)
    assert pace.left(6) == pytest.approx(94.0 * 10 / 11, rel=0.05)


def test_wandb_gets_every_step_redone_after_a_rollback_and_the_rollback(tmp_path: Path) -> None:
    """What the metrics send to wandb: every record at wandb's next step (never a `step=` that goes back,
    which wandb drops), drawn against train/step; the rollback as event/rollback."""

    class Recorder:
        def __init__(self) -> None:
            self.calls: list[tuple[dict, dict]] = []

        def log(self, payload: dict, **kwargs: object) -> None:
            self.calls.append((payload, kwargs))

    metrics = MetricsLogger(tmp_path, {}, enabled=True, use_wandb=False, project="x")
    metrics._wandb = recorder = Recorder()
    for step in (25, 26):
        metrics.log(step, {"train/loss": 1.0})
    metrics.event({"event": "rollback", "step": 26, "to_step": 25, "skipped_samples": [400, 416]}, "rolled back")
    metrics.log(26, {"train/loss": 0.5})
    assert all(kwargs == {} for _, kwargs in recorder.calls)
    assert [payload["train/step"] for payload, _ in recorder.calls] == [25, 26, 26, 26]
    assert recorder.calls[2][0] == {"event/rollback": 1, "event/rollback/to_step": 25, "train/step": 26}
    assert recorder.calls[3][0]["train/loss"] == 0.5


CASES = {
    "single": ("python", 1, ["engine.kind=single"]),
    "deepspeed-2": ("deepspeed", 2, ["engine.kind=deepspeed"]),
    "fsdp-2": ("torchrun", 2, ["engine.kind=fsdp"]),
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c == "single" else pytest.mark.slow) for c in CASES])
def test_a_spike_is_rolled_back_past_its_data_and_equals_the_skip_samples_run(case: str, tmp_path: Path) -> None:
    launcher, ranks, extra = CASES[case]
    shards, [(block_start, block_end)] = spike_shards(tmp_path, blocks=1)
    rolled = tmp_path / "rolled"
    run_training(launcher, ranks, args(shards, rolled, extra))

    lines = records(rolled)
    events = [r for r in lines if "event" in r]
    assert len(events) == 1, events
    event = events[0]
    assert event["event"] == "rollback" and event["step"] == BLOCK_STEPS[0]
    first, end = event["skipped_samples"]
    assert event["to_step"] == 25 and (first, end) == (25 * BATCH, BLOCK_STEPS[0] * BATCH)
    touching = [g for g in range(STEPS * BATCH) if g * SEQ < block_end and block_start < (g + 1) * SEQ + 1]
    assert first <= min(touching) and max(touching) < end  # every sample holding the block is skipped
    after = lines[lines.index(event) + 1:]
    losses_after = {r["step"]: r["train/loss"] for r in after if "train/loss" in r}
    assert sorted(losses_after) == list(range(26, STEPS + 1))
    median_before = float(np.median([r["train/loss"] for r in lines[:lines.index(event)] if "train/loss" in r][-10:]))
    assert max(losses_after.values()) < 2 * median_before  # the spike is gone from the rerun steps

    # the same checkpoint, resumed with the range skipped by hand
    by_hand = tmp_path / "by_hand"
    (by_hand / "checkpoints").mkdir(parents=True)
    shutil.copytree(rolled / "checkpoints" / "step_00000025", by_hand / "checkpoints" / "step_00000025")
    run_training(launcher, ranks, [*args(shards, by_hand, extra), f"data.skip_samples=[[{first}, {end}]]"])
    resumed = {r["step"]: r["train/loss"] for r in records(by_hand) if "train/loss" in r}
    assert resumed == losses_after  # bitwise: float equality of every logged loss
    assert not [r for r in records(by_hand) if "event" in r]

    def final_data(run: Path) -> dict:
        return json.loads((run / "checkpoints" / f"step_{STEPS:08d}" / "trainer_state.json").read_text())["data"]

    assert final_data(rolled) == final_data(by_hand)
    assert final_data(rolled)["skip"] == [[first, end]]  # so every later resume skips them too


def test_max_rollbacks_stops_the_run_and_zero_turns_the_rollback_off(tmp_path: Path) -> None:
    shards, _ = spike_shards(tmp_path, blocks=2)
    off = tmp_path / "off"
    run_training("python", 1, args(shards, off, ["train.spike.max_rollbacks=0"]))
    losses = {r["step"]: r["train/loss"] for r in records(off) if "train/loss" in r}
    assert sorted(losses) == list(range(1, STEPS + 1)) and not [r for r in records(off) if "event" in r]
    for step in BLOCK_STEPS:  # the blocks do spike the loss: the detector would have fired
        assert losses[step] > 2 * float(np.median([losses[s] for s in range(step - 10, step)]))

    once = tmp_path / "once"
    proc = run_training("python", 1, args(shards, once, ["train.spike.max_rollbacks=1"]), check=False)
    assert proc.returncode == EXIT_DIVERGED, proc.stdout[-3000:]
    assert [r["step"] for r in records(once) if "event" in r] == [BLOCK_STEPS[0]]
    second = BLOCK_STEPS[1] - 1  # the skipped batch moved every later one a step earlier
    assert f"loss spike at step {second}" in proc.stdout
    spiked = once / "spiked" / f"step_{second:08d}"
    assert (f"stopping. The spiked weights of step {second} are written apart to {spiked}, never resumed by "
            "--resume auto; the newest checkpoint is still step_00000030") in proc.stdout
    assert (spiked / "trainer_state.json").is_file()  # a whole checkpoint, apart from the run's
    assert (once / "checkpoints" / "latest").read_text() == "step_00000030"  # the newest is from before it
    assert max(int(p.name[5:]) for p in (once / "checkpoints").glob("step_*")) == 30



def test_a_spike_outside_the_window_of_the_last_rollback_is_rolled_back_too(tmp_path: Path) -> None:
    """The budget is per window of steps: with max_rollbacks 1, the second spike (6 steps after the first,
    outside a window of 5) is rolled back too, and the run finishes."""
    shards, _ = spike_shards(tmp_path, blocks=2)
    windowed = tmp_path / "windowed"
    run_training("python", 1, args(shards, windowed, ["train.spike.max_rollbacks=1",
                                                      "train.spike.rollback_window=5"]))
    assert [r["step"] for r in records(windowed) if "event" in r] == [BLOCK_STEPS[0], BLOCK_STEPS[1] - 1]
    assert not (windowed / "spiked").exists()


def test_a_stop_between_two_checks_checks_the_steps_before_it_saves(tmp_path: Path) -> None:
    """Losses checked only at checkpoint steps (every 25; log_every 1000): SIGTERM once step 25 is
    committed lands after the spike of step 26. The stop's save follows the check: the spike is rolled
    back, the saved step is 25 again with the spike's samples skipped, and the run exits 3."""
    shards, _ = spike_shards(tmp_path, blocks=1)
    run = tmp_path / "run"
    log = tmp_path / "log.txt"
    with start("python", 1, args(shards, run, ["train.steps=100000", "train.log_every=1000",
                                                "checkpoint.every=25"]), log) as proc:
        latest = run / "checkpoints" / "latest"
        deadline = time.time() + 300
        while not (latest.exists() and latest.read_text() == "step_00000025"):
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    output = log.read_text()
    assert proc.returncode == EXIT_PREEMPTED, output[-3000:]
    [event] = [r for r in records(run) if "event" in r]
    assert (event["step"], event["to_step"]) == (BLOCK_STEPS[0], 25), event
    assert latest.read_text() == "step_00000025"
    saved = json.loads((run / "checkpoints" / "step_00000025" / "trainer_state.json").read_text())
    assert saved["data"]["skip"] == [event["skipped_samples"]] and saved["spike"]["rollback_steps"] == [26]
