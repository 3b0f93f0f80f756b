"""Loss-spike detection for the in-process rollback (the trainer's `_roll_back` restores and skips).

A finite loss spike (bad data, an unlucky batch, the optimizer thrown off) is not caught by the
non-finite skip, and training through it can leave AdamW's moments damaged for thousands of steps.
Large runs recover by hand: restore a checkpoint from before the spike and skip the batches that led
to it. Here the detector flags the spike and the trainer does that by itself, in the same processes.

Rule (`train.spike`): step t is a spike when its global mean loss exceeds `factor` times the median of
the `window` finite losses before it. The median, not the mean, so that one earlier spike does not
raise the reference; a ratio, not a z-score, because the loss's step-to-step noise shrinks as it falls
and a z-score then flags ordinary wiggles. Nothing is flagged before `window` losses are known, so the
steep fall of the first steps never serves as the reference. docs/training.md, "Loss spikes", gives the
measurements behind the defaults.

Each step's loss stays on the device until a log or checkpoint step, where the losses of the window
are read in one transfer and averaged over ranks in one host all-reduce: every rank sees the same values
and reaches the same decision, and steps that do not log wait for nothing. The history and the steps of
the rollbacks made go into every checkpoint, so a resumed run judges its first steps against the same
history and the same budget: `max_rollbacks` rollbacks in any `rollback_window` steps (a run that spikes
again and again is sick; spikes weeks apart are not).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from pretrain.config import SpikeSection
from pretrain.distributed.process_group import all_reduce_mean


@dataclass(frozen=True)
class Spike:
    """A flagged step: its global mean loss, the median it was judged against, and the global number of
    the first sample after its batch (the end of the range a rollback skips)."""

    step: int
    loss: float
    median: float
    end_sample: int


class SpikeDetector:
    """The recent global mean losses and the spike rule over them (off when max_rollbacks is 0)."""

    def __init__(self, cfg: SpikeSection) -> None:
        self.cfg = cfg
        self.history: deque[float] = deque(maxlen=cfg.window)
        self.rollback_steps: list[int] = []  # the spikes rolled back, by step
        self._pending: list[tuple[int, torch.Tensor, int]] = []

    @property
    def enabled(self) -> bool:
        return self.cfg.max_rollbacks > 0

    def rollbacks_near(self, step: int) -> int:
        """The rollbacks made for spikes in the `rollback_window` steps up to `step`."""
        return sum(step - self.cfg.rollback_window < s <= step for s in self.rollback_steps)

    def exhausted(self, step: int) -> bool:
        """Whether a spike at `step` finds the window's budget spent: it stops the run."""
        return self.rollbacks_near(step) >= self.cfg.max_rollbacks

    def record(self, step: int, loss: torch.Tensor, end_sample: int) -> None:
        """Keep step `step`'s loss (a device tensor, not read here) and where its batch ended."""
        if self.enabled:
            self._pending.append((step, loss.detach(), end_sample))

    def check(self) -> Spike | None:
        """Collective (at a log or checkpoint step): read the recorded losses, average them over the
        ranks, add the finite ones to the history; returns the first spike among them, or None."""
        if not self._pending:
            return None
        steps, losses, ends = zip(*self._pending, strict=True)
        self._pending.clear()
        values = all_reduce_mean(torch.stack(losses).float().tolist())
        spike = None
        for step, loss, end in zip(steps, values, ends, strict=True):
            median = self.observe(loss)
            if spike is None and median is not None and loss > self.cfg.factor * median:
                spike = Spike(step, loss, median, end)
        return spike

    def observe(self, loss: float) -> float | None:
        """Judge one global mean loss and add it to the history: returns the median of the `window`
        losses before it (None while fewer are known, or for a non-finite loss, which is
        train.nan_policy's and stays out of the history)."""
        if not math.isfinite(loss):
            return None
        median = statistics.median(self.history) if len(self.history) == self.cfg.window else None
        self.history.append(loss)
        return median

    def forget_pending(self) -> None:
        """Drop recorded losses not yet checked (the steps a rollback undoes)."""
        self._pending.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history), "rollback_steps": list(self.rollback_steps)}

    def load_state_dict(self, state: dict[str, Any] | None, keep_rollbacks: bool = False) -> None:
        """Restore a checkpoint's history (none in checkpoints older than this detector; older ones kept a
        count of rollbacks without their steps, which starts the budget afresh). A rollback keeps its own
        (`keep_rollbacks`): the checkpoint it restores predates the rollbacks made since."""
        state = state or {}
        self.history = deque(state.get("history", []), maxlen=self.cfg.window)
        if not keep_rollbacks:
            self.rollback_steps = [int(s) for s in state.get("rollback_steps", [])]
        self._pending.clear()
