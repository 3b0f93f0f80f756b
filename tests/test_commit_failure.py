"""A checkpoint commit that fails on rank 0 alone (only rank 0 commits: a failed upload to the store, a
full disk) stops every rank with the same error, so that no rank goes on into the next step's
collectives while rank 0 stops (issue #56). Two gloo ranks run the Checkpointer as the trainer does:
a commit in the foreground, and one in the background found by the vote the loop takes every step
(`pretrain.trainer._stop_vote`) or by the next save's `settle`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from pretrain.checkpoint.checkpointer import Checkpointer
from pretrain.checkpoint.layout import CheckpointError
from pretrain.distributed.process_group import all_reduce_sum
from tests.launchers import free_port
from tests.test_crash_points import FakeEngine

STATE = {"trainer": {"step": 0}, "data": {}}


def _failing_on_rank_0(ckpt: Checkpointer) -> None:
    """Rank 0's commits raise as an upload past its retries would (the other ranks never commit)."""

    def commit(stage: Path, step: int) -> None:
        raise OSError(f"cannot upload 's3://bucket/ckpt/step_{step:08d}/manifest.json': failed 6 times")

    ckpt._commit = commit  # type: ignore[method-assign]


def _case(rank: int, root: Path, mode: str) -> str:
    """What this rank raised in `mode` (the text of a CheckpointError; anything else as its type)."""
    ckpt = Checkpointer(str(root / mode), root / f"stage-{mode}", 2, 0, async_save=mode != "foreground")
    ckpt.save(1, FakeEngine(1), STATE, "run: {}\n")  # a good commit first
    ckpt.settle()
    _failing_on_rank_0(ckpt)
    try:
        ckpt.save(2, FakeEngine(2), STATE, "run: {}\n")
        if mode == "vote":  # the loop's vote of the step after the save
            _, failed = all_reduce_sum([0.0, 1.0 if ckpt.join(30.0) and ckpt.failed() else 0.0])
            ckpt.raise_if_failed(failed > 0)
        else:  # the next save's settle (or the end of the run's)
            ckpt.settle()
    except CheckpointError as err:
        return str(err)
    except Exception as err:  # reported as it is: the test wants a CheckpointError on every rank
        return f"{type(err).__name__}: {err}"
    return "nothing raised"


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        said = {mode: _case(rank, Path(out), mode) for mode in ("foreground", "vote", "settle")}
        dist.barrier()  # both ranks are still in step after every case: none hung in a collective
        Path(out, f"rank{rank}.json").write_text(json.dumps(said))
    finally:
        dist.destroy_process_group()


def test_a_commit_failing_on_rank_0_raises_the_same_error_on_every_rank(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    said = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert said[0] == said[1], said
    for mode, text in said[0].items():
        assert text.startswith("rank 0 could not commit the checkpoint of step 2: cannot upload "
                               "'s3://bucket/ckpt/step_00000002/manifest.json': failed 6 times"), (mode, text)
    for mode in said[0]:  # step 1 committed, step 2 not
        assert (tmp_path / mode / "step_00000001").is_dir() and not (tmp_path / mode / "step_00000002").exists()
