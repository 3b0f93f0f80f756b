"""Triton helpers of the SOE entering-state read's chunk kernels (kernels/soe/gpu/entering.py): which chunk
a program owns, where its rows are, and where a term's state lies in a packed buffer.

Every chunk kernel runs one program per (chunk, batch x head) on grid axis 0 (``chunk * BH + bh``: the
long axis, so 1M tokens stay far inside its 2^31 - 1 limit) and one per value block on axis 1.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def chunk_program(BH, H, BT: tl.constexpr):
    """(chunk index, batch x head, batch, head, first token) of this program."""
    pid = tl.program_id(0)
    c = pid // BH
    bh = pid % BH
    return c, bh, bh // H, bh % H, c * BT


@triton.jit
def token_rows(b, h, start, seq_len, H, BT: tl.constexpr):
    """Where the chunk's tokens are in the [B*T*H, X] views: row ``base + loc[i]``, ``base`` an int64
    scalar (base * X overflows int32 at batch 8, 512k tokens) and ``loc`` int32, and the [BT] mask of the
    tokens inside the sequence."""
    base = (b.to(tl.int64) * seq_len + start) * H + h
    loc = tl.arange(0, BT) * H
    return base, loc, start + tl.arange(0, BT) < seq_len


@triton.jit
def load_rows(ptr, base, loc, width, offs, mask_t):
    """The [BT, len(offs)] tile at columns ``offs`` (< width) of the chunk's rows, zero where masked."""
    mask = mask_t[:, None] & (offs < width)[None, :]
    return tl.load(ptr + base * width + (loc[:, None] * width + offs[None, :]), mask=mask, other=0.0)


@triton.jit
def store_rows(ptr, base, loc, width, offs, mask_t, x):
    """Store x [BT, len(offs)] at columns ``offs`` (< width) of the chunk's rows."""
    mask = mask_t[:, None] & (offs < width)[None, :]
    tl.store(ptr + base * width + (loc[:, None] * width + offs[None, :]), x, mask=mask)


@triton.jit
def state_row(states, slot, bh, s, BH, S, W):
    """Pointer to term ``s`` of batch x head ``bh`` in slot ``slot`` of a packed [slots, BH*S, W] state
    (W = F*DV + F: G_s row-major, then b_s); 64-bit offsets (slot * BH stays far below 2^31)."""
    return states + ((slot * BH + bh).to(tl.int64) * S + s) * W


@triton.jit
def state_offsets(F, DV, BF: tl.constexpr, BD: tl.constexpr):
    """Feature and value offsets of this program's state tile (value block ``program_id(1)``), the tile's
    offsets and mask in a state row, and the normaliser's offsets and mask: b_s rides with the first value
    block only (the masks are built from block comparisons, which the interpreter also accepts)."""
    keep = (tl.program_id(1) == 0).to(tl.int32)
    offs_f = tl.arange(0, BF)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    tile = offs_f[:, None] * DV + offs_d[None, :]
    tile_mask = (offs_f < F)[:, None] & (offs_d < DV)[None, :]
    return offs_f, offs_d, tile, tile_mask, F * DV + offs_f, offs_f < F * keep


@triton.jit
def first_block(BT: tl.constexpr):
    """[BT] all true in the first value block's programs (which alone handle z), all false elsewhere."""
    return tl.arange(0, BT) < BT * (tl.program_id(1) == 0).to(tl.int32)
