"""Skipped sample ranges (data_pipeline/skips.py, `data.skip_samples`): every loader reads exactly the
samples outside the ranges, keeps the ranges in its state, and reaches the same state whether a range
is added to a running loader (what a loss-spike rollback does) or given from the start (what a resume
with `data.skip_samples` does)."""

from __future__ import annotations

import random

import pytest

from data_pipeline.lanes import LaneStream
from data_pipeline.skips import SkipRanges
from data_pipeline.stream import PackedStream, StreamLoader
from data_pipeline.synthetic import TaskBatches, make_task
from pretrain.config import ConfigError, load_config
from tests.launchers import REPO


@pytest.mark.parametrize("seed", range(20))
def test_nth_counts_past_the_ranges_as_a_filter_does(seed: int) -> None:
    rng = random.Random(seed)
    pairs = []
    for _ in range(rng.randint(0, 5)):
        first = rng.randint(0, 60)
        pairs.append((first, first + rng.randint(1, 12)))
    skips = SkipRanges(pairs)
    kept = [g for g in range(200) if not any(a <= g < b for a, b in pairs)]
    for position in range(0, 80, 7):
        after = [g for g in kept if g >= position]
        for n in range(10):
            assert skips.nth(position, n) == after[n], (pairs, position, n)
    flat = [g for lo, hi in skips.to_list() for g in range(lo, hi)]
    assert flat == sorted({g for a, b in pairs for g in range(a, b)})  # merged, disjoint, sorted


def _stream(shards: str, rank: int = 0, world: int = 1, skip: list[list[int]] | None = None) -> StreamLoader:
    stream = PackedStream([(shards, 1.0)], seq_len=32, seed=5, rank=rank, world_size=world, shuffle_buffer=4,
                          batch_size=2, skip_samples=skip or [])
    return StreamLoader(stream)


def _indices(loader: StreamLoader, batches: int) -> list[int]:
    it = iter(loader)
    return [int(i) for _ in range(batches) for i in next(it)["index"]]


@pytest.mark.parametrize("world", [1, 2])
def test_a_stream_reads_every_sample_outside_the_ranges_once(demo_shards: dict[str, str], world: int) -> None:
    skip = [[3, 7], [12, 13]]
    read = sorted(g for r in range(world) for g in _indices(_stream(demo_shards["train"], r, world, skip), 6 // world))
    assert read == [g for g in range(17) if not (3 <= g < 7 or g == 12)][: len(read)]
    assert len(read) == 12


def test_adding_a_range_mid_run_equals_resuming_with_it(demo_shards: dict[str, str]) -> None:
    """The rollback's data path: state at a checkpoint + a range added live == that state loaded into a
    loader configured with the range; both then read the same samples and end in the same state."""
    shards = demo_shards["train"]
    running = _stream(shards)
    _indices(running, 3)
    checkpoint = running.state_dict()
    _indices(running, 4)  # the steps a spike makes us give up
    spike_end = running.position()
    running.load_state_dict(checkpoint)
    running.skip(checkpoint["consumed"], spike_end)

    resumed = _stream(shards, skip=[[checkpoint["consumed"], spike_end]])
    resumed.load_state_dict(checkpoint)
    assert running.state_dict() == resumed.state_dict()
    assert running.position() == spike_end
    first, second = _indices(running, 3), _indices(resumed, 3)
    assert first == second and min(first) == spike_end
    assert running.state_dict() == resumed.state_dict()
    assert running.state_dict()["skip"] == [[checkpoint["consumed"], spike_end]]

    later = _stream(shards)  # a resume whose config has no ranges still skips the saved ones
    later.load_state_dict({**checkpoint, "skip": running.state_dict()["skip"]})
    assert _indices(later, 1) == [spike_end, spike_end + 1]


def test_task_batches_skip_examples() -> None:
    task = make_task("copy", 64)
    plain, skipping = TaskBatches(task, 64, 2), TaskBatches(task, 64, 2, skip_samples=[[2, 6]])
    rows = [b["input_ids"] for _, b in zip(range(4), plain)]
    got = [b["input_ids"] for _, b in zip(range(2), skipping)]
    assert (got[0] == rows[0]).all() and (got[1] == rows[3]).all()  # examples 0, 1 then 6, 7
    assert skipping.state_dict() == {"consumed": 8, "skip": [[2, 6]]}


def test_lanes_skip_whole_steps(demo_shards: dict[str, str]) -> None:
    lanes = LaneStream(demo_shards["train"], 16, lanes=4, micro_batch=2, skip_samples=[[5, 9]])
    assert lanes.position() == 0
    lanes.next_step()
    assert lanes.step == 3 and lanes.position() == 12  # step 1 (samples 4-7) and step 2 (8-11) touch [5, 9)
    reference = LaneStream(demo_shards["train"], 16, lanes=4, micro_batch=2)
    reference.load_state_dict({**reference.state_dict(), "step": 3})
    assert all((a["input_ids"] == b["input_ids"]).all() for a, b in zip(lanes.next_step(), reference.next_step()))


@pytest.mark.parametrize("value", ["[[5, 5]]", "[[-1, 3]]", "[[1, 2, 3]]"])
def test_bad_ranges_are_refused_naming_the_key(value: str) -> None:
    with pytest.raises(ConfigError, match=r"data\.skip_samples: item 0 must be \[first, end\)"):
        load_config(REPO / "configs" / "tiny.yaml", [f"data.skip_samples={value}"])
