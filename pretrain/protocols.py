"""What the trainer, the checkpointer and the evaluation see of an engine and of a batch: a leaf
that imports nothing of pretrain/, so that every layer can name these types (pretrain/engines.py
implements them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from model import CausalLM

# (input_ids, labels), (input_ids, labels, carried state) under train.carry_state, or
# (input_ids, labels, carried state or None, doc_start) under data.doc_boundaries
Batch = tuple[Any, ...]


@dataclass
class StepInfo:
    """One optimizer step, as 0-d tensors on the device (reading one waits for the step to finish):
    this rank's mean micro-batch loss, the global gradient norm before clipping, whether the update
    was applied (False when it was skipped as non-finite on some rank; every rank agrees), and each
    micro-batch's state after its window when states are carried."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    applied: torch.Tensor
    states: list[Any] = field(default_factory=list)


class Engine(Protocol):
    """What the trainer and the checkpointer use of an engine: a training step, a loss without
    gradients, and the engine-native checkpoint of model and optimizer (pretrain/engines.py's docstring
    says what each engine does for each)."""

    @property
    def model(self) -> CausalLM:
        """The bare CausalLM (sharded under FSDP2 and ZeRO-3)."""

    def train_step(self, micro_batches: list[Batch], lr: float) -> StepInfo: ...

    def eval_loss(
        self, input_ids: torch.Tensor, labels: torch.Tensor, state: Any, doc_start: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, Any]: ...

    def save(self, path: str) -> None:
        """Collective: write model and optimizer state under `path` (a directory every rank sees)."""

    def load(self, path: str, scratch: Path) -> None:
        """Collective: restore what `save` wrote, possibly at another world size; `scratch` is an
        empty directory every rank sees, for a conversion on the way."""
