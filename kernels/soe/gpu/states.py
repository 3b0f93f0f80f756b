"""The chunk-state kernel of the SOE scan: each chunk's own contribution to every term's state, chunk
parallel. The light sequence pass (kernels.span's pass, one step per chunk) then turns contributions into
the states entering the chunks."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.soe.gpu.tiles import (
    chunk_setup,
    load_rows,
    state_offsets,
    state_row,
    term_decays,
)


@triton.jit
def chunk_state_kernel(
    x,
    y,
    coef,
    y_norm,
    log_lam,
    docs,
    states,
    seq_len,
    BH,
    H,
    S,
    F,
    DV,
    W,
    BT: tl.constexpr,
    BF: tl.constexpr,
    BD: tl.constexpr,
    REVERSE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One chunk's contribution for all S terms, from one read of its x and y tiles. Forward (x = k,
    y = v): into slot ``chunk + 1``, G_s = sum_j lam_s^(n-1-j) coef_js k_j v_j^T and b_s the same with
    k_j alone. REVERSE (x = q, y = dO, y_norm = dz): into slot ``chunk``, the gradient its reads give
    the state entering it, sum_i lam_s^(i+1) q_i do_i^T, and b_s's with dz. Plain stores: each program
    owns its slots' tiles."""
    c, bh, h, _start, base, loc, mask_t, masks = chunk_setup(docs, seq_len, BH, H, BT)
    pos, n, reads, writes, _linked, _diff = masks
    offs_f, offs_d, tile, tile_mask, norm_off, norm_mask = state_offsets(F, DV, BF, BD)
    xf = load_rows(x, base, loc, F, offs_f, mask_t).to(tl.float32)
    yc = load_rows(y, base, loc, DV, offs_d, mask_t)
    if REVERSE:
        weight = tl.load(y_norm + base + loc, mask=mask_t, other=0.0).to(tl.float32)
        slot = c
    else:
        weight = tl.where(mask_t, 1.0, 0.0)
        slot = c + 1
    for s in range(0, S):
        ll = tl.load(log_lam + h * S + s)
        q_dec, k_dec = term_decays(ll, pos, n, reads, writes)
        if REVERSE:
            scale = q_dec
        else:
            scale = k_dec * tl.load(coef + base * S + (loc * S + s), mask=mask_t, other=0.0).to(tl.float32)
        scaled = xf * scale[:, None]
        g = tl.dot(tl.trans(scaled.to(yc.dtype)), yc, input_precision=PRECISION)
        row = state_row(states, slot, bh, s, BH, S, W)
        tl.store(row + tile, g, mask=tile_mask)
        tl.store(row + norm_off, tl.sum(scaled * weight[:, None], axis=0), mask=norm_mask)
