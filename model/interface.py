"""The small surface through which training, evaluation and export see a model."""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig

IGNORE_INDEX = -100
"""Label value of positions that are not scored (PyTorch cross-entropy's default ignore_index)."""


class LMOutput(NamedTuple):
    """Next-token logits [B, T, V] and the recurrent state after the last token (None if stateless)."""

    logits: torch.Tensor
    state: Any


class CausalLM(nn.Module):
    """Base class of every model family.

    Subclasses implement `forward`, `flops_per_token` and, when they carry memory across calls,
    `init_state`. A state returned by `forward` can be fed to the next call so that a long
    sequence processed piece by piece gives the same outputs as processed whole.
    """

    config: ModelConfig
    streams_exactly: ClassVar[bool] = True
    """Whether the state carries all a later call needs from earlier tokens, so that a sequence fed
    piece by piece gives the outputs of the whole; False for a model that forgets across calls."""

    def forward(self, input_ids: torch.Tensor, state: Any = None) -> LMOutput:
        raise NotImplementedError

    def init_state(self, batch_size: int, device: torch.device | str = "cpu") -> Any:
        """The state before the first token; None for models without recurrent memory."""
        return None

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor, state: Any = None) -> tuple[torch.Tensor, Any]:
        """Mean next-token cross-entropy in nats over labels != IGNORE_INDEX, and the new state."""
        logits, new_state = self(input_ids, state)
        loss = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX
        )
        return loss, new_state

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token at the given context length."""
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        """Model-specific statistics for the trainer's logger (scalars or 1-D tensors as histograms)."""
        return {}

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= sum(p.numel() for n, p in self.named_parameters() if n.endswith("embed.weight"))
        return total
