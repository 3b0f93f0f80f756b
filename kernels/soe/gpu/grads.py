"""The chunk-parallel gradient kernel of the SOE scan's backward."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.soe.gpu.tiles import (
    chunk_program,
    document_masks,
    first_block,
    intra_decay,
    load_rows,
    state_offsets,
    state_row,
    store_rows,
    term_decays,
    token_rows,
)


@triton.jit
def _term_grads(
    qf, kf, vc, doc, dzc, d_p, scores, states, d_states, c, bh, s, ll, cs, pos, n, reads, writes, linked, diff,
    tile, tile_mask, norm_off, norm_mask, centre, start, BH, S, W, PRECISION: tl.constexpr,
):  # fmt: skip
    """One term's share of a chunk's gradients: the query gradient of its cross-chunk reads (entering state
    G_s, b_s of slot ``c``), the key and value gradients of its cross-chunk writes (the gradient dG_s, db_s
    of the state leaving the chunk, slot ``c + 1`` of ``d_states``), its coef gradient [BT] and its
    d log_lam (reads at +(t - centre), writes at -(t - centre), intra pairs at their distance)."""
    q_dec, k_dec = term_decays(ll, pos, n, reads, writes)
    row = state_row(states, c, bh, s, BH, S, W)
    g = tl.load(row + tile, mask=tile_mask, other=0.0).to(vc.dtype)
    norm = tl.load(row + norm_off, mask=norm_mask, other=0.0)
    d_qd = tl.dot(doc, tl.trans(g), input_precision=PRECISION) + dzc[:, None] * norm[None, :]
    dq = d_qd * q_dec[:, None]
    centred = start + pos - centre
    ll_grad = tl.sum(tl.sum(dq * qf, axis=1) * centred, axis=0)
    row = state_row(d_states, c + 1, bh, s, BH, S, W)
    dg = tl.load(row + tile, mask=tile_mask, other=0.0).to(vc.dtype)
    d_norm = tl.load(row + norm_off, mask=norm_mask, other=0.0)
    d_keys = tl.dot(vc, tl.trans(dg), input_precision=PRECISION) + d_norm[None, :]
    key_scale = k_dec * cs
    dk = d_keys * key_scale[:, None]
    dv = tl.dot((kf * key_scale[:, None]).to(vc.dtype), dg, input_precision=PRECISION)
    d_coef = tl.sum(d_keys * kf, axis=1) * k_dec
    ll_grad -= tl.sum(d_coef * cs * centred, axis=0)
    decays = intra_decay(ll, linked, diff)
    d_w = d_p * scores * decays
    ll_grad += tl.sum(tl.sum(d_w * diff, axis=0) * cs, axis=0)
    return dq, dk, dv, d_coef + tl.sum(d_w, axis=0), ll_grad, decays


@triton.jit
def grads_kernel(
    q,
    k,
    v,
    coef,
    log_lam,
    docs,
    states,
    d_out,
    d_z,
    d_states,
    dq,
    dk,
    dv,
    dcoef,
    dll,
    seq_len,
    BH,
    H,
    S,
    F,
    DV,
    W,
    centre,
    BT: tl.constexpr,
    BF: tl.constexpr,
    BD: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Every input gradient of one chunk and value block, from one read of its q, k, v, dO tiles and the
    per-term states around it. dv is complete per value block and stored as it is; dq, dk, dcoef [NV, ...]
    and dll [NV, n_chunks, B*H, S] are this value block's partials (plain stores), summed over value
    blocks and chunks afterwards in a fixed order."""
    c, bh, b, h, start = chunk_program(BH, H, BT)
    base, loc, mask_t = token_rows(b, h, start, seq_len, H, BT)
    offs_f, offs_d, tile, tile_mask, norm_off, norm_mask = state_offsets(F, DV, BF, BD)
    qc = load_rows(q, base, loc, F, offs_f, mask_t)
    kc = load_rows(k, base, loc, F, offs_f, mask_t)
    vc = load_rows(v, base, loc, DV, offs_d, mask_t)
    doc = load_rows(d_out, base, loc, DV, offs_d, mask_t)
    dzc = tl.load(d_z + base + loc, mask=mask_t & first_block(BT), other=0.0)
    pos, n, reads, writes, linked, diff = document_masks(docs, b, start, seq_len, BT)
    qf, kf = qc.to(tl.float32), kc.to(tl.float32)
    scores = tl.dot(qc, tl.trans(kc), input_precision=PRECISION)
    d_p = tl.dot(doc, tl.trans(vc), input_precision=PRECISION) + dzc[:, None]  # dL/dP, P = (Q K^T) * Wc
    weights = tl.zeros([BT, BT], dtype=tl.float32)
    dq_acc = tl.zeros([BT, BF], dtype=tl.float32)
    dk_acc = tl.zeros([BT, BF], dtype=tl.float32)
    dv_acc = tl.zeros([BT, BD], dtype=tl.float32)
    part = tl.program_id(1).to(tl.int64)
    for s in range(0, S):
        ll = tl.load(log_lam + h * S + s)
        cs = tl.load(coef + base * S + (loc * S + s), mask=mask_t, other=0.0).to(tl.float32)
        dq_s, dk_s, dv_s, dc_s, ll_s, decays = _term_grads(
            qf, kf, vc, doc, dzc, d_p, scores, states, d_states, c, bh, s, ll, cs, pos, n, reads, writes,
            linked, diff, tile, tile_mask, norm_off, norm_mask, centre, start, BH, S, W, PRECISION,
        )  # fmt: skip
        dq_acc += dq_s
        dk_acc += dk_s
        dv_acc += dv_s
        weights += decays * cs[None, :]
        tl.store(dcoef + part * seq_len * BH * S + base * S + (loc * S + s), dc_s, mask=mask_t)
        tl.store(dll + ((part * tl.num_programs(0) + c * BH + bh) * S + s), ll_s)
    d_a = d_p * weights
    dq_acc += tl.dot(d_a.to(qc.dtype), kc, input_precision=PRECISION)
    dk_acc += tl.dot(tl.trans(d_a).to(qc.dtype), qc, input_precision=PRECISION)
    dv_acc += tl.dot(tl.trans(scores * weights).to(doc.dtype), doc, input_precision=PRECISION)
    rows = part * seq_len * BH  # this value block's partial: rows of [NV * B*T*H, F]
    store_rows(dq, base + rows, loc, F, offs_f, mask_t, dq_acc)
    store_rows(dk, base + rows, loc, F, offs_f, mask_t, dk_acc)
    store_rows(dv, base, loc, DV, offs_d, mask_t, dv_acc)
