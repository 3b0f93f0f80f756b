"""The chunk-parallel gradient kernels of the SOE scan's backward: the cross-chunk part (reads of the
entering states, writes of the leaving ones) and the intra-chunk part, apart so that neither holds both
the per-term state tiles and the [BT, BT] tiles in registers. Both write partials, indexed by (part,
value block): dq, dk, dv, dcoef [2 * NV, ...] and dll [2 * NV, n_chunks * B*H, S], summed afterwards in a
fixed order (dv's value blocks are disjoint, so its partials are [2, ...])."""

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
def _chunk_rows(q, k, v, d_out, d_z, docs, seq_len, BH, H, F, DV, BT: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr):
    """This program's chunk, rows, q, k, v, dO tiles [BT, .] (input dtype), dz [BT] (first value block only)
    and document masks."""
    c, bh, b, h, start = chunk_program(BH, H, BT)
    base, loc, mask_t = token_rows(b, h, start, seq_len, H, BT)
    offs_f = tl.arange(0, BF)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    qc = load_rows(q, base, loc, F, offs_f, mask_t)
    kc = load_rows(k, base, loc, F, offs_f, mask_t)
    vc = load_rows(v, base, loc, DV, offs_d, mask_t)
    doc = load_rows(d_out, base, loc, DV, offs_d, mask_t)
    dzc = tl.load(d_z + base + loc, mask=mask_t & first_block(BT), other=0.0)
    masks = document_masks(docs, b, start, seq_len, BT)
    return c, bh, h, start, base, loc, mask_t, offs_f, offs_d, qc, kc, vc, doc, dzc, masks


@triton.jit
def _store_partials(
    dq, dk, dv, part, kind, base, loc, seq_len, BH, F, DV, offs_f, offs_d, mask_t, dq_acc, dk_acc, dv_acc
):
    """Store dq, dk [BT, BF] into rows of the [2 * NV * B*T*H, F] partials (``part``) and dv [BT, BD], whose
    value blocks are disjoint, into rows of the [2 * B*T*H, DV] ones (``kind``: 0 cross, 1 intra)."""
    rows = part * seq_len * BH
    store_rows(dq, base + rows, loc, F, offs_f, mask_t, dq_acc)
    store_rows(dk, base + rows, loc, F, offs_f, mask_t, dk_acc)
    store_rows(dv, base + kind * seq_len * BH, loc, DV, offs_d, mask_t, dv_acc)


