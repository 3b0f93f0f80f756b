"""The chunk-parallel output kernel of the SOE scan's forward."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.soe.gpu.tiles import (
    chunk_setup,
    first_block,
    intra_decay,
    load_rows,
    state_offsets,
    state_row,
    store_rows,
    term_decays,
)


@triton.jit
def output_kernel(
    q,
    k,
    v,
    coef,
    log_lam,
    docs,
    states,
    out,
    z,
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
    PRECISION: tl.constexpr,
):
    """o and z of one chunk and value block, the S terms folded in: o = sum_s (lam_s^(i+1) q_i) G_s +
    (Q K^T * Wc) V with Wc[i, j] = sum_s coef_js lam_s^(i-j) (causal, same document), z likewise with
    b_s and a column of ones; G_s, b_s from slot ``chunk`` (the states entering the chunks). q, k, v are
    read once; plain stores (z by the first value block)."""
    c, bh, h, _start, base, loc, mask_t, masks = chunk_setup(docs, seq_len, BH, H, BT)
    pos, n, reads, writes, linked, diff = masks
    offs_f, offs_d, tile, tile_mask, norm_off, norm_mask = state_offsets(F, DV, BF, BD)
    qc = load_rows(q, base, loc, F, offs_f, mask_t)
    kc = load_rows(k, base, loc, F, offs_f, mask_t)
    vc = load_rows(v, base, loc, DV, offs_d, mask_t)
    scores = tl.dot(qc, tl.trans(kc), input_precision=PRECISION)
    qf = qc.to(tl.float32)
    weights = tl.zeros([BT, BT], dtype=tl.float32)
    o = tl.zeros([BT, BD], dtype=tl.float32)
    zc = tl.zeros([BT], dtype=tl.float32)
    for s in range(0, S):
        ll = tl.load(log_lam + h * S + s)
        q_dec, _k_dec = term_decays(ll, pos, n, reads, writes)
        cs = tl.load(coef + base * S + (loc * S + s), mask=mask_t, other=0.0).to(tl.float32)
        weights += intra_decay(ll, linked, diff) * cs[None, :]
        row = state_row(states, c, bh, s, BH, S, W)
        g = tl.load(row + tile, mask=tile_mask, other=0.0)
        norm = tl.load(row + norm_off, mask=norm_mask, other=0.0)
        qd = qf * q_dec[:, None]
        o += tl.dot(qd.to(vc.dtype), g.to(vc.dtype), input_precision=PRECISION)
        zc += tl.sum(qd * norm[None, :], axis=1)
    p = scores * weights
    o += tl.dot(p.to(vc.dtype), vc, input_precision=PRECISION)
    zc += tl.sum(p, axis=1)
    store_rows(out, base, loc, DV, offs_d, mask_t, o)
    tl.store(z + base + loc, zc, mask=mask_t & first_block(BT))
