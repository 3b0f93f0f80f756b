"""Loss-spike rollback (pretrain/resilience/spike.py, the trainer's `_roll_back`) on spikes made by the data, not
by a hook: shards built with `data_pipeline.build` from a play with a block of a thousand random bytes
in it, read in order (`data.shuffle_buffer: 1`, one shard). The run must roll back to the checkpoint
before the block, skip the samples read since, finish, and equal bitwise a run resumed from that
checkpoint with `data.skip_samples` over the same range, with the same data state at the end."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.spike_ratios import ratios
from data_pipeline.build import build_shards
from pretrain.config import SpikeSection
from pretrain.resilience.spike import SpikeDetector
from pretrain.trainer import EXIT_DIVERGED
from tests.launchers import REPO, run_training

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
    detector.rollbacks = 1
    detector.load_state_dict(saved, keep_rollbacks=True)
    assert detector.rollbacks == 1 and detector.exhausted and list(detector.history) == [3.0, 3.25, 6.125, 7.0]
    off = SpikeDetector(SpikeSection(max_rollbacks=0))
    off.record(1, torch.tensor(1.0), 8)
    assert off.check() is None and not off.history  # off: nothing recorded, no collective at log steps


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
    assert "train.spike.max_rollbacks=1 rollbacks made: saving and stopping" in proc.stdout
    assert (once / "checkpoints" / "latest").read_text() == f"step_{second:08d}"
