"""Softmax-attention Transformer baseline (pre-norm, rotary, SwiGLU), same sizes as the others."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from model.blocks import (
    Offset,
    RMSNorm,
    StackedLM,
    SwiGLU,
    apply_rotary,
    attention,
    document_ids,
    next_offset,
    rotary_tables,
    short_convolution,
    token_positions,
)
from model.config import ModelConfig


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention through torch's fused SDPA.

    Streaming state is the position of the next token (positions continue across calls); the
    baseline keeps no KV cache, so a piece attends only within itself — by design it is the
    fixed-window model the recurrent families are compared against. With ``doc_start`` a token
    attends only to its own document, at positions counted from the document's start (a document
    begun in an earlier call continues its positions).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_base = config.n_heads, config.head_dim, config.rope_base
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.out = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, offset: Offset, doc_start: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim).unbind(2)
        positions = token_positions(offset, T, doc_start, x.device)
        cos, sin = rotary_tables(positions, self.head_dim, self.rope_base)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if doc_start is None:
            y = attention(q, k, v, is_causal=True)
        else:
            ids = document_ids(doc_start)
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            mask = causal & (ids[:, :, None] == ids[:, None, :])  # [B, T (query), T (key)]
            y = attention(q, k, v, attn_mask=mask[:, None])
        return self.out(y.transpose(1, 2).reshape(B, T, -1))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: (short convolution,) attention, SwiGLU MLP.

    Like the attention, the short convolution starts afresh at each call (zeros before its first
    token): the baseline forgets across calls as a whole."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.short_conv = short_convolution(config)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config.d_model, config.mlp_ratio)

    def forward(
        self, x: torch.Tensor, state: Any, sequence_parallel: None = None, doc_start: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, Offset]:
        offset = 0 if state is None else state
        h = self.attn_norm(x)
        if self.short_conv is not None:
            h, _ = self.short_conv(h, None, doc_start=doc_start)
        x = x + self.attn(h, offset, doc_start)
        x = x + self.mlp(self.mlp_norm(x))
        return x, next_offset(offset, x.shape[1], doc_start)


class Transformer(StackedLM):
    streams_exactly = False  # the state is only the position: each call attends within itself
    carries_memory = False

    @classmethod
    def sequence_parallel_problem(cls, config: ModelConfig, piece: int) -> str | None:
        return f"model.kind={config.kind!r} cannot run sequence-parallel (softmax attention needs every earlier key)"

    def cache_floats(self, seq_len: int) -> int:
        """The keys and values a cache would hold (this model recomputes them instead)."""
        return 2 * seq_len * self.config.d_model * self.config.n_layers

    def __init__(self, config: ModelConfig):
        super().__init__(config, lambda _: TransformerBlock(config))

    def flops_per_token(self, seq_len: int) -> float:
        """6 per matmul parameter, plus causal attention: QK^T and AV over on average T/2 keys."""
        c = self.config
        attention = 2 * 2 * c.n_layers * c.d_model * (seq_len / 2)
        return 6.0 * self.matmul_params() + 3 * attention
