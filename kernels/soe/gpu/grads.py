"""The chunk-parallel gradient kernels of the SOE scan's backward, in three parts so that no program
holds more than a few fp32 [BT, BT] or [BT, BF] tiles at once (the vort-125m shapes spilled when reads,
writes and the intra-chunk part shared one or two programs):

- reads (part 0): each token's reads of the entering states G_s, b_s give dq and d log_lam's reader
  sum; it loads only q, dO, dz and the states;
- writes (part 1): each token's writes to the leaving states give dk, dv, dcoef and the writer sum of
  d log_lam; it loads only k, v, coef and the state gradients;
- intra (part 2): the pairs inside the chunk give every input gradient.

Each writes partials indexed by value block (dq, dk, dcoef [2 * NV, ...]: cross then intra; dll
[3 * NV, n_chunks * B*H, S]: reads, writes, intra; dv [2, ...], its value blocks being disjoint), summed
afterwards in a fixed order."""

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
def _store_dll(dll, part, c, bh, BH, S, s, value):
    """d log_lam's partial sum of term ``s`` for this chunk and batch x head, in partial ``part``."""
    tl.store(dll + ((part * tl.num_programs(0) + c * BH + bh) * S + s), value)


@triton.jit
def read_grads_kernel(
    q, log_lam, docs, states, d_out, d_z, dq, dll,
    seq_len, BH, H, S, F, DV, W, centre,
    BT: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The gradients of one chunk's reads of the entering states (value block ``program_id(1)``): per
    term, dq += lam_s^(i+1) (dO G_s^T + dz b_s^T) and d log_lam's reader sum at +(t - centre)."""
    c, bh, h, start, base, loc, mask_t, masks = chunk_setup(docs, seq_len, BH, H, BT)
    pos, n, reads, writes, _linked, _diff = masks
    offs_f, offs_d, tile, tile_mask, norm_off, norm_mask = state_offsets(F, DV, BF, BD)
    qf = load_rows(q, base, loc, F, offs_f, mask_t).to(tl.float32)
    doc = load_rows(d_out, base, loc, DV, offs_d, mask_t)
    dzc = tl.load(d_z + base + loc, mask=mask_t & first_block(BT), other=0.0)
    centred = start + pos - centre
    dq_acc = tl.zeros([BT, BF], dtype=tl.float32)
    part = tl.program_id(1).to(tl.int64)
    for s in range(0, S):
        ll = tl.load(log_lam + h * S + s)
        q_dec, _k_dec = term_decays(ll, pos, n, reads, writes)
        row = state_row(states, c, bh, s, BH, S, W)
        g = tl.load(row + tile, mask=tile_mask, other=0.0).to(doc.dtype)
        norm = tl.load(row + norm_off, mask=norm_mask, other=0.0)
        d_qd = tl.dot(doc, tl.trans(g), input_precision=PRECISION) + dzc[:, None] * norm[None, :]
        dq_acc += d_qd * q_dec[:, None]
        _store_dll(dll, part, c, bh, BH, S, s, tl.sum(tl.sum(d_qd * qf, axis=1) * q_dec * centred, axis=0))
    store_rows(dq, base + part * seq_len * BH, loc, F, offs_f, mask_t, dq_acc)


@triton.jit
def write_grads_kernel(
    k, v, coef, log_lam, docs, d_states, dk, dv, dcoef, dll,
    seq_len, BH, H, S, F, DV, W, centre,
    BT: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The gradients of one chunk's writes to the leaving states (value block ``program_id(1)``): per
    term, with dG_s, db_s the gradient of the state leaving the chunk (slot ``chunk + 1``), the key,
    value and coef gradients and d log_lam's writer sum at -(t - centre)."""
    c, bh, h, start, base, loc, mask_t, masks = chunk_setup(docs, seq_len, BH, H, BT)
    pos, n, reads, writes, _linked, _diff = masks
    offs_f, offs_d, tile, tile_mask, norm_off, norm_mask = state_offsets(F, DV, BF, BD)
    kf = load_rows(k, base, loc, F, offs_f, mask_t).to(tl.float32)
    vc = load_rows(v, base, loc, DV, offs_d, mask_t)
    centred = start + pos - centre
    dk_acc = tl.zeros([BT, BF], dtype=tl.float32)
    dv_acc = tl.zeros([BT, BD], dtype=tl.float32)
    vb = tl.program_id(1).to(tl.int64)
    for s in range(0, S):
        ll = tl.load(log_lam + h * S + s)
        cs = tl.load(coef + base * S + (loc * S + s), mask=mask_t, other=0.0).to(tl.float32)
        _q_dec, k_dec = term_decays(ll, pos, n, reads, writes)
        row = state_row(d_states, c + 1, bh, s, BH, S, W)
        dg = tl.load(row + tile, mask=tile_mask, other=0.0).to(vc.dtype)
        d_norm = tl.load(row + norm_off, mask=norm_mask, other=0.0)
        d_keys = tl.dot(vc, tl.trans(dg), input_precision=PRECISION) + d_norm[None, :]
        key_scale = k_dec * cs
        dk_acc += d_keys * key_scale[:, None]
        dv_acc += tl.dot((kf * key_scale[:, None]).to(vc.dtype), dg, input_precision=PRECISION)
        d_coef = tl.sum(d_keys * kf, axis=1) * k_dec
        tl.store(dcoef + vb * seq_len * BH * S + base * S + (loc * S + s), d_coef, mask=mask_t)
        _store_dll(dll, vb + tl.num_programs(1), c, bh, BH, S, s, -tl.sum(d_coef * cs * centred, axis=0))
    store_rows(dk, base + vb * seq_len * BH, loc, F, offs_f, mask_t, dk_acc)
    store_rows(dv, base, loc, DV, offs_d, mask_t, dv_acc)


@triton.jit(do_not_specialize=["S"])
def intra_grads_kernel(
    q, k, v, coef, log_lam, docs, d_out, d_z, dq, dk, dv, dcoef, dll,
    seq_len, BH, H, S, F, DV,
    BT: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The intra-chunk gradients of one chunk and value block: P = (Q K^T) * Wc with Wc[i, j] = sum_s
    coef_js lam_s^(i-j) gives dq, dk, dv; then, from dL/dWc = dO V^T * Q K^T alone, each term's coef
    gradient and d log_lam (pairs at their distance i - j). Two passes over the terms (the decays are
    recomputed) so that the second holds one [BT, BT] product instead of four."""
    c, bh, h, _start, base, loc, mask_t, masks = chunk_setup(docs, seq_len, BH, H, BT)
    _pos, _n, _reads, _writes, linked, diff = masks
    offs_f, offs_d, _tile, _tile_mask, _norm_off, _norm_mask = state_offsets(F, DV, BF, BD)
    weights = tl.zeros([BT, BT], dtype=tl.float32)
    for s in range(0, S):
        ll = tl.load(log_lam + h * S + s)
        cs = tl.load(coef + base * S + (loc * S + s), mask=mask_t, other=0.0).to(tl.float32)
        weights += intra_decay(ll, linked, diff) * cs[None, :]
    qc = load_rows(q, base, loc, F, offs_f, mask_t)
    kc = load_rows(k, base, loc, F, offs_f, mask_t)
    vc = load_rows(v, base, loc, DV, offs_d, mask_t)
    doc = load_rows(d_out, base, loc, DV, offs_d, mask_t)
    dzc = tl.load(d_z + base + loc, mask=mask_t & first_block(BT), other=0.0)
    d_p = tl.dot(doc, tl.trans(vc), input_precision=PRECISION) + dzc[:, None]  # dL/dP
    scores = tl.dot(qc, tl.trans(kc), input_precision=PRECISION)
    vb = tl.program_id(1).to(tl.int64)
    part = vb + tl.num_programs(1)
    dv_acc = tl.dot(tl.trans(scores * weights).to(doc.dtype), doc, input_precision=PRECISION)
    store_rows(dv, base + seq_len * BH, loc, DV, offs_d, mask_t, dv_acc)
    d_a = (d_p * weights).to(qc.dtype)
    store_rows(dq, base + part * seq_len * BH, loc, F, offs_f, mask_t, tl.dot(d_a, kc, input_precision=PRECISION))
    dk_acc = tl.dot(tl.trans(d_a), qc, input_precision=PRECISION)
    store_rows(dk, base + part * seq_len * BH, loc, F, offs_f, mask_t, dk_acc)
    d_s = d_p * scores
    for s in range(0, S):
        ll = tl.load(log_lam + h * S + s)
        cs = tl.load(coef + base * S + (loc * S + s), mask=mask_t, other=0.0).to(tl.float32)
        d_w = d_s * intra_decay(ll, linked, diff)
        tl.store(dcoef + part * seq_len * BH * S + base * S + (loc * S + s), tl.sum(d_w, axis=0), mask=mask_t)
        _store_dll(dll, vb + 2 * tl.num_programs(1), c, bh, BH, S, s, tl.sum(tl.sum(d_w * diff, axis=0) * cs, axis=0))