@triton.jit
def cross_grads_kernel(
    q, k, v, coef, log_lam, docs, states, d_out, d_z, d_states, dq, dk, dv, dcoef, dll,
    seq_len, BH, H, S, F, DV, W, centre,
    BT: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The cross-chunk gradients of one chunk and value block (part 0): per term, the query gradient of
    its reads of the entering state G_s, b_s (slot ``chunk``), the key, value and coef gradients of its
    writes to the leaving state (its gradient dG_s, db_s in slot ``chunk + 1`` of ``d_states``) and
    d log_lam's reader sum at +(t - centre) and writer sum at -(t - centre)."""
    c, bh, h, start, base, loc, mask_t, offs_f, offs_d, qc, kc, vc, doc, dzc, masks = _chunk_rows(
        q, k, v, d_out, d_z, docs, seq_len, BH, H, F, DV, BT, BF, BD
    )
    pos, n, reads, writes, _linked, _diff = masks
    _f, _d, tile, tile_mask, norm_off, norm_mask = state_offsets(F, DV, BF, BD)
    qf, kf = qc.to(tl.float32), kc.to(tl.float32)
    centred = start + pos - centre
    dq_acc = tl.zeros([BT, BF], dtype=tl.float32)
    dk_acc = tl.zeros([BT, BF], dtype=tl.float32)
    dv_acc = tl.zeros([BT, BD], dtype=tl.float32)
    part = tl.program_id(1).to(tl.int64)
    KIND = 0
    for s in range(0, S):
        ll = tl.load(log_lam + h * S + s)
        cs = tl.load(coef + base * S + (loc * S + s), mask=mask_t, other=0.0).to(tl.float32)
        q_dec, k_dec = term_decays(ll, pos, n, reads, writes)
        row = state_row(states, c, bh, s, BH, S, W)
        g = tl.load(row + tile, mask=tile_mask, other=0.0).to(vc.dtype)
        norm = tl.load(row + norm_off, mask=norm_mask, other=0.0)
        d_qd = tl.dot(doc, tl.trans(g), input_precision=PRECISION) + dzc[:, None] * norm[None, :]
        dq_s = d_qd * q_dec[:, None]
        dq_acc += dq_s
        ll_s = tl.sum(tl.sum(dq_s * qf, axis=1) * centred, axis=0)
        row = state_row(d_states, c + 1, bh, s, BH, S, W)
        dg = tl.load(row + tile, mask=tile_mask, other=0.0).to(vc.dtype)
        d_norm = tl.load(row + norm_off, mask=norm_mask, other=0.0)
        d_keys = tl.dot(vc, tl.trans(dg), input_precision=PRECISION) + d_norm[None, :]
        key_scale = k_dec * cs
        dk_acc += d_keys * key_scale[:, None]
        dv_acc += tl.dot((kf * key_scale[:, None]).to(vc.dtype), dg, input_precision=PRECISION)
        d_coef = tl.sum(d_keys * kf, axis=1) * k_dec
        ll_s -= tl.sum(d_coef * cs * centred, axis=0)
        tl.store(dcoef + part * seq_len * BH * S + base * S + (loc * S + s), d_coef, mask=mask_t)
        tl.store(dll + ((part * tl.num_programs(0) + c * BH + bh) * S + s), ll_s)
    _store_partials(
        dq, dk, dv, part, KIND, base, loc, seq_len, BH, F, DV, offs_f, offs_d, mask_t, dq_acc, dk_acc, dv_acc
    )


@triton.jit
def intra_grads_kernel(
    q, k, v, coef, log_lam, docs, d_out, d_z, dq, dk, dv, dcoef, dll,
    seq_len, BH, H, S, F, DV,
    BT: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The intra-chunk gradients of one chunk and value block (part 1): P = (Q K^T) * Wc with Wc[i, j] =
    sum_s coef_js lam_s^(i-j) gives dq, dk, dv, each term's coef gradient and d log_lam (pairs at their
    distance i - j)."""
    c, bh, h, _start, base, loc, mask_t, offs_f, offs_d, qc, kc, vc, doc, dzc, masks = _chunk_rows(
        q, k, v, d_out, d_z, docs, seq_len, BH, H, F, DV, BT, BF, BD
    )
    _pos, _n, _reads, _writes, linked, diff = masks
    scores = tl.dot(qc, tl.trans(kc), input_precision=PRECISION)
    d_p = tl.dot(doc, tl.trans(vc), input_precision=PRECISION) + dzc[:, None]  # dL/dP
    d_s = d_p * scores
    weights = tl.zeros([BT, BT], dtype=tl.float32)
    part = (tl.program_id(1) + tl.num_programs(1)).to(tl.int64)
    KIND = 1
    for s in range(0, S):
        ll = tl.load(log_lam + h * S + s)
        cs = tl.load(coef + base * S + (loc * S + s), mask=mask_t, other=0.0).to(tl.float32)
        decays = intra_decay(ll, linked, diff)
        weights += decays * cs[None, :]
        d_w = d_s * decays
        tl.store(dcoef + part * seq_len * BH * S + base * S + (loc * S + s), tl.sum(d_w, axis=0), mask=mask_t)
        ll_s = tl.sum(tl.sum(d_w * diff, axis=0) * cs, axis=0)
        tl.store(dll + ((part * tl.num_programs(0) + c * BH + bh) * S + s), ll_s)
    d_a = (d_p * weights).to(qc.dtype)
    dq_acc = tl.dot(d_a, kc, input_precision=PRECISION)
    dk_acc = tl.dot(tl.trans(d_a), qc, input_precision=PRECISION)
    dv_acc = tl.dot(tl.trans(scores * weights).to(doc.dtype), doc, input_precision=PRECISION)
    _store_partials(
        dq, dk, dv, part, KIND, base, loc, seq_len, BH, F, DV, offs_f, offs_d, mask_t, dq_acc, dk_acc, dv_acc
    )
