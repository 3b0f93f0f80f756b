"""Continuing streams for training with a carried recurrent state (`train.carry_state`).

The shuffled loader of data_pipeline/stream.py never puts a window after the one that precedes it
in the text, but truncated backpropagation through time needs row i of every step to continue row
i of the step before. Here each row of the global batch is a lane: a run of consecutive windows of
the epoch's unshuffled token stream, read one window per optimizer step. The layout depends only on
the global batch, so a run resumes at any world size. docs/training.md, "Carrying the state across
windows", gives the layout; with `doc_boundaries` the model resets at document starts inside a lane.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from data_pipeline.skips import SkipRanges
from data_pipeline.stream import PackedStream

STATE_VERSION = 1


class LaneError(ValueError):
    """A layout that cannot be built or resumed; the message names the setting."""


def recorded_source(state: dict[str, Any]) -> str | None:
    """The fingerprint of the one source a saved state (`LaneStream.state_dict`) was reading."""
    return state.get("source")


class LaneStream:
    """Per optimizer step, this rank's micro-batches of consecutive windows, one lane per row.

    Args:
        source: the training shard set (directory or URL holding manifest.json).
        seq_len: tokens per window.
        lanes: rows of the global batch (R).
        micro_batch: rows per micro-batch; R must split over ranks into whole micro-batches.
        seed: seeds the shard order of each epoch.
        rank, world_size: this data-parallel rank and the number of ranks.
        expected_tokenizer: as in `PackedStream` (a mismatch raises TokenizerMismatchError).
        doc_boundaries: add `doc_start` [micro_batch, seq_len] to each micro-batch, True where a token
            starts a document (as `PackedStream`'s; a window's first token only after an EOS).
        skip_samples: `[[first, end), ...]` global sample numbers not trained on, where step k's samples
            are numbers k * lanes .. (k + 1) * lanes - 1: a step with any of its samples in a range is
            skipped whole (every lane moves on together), its windows unread.
    """

    def __init__(
        self,
        source: str,
        seq_len: int,
        lanes: int,
        micro_batch: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        expected_tokenizer: str | dict[str, Any] | None = None,
        doc_boundaries: bool = False,
        skip_samples: Sequence[Sequence[int]] = (),
    ) -> None:
        if lanes % (world_size * micro_batch):
            raise LaneError(
                f"lanes={lanes} (the global batch) is not a multiple of world_size * micro_batch = "
                f"{world_size} * {micro_batch}"
            )
        self.stream = PackedStream(
            [(source, 1.0)],
            seq_len=seq_len,
            seed=seed,
            rank=0,
            world_size=1,
            shuffle_buffer=1,
            shuffle=True,
            expected_tokenizer=expected_tokenizer,
            doc_boundaries=doc_boundaries,
        )
        self.seq_len, self.lanes, self.micro_batch, self.seed = seq_len, lanes, micro_batch, seed
        self.rank, self.world_size = rank, world_size
        windows = self.stream.samples_per_epoch()[0]
        self.steps_per_epoch = windows // lanes
        if self.steps_per_epoch < 1:
            raise LaneError(
                f"data.train: {source!r} holds {windows} windows of {seq_len} tokens, fewer than the "
                f"{lanes} lanes of the global batch; lower train.global_batch or data.seq_len"
            )
        self.windows_per_epoch = windows
        self.skips = SkipRanges(skip_samples)
        self.step = self._unskipped(0)

    def _unskipped(self, step: int) -> int:
        """The first step at or after `step` none of whose samples is skipped."""
        while self.skips.nth(step * self.lanes, self.lanes - 1) != (step + 1) * self.lanes - 1:
            step += 1
        return step

    @property
    def rows_per_rank(self) -> int:
        return self.lanes // self.world_size

    def lane_ids(self, micro: int) -> list[int]:
        """Global lane numbers of the rows of this rank's micro-batch `micro`."""
        first = self.rank * self.rows_per_rank + micro * self.micro_batch
        return list(range(first, first + self.micro_batch))

    def window_of(self, lane: int, step: int) -> int:
        """Global window number (PackedStream sample) that `lane` reads at `step`."""
        epoch, k = divmod(step, self.steps_per_epoch)
        return epoch * self.windows_per_epoch + lane * self.steps_per_epoch + k

    def next_step(self) -> list[dict[str, Any]]:
        """This rank's micro-batches for the next optimizer step: dicts with `input_ids` and
        `labels` [micro_batch, seq_len] (and `doc_start` with doc_boundaries), `lanes` (global lane
        numbers) and `reset` (True when every lane starts a new stretch of text, so the carried state
        must start from zero)."""
        batches = []
        for micro in range(self.rows_per_rank // self.micro_batch):
            lanes = self.lane_ids(micro)
            samples = [self.stream.get(self.window_of(lane, self.step)) for lane in lanes]
            batch: dict[str, Any] = {key: torch.stack([s[key] for s in samples])
                                     for key in ("input_ids", "labels", "doc_start") if key in samples[0]}
            batches.append({**batch, "lanes": lanes, "reset": self.step % self.steps_per_epoch == 0})
        self.step = self._unskipped(self.step + 1)
        return batches

    def state_dict(self) -> dict[str, Any]:
        """The next step to read and the skipped ranges, plus the settings that define the layout
        (checked on resume)."""
        return {
            "version": STATE_VERSION,
            "step": self.step,
            "skip": self.skips.to_list(),
            "lanes": self.lanes,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "source": self.stream.state_dict()["mixture"]["sources"][0],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the steps `state` says were consumed, skipping its ranges too; the layout must
        be the same."""
        if state.get("version") != STATE_VERSION:
            raise LaneError(f"unsupported lane stream state version {state.get('version')!r}")
        mine = self.state_dict()
        for key in ("lanes", "seq_len", "seed", "source"):
            if state.get(key) != mine[key]:
                what = "train.global_batch" if key == "lanes" else ("data.train" if key == "source" else key)
                raise LaneError(
                    f"cannot resume the carried streams exactly: the checkpoint has {key}={state.get(key)!r}, "
                    f"this run {mine[key]!r} ({what} must not change under train.carry_state)"
                )
        for first, end in state.get("skip", []):
            self.skips.add(first, end)
        self.step = self._unskipped(int(state["step"]))

    def position(self) -> int:
        """Global number of the next sample to read: the first of the next step's."""
        return self.step * self.lanes

    def skip(self, first: int, end: int) -> None:
        """Skip the steps holding any of global samples `first .. end - 1`."""
        self.skips.add(first, end)
        self.step = self._unskipped(self.step)
