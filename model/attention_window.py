"""Causal sliding-window attention in O(T*W) memory, with a streaming key/value cache.

Each query attends to the `window` most recent positions, itself included. The sequence is cut into
blocks of `window` queries; a block attends to a 2*window slice of keys (the previous block and its
own) through SDPA with one small band mask shared by every block, so no T x T matrix ever exists.
Streaming: the last window-1 rotated keys and values are carried to the next call, which prepends
them, so a sequence processed piecewise sees exactly the keys it would see processed whole. A
sequence-parallel piece gets the same window-1 keys and values (the halo) from the previous rank, and
sends their gradients back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.parallel import exchange_with_neighbours
from model.blocks import Offset, apply_rotary, attention, prefix_document_ids, rotary_tables, token_positions
from model.interface import SequenceParallel


def window_band_mask(window: int, n_blocks: int, n_cached: int, device: torch.device | str) -> torch.Tensor:
    """Boolean mask [n_blocks, 1, window, 2*window]: True where a query may attend to a key.

    Query r of block b sits at padded key coordinate (b+1)*window + r; key j of the block's slice
    at b*window + j. Allowed: r < j <= r + window (the last `window` positions, itself included),
    and the key must be real — the left padding before the n_cached cached keys is masked.
    """
    r = torch.arange(window, device=device)[:, None]
    j = torch.arange(2 * window, device=device)[None, :]
    band = (j > r) & (j <= r + window)
    coord = torch.arange(n_blocks, device=device)[:, None, None] * window + j[None]
    real = coord >= window - n_cached
    return (band[None] & real)[:, None]


class SlidingWindowAttention(nn.Module):
    """Multi-head causal attention over a sliding window, rotary positions, blocked SDPA."""

    def __init__(self, d_model: int, n_heads: int, window: int, rope_base: float):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.window, self.rope_base = window, rope_base
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cache_k: torch.Tensor | None,
        cache_v: torch.Tensor | None,
        offset: Offset,
        sequence_parallel: SequenceParallel | None = None,
        doc_start: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Attend x [B, T, d] at positions offset.. ; returns (output, new cache_k, new cache_v).

        Caches are [B, heads, C, head_dim] with C <= window - 1 (rotated keys), or None before the
        first token. With ``sequence_parallel`` the cache is the previous rank's halo (T >= window - 1).
        With ``doc_start`` (bool [B, T]) a token attends only to its own document, at positions counted
        from the document's start; ``offset`` is then the first token's position within its document,
        which says how many cached (or halo) keys belong to that document.
        """
        B, T, _ = x.shape
        W = self.window
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim).unbind(2)
        positions = token_positions(offset, T, doc_start, x.device)
        cos, sin = rotary_tables(positions, self.head_dim, self.rope_base)
        q, k = apply_rotary(q, cos, sin).transpose(1, 2), apply_rotary(k, cos, sin).transpose(1, 2)
        v = v.transpose(1, 2)
        if sequence_parallel is not None and W > 1:
            k, v, cache_k, cache_v = self._halo(k, v, sequence_parallel)
        if cache_k is not None:
            k = torch.cat((cache_k.to(k.dtype), k), dim=2)
            v = torch.cat((cache_v.to(v.dtype), v), dim=2)
        n_cached = k.shape[2] - T
        n_blocks = -(-T // W)
        # keys: left-pad the cache to exactly W, right-pad to (n_blocks + 1) * W; queries: pad to n_blocks * W
        k_pad = F.pad(k, (0, 0, W - n_cached, n_blocks * W - T))
        v_pad = F.pad(v, (0, 0, W - n_cached, n_blocks * W - T))
        q_pad = F.pad(q, (0, 0, 0, n_blocks * W - T))
        k_blocks = k_pad.unfold(2, 2 * W, W).transpose(-1, -2)  # [B, H, nb, 2W, D]
        v_blocks = v_pad.unfold(2, 2 * W, W).transpose(-1, -2)
        q_blocks = q_pad.view(B, self.n_heads, n_blocks, W, self.head_dim)
        mask = window_band_mask(W, n_blocks, n_cached, x.device)
        if doc_start is not None:  # keys and queries padded and cut into blocks as k and q are
            ids = prefix_document_ids(doc_start, offset, W)  # the W key slots before the first query, then T
            key_ids = F.pad(ids, (0, n_blocks * W - T), value=-1).unfold(1, 2 * W, W)  # [B, nb, 2W]
            query_ids = F.pad(ids[:, W:], (0, n_blocks * W - T), value=-1).view(B, n_blocks, W)
            mask = mask[None] & (query_ids[..., None] == key_ids[:, :, None, :])[:, :, None]  # [B, nb, 1, W, 2W]
        y = attention(
            q_blocks.transpose(1, 2), k_blocks.transpose(1, 2), v_blocks.transpose(1, 2), attn_mask=mask
        )  # [B, nb, H, W, D]
        y = y.transpose(1, 2).reshape(B, self.n_heads, n_blocks * W, self.head_dim)[:, :, :T]
        first_kept = max(0, k.shape[2] - (W - 1))
        new_k, new_v = k[:, :, first_kept:], v[:, :, first_kept:]
        return self.out(y.transpose(1, 2).reshape(B, T, -1)), new_k, new_v

    def _halo(self, k: torch.Tensor, v: torch.Tensor, sp: SequenceParallel) -> tuple[torch.Tensor, ...]:
        """Send this piece's last window-1 keys and values to the next rank, receive the previous
        rank's (None on the first rank); k and v come back carrying the next rank's gradients."""
        tail = self.window - 1
        if k.shape[2] < tail:
            raise ValueError(f"a sequence-parallel piece of {k.shape[2]} tokens is shorter than the halo of {tail}")
        kv = torch.stack((k[:, :, -tail:], v[:, :, -tail:]))
        kv, previous = exchange_with_neighbours(kv, sp.group)
        k = torch.cat((k[:, :, :-tail], kv[0]), dim=2)
        v = torch.cat((v[:, :, :-tail], kv[1]), dim=2)
        return (k, v, None, None) if previous is None else (k, v, previous[0], previous[1])
