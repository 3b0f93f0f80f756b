"""Model hyper-parameters: the fields every family shares, plus one section per family."""

from __future__ import annotations

import dataclasses
from typing import Literal

ModelKind = Literal["transformer"]


@dataclasses.dataclass
class ModelConfig:
    """Architecture of one causal language model.

    `kind` picks the family; the shared fields size it. Family-specific settings live in their own
    sections so that a config names only what it changes.
    """

    kind: ModelKind = "transformer"
    vocab_size: int = 258
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    mlp_ratio: float = 4.0
    max_seq_len: int = 4096
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for key in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            value = getattr(self, key)
            if value < 1:
                raise ValueError(f"{key}: must be >= 1, got {value}")
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads: must divide d_model={self.d_model}, got {self.n_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(f"n_heads: head dim d_model/n_heads must be even (rotary), got {self.n_heads}")
        if self.mlp_ratio <= 0:
            raise ValueError(f"mlp_ratio: must be > 0, got {self.mlp_ratio}")
        if self.init_std <= 0:
            raise ValueError(f"init_std: must be > 0, got {self.init_std}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads
