"""The SOE scan's backward in chunk-parallel form, for decays that need no gradient (VORT's are buffers).

The forward's chunk walk (``chunk_states_kernel``) is run again for the state entering every chunk, then:

- ``chunk_state_grads_kernel``: one program per batch x head x term walks the chunks in reverse with that
  term's state gradient in registers ([F, D] fp32) and stores, for every chunk, the gradient of the state
  leaving it (in the operands' dtype), and at the end the initial state's gradient (fp32);
- ``chunk_query_grads_kernel``: one program per chunk x batch x head makes the chunk's dq whole: the pairs
  inside the chunk through the kernel matrix of all terms, then, term by term, the reads of the state
  entering the chunk, lam^(i+1) dO_i G_s^T, and the normalisers' reads of all terms, dz_i lam^(i+1) b_s,
  in one product after the loop (as the output kernel reads them);
- ``chunk_key_value_grads_kernel``: one program per chunk x batch x head makes dk, dv and dcoef whole
  (on sm_80 as three launches, one per gradient):
  the pairs inside the chunk (dcoef's through the decay table, as the walks' coefficient kernel does),
  then, term by term, the writes into the state leaving the chunk against its gradient dH_s, db_s.

Every output element is stored once by one program, in its dtype: no atomics, and runs repeat bitwise.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.soe.gpu.forward import _chunk_range, _normaliser_slot, _owned, _state_block
from kernels.soe.gpu.walk import (
    by_distance,
    chunk_masks,
    decay_table,
    group_decays,
    kernel_matrix,
    load_tile,
    norm_tile,
    read_decays,
    store_tile,
    term_loads,
    token_base,
    write_decays,
)


@triton.jit
def chunk_state_grads_kernel(
    q, d_out, d_z, log_lam, docs, d_reads, d_edges,
    seq_len, BH, S, C0, N, H: tl.constexpr, F: tl.constexpr, DV: tl.constexpr, W: tl.constexpr,
    BT: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr, NORMS_BY_PRODUCT: tl.constexpr,
    FAST: tl.constexpr, PARTS: tl.constexpr, WARM: tl.constexpr, RESETS: tl.constexpr,
):  # fmt: skip
    """Term s's state gradient walked over chunks C0 .. C0 + N - 1 (a phase) in reverse, from the gradient
    of the state leaving the phase (slot 1 of ``d_edges``, [2, B*H*S, W] fp32): slot c - C0 of ``d_reads``
    ([phase chunks, B*H*S, W], the operands' dtype) gets the gradient of the state leaving chunk c, then
    the chunk's reads add sum_i lam^(i+1) q_i (dO_i, dz_i) and the carry through the chunk decays it by
    lam^n (cut where a document starts inside). The gradient of the state entering the phase goes to
    slot 0 of ``d_edges``. A program owns a [BF, BD] block of the state, the
    normalisers' gradient riding with value block 0. The weighted queries lam^(i+1) q_i are made in the
    operands' dtype from weights rounded to it, as the forward's walk makes its rows (made in fp32 and
    rounded after, the sm_90 walk took 319 instructions a chunk, against 277). NORMS_BY_PRODUCT: the
    reads' share of the normalisers' gradient is a product of the rows lam^(i+1) dz_i q_i, made the same
    way, with ones on the tensor cores, as the forward's walk adds the normalisers (with dz broadcast to
    all 16 columns of the right operand through shared memory instead: 277 instructions, against 265);
    else an fp32 sum across the threads. A fast term's piece (FAST, PARTS: _state_block) walks back from zero
    WARM chunks after its last, as the forward's walk does ahead of its first."""
    row, b, h, part, parts, offs_f, offs_d, g_offs, g_mask, b_mask, ll = _state_block(
        log_lam, BH, H, S, F, DV, BF, BD, FAST, PARTS
    )
    rows = BH * S
    end = C0 + tl.minimum(N, tl.cdiv(seq_len, BT) - C0)
    lo, hi = _chunk_range(part, parts, C0, end, FAST)
    warm = end
    if FAST != 0:  # a fast piece's walk starts WARM chunks late, from zero
        warm = tl.minimum(end, hi + WARM)
    last = (rows + row).to(tl.int64) * W
    dg = tl.load(d_edges + last + g_offs, mask=_owned(g_mask, warm == end, FAST), other=0.0)
    b_offs, b_store, db = _normaliser_slot(d_edges + last, F, DV, offs_f, b_mask, NORMS_BY_PRODUCT)
    if FAST != 0:
        db = tl.where(warm == end, db, 0.0)
    pos = tl.arange(0, BT).to(tl.float32) + 1.0
    if NORMS_BY_PRODUCT:  # a product with ones adds a chunk's rows
        ones = tl.full([BT, 16], 1.0, dtype=q.dtype.element_ty)
    for i in range(0, warm - lo):
        c = warm - 1 - i
        here = ((c - C0) * rows + row).to(tl.int64) * W
        tl.store(d_reads + here + g_offs, dg.to(d_reads.dtype.element_ty), mask=_owned(g_mask, c < hi, FAST))
        tl.store(d_reads + here + b_offs, db.to(d_reads.dtype.element_ty), mask=_owned(b_store, c < hi, FAST))
        start = c * BT
        base = token_base(b, h, start, seq_len, H)
        mask_t, n, reads, _writes, carry, _linked = chunk_masks(docs, b, start, seq_len, BT, RESETS)
        qc = load_tile(q, base, H, F, offs_f, mask_t, BT)
        dc = load_tile(d_out, base, H, DV, offs_d, mask_t, BT)
        dz = tl.load(d_z + base + tl.arange(0, BT) * H, mask=mask_t, other=0.0).to(tl.float32)
        alpha = tl.where(reads, tl.exp(pos * ll), 0.0)
        decay = carry * tl.exp(n.to(tl.float32) * ll)
        if NORMS_BY_PRODUCT:
            qz = qc * (alpha * dz).to(qc.dtype)[:, None]
            db = tl.dot(tl.trans(qz), ones, acc=db * decay, input_precision=PRECISION)
        else:
            db = db * decay + tl.sum(qc.to(tl.float32) * (alpha * dz)[:, None], axis=0)
        dg = tl.dot(tl.trans(qc * alpha.to(qc.dtype)[:, None]), dc, acc=dg * decay, input_precision=PRECISION)
    first = row.to(tl.int64) * W
    tl.store(d_edges + first + g_offs, dg, mask=_owned(g_mask, lo == C0, FAST))
    tl.store(d_edges + first + b_offs, db, mask=_owned(b_store, lo == C0, FAST))


@triton.jit
def _chunk_pairs(q, k, v, coef, log_lam, docs, d_out, d_z, b, h, start, seq_len, H, S, F, DV,
                 BT: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr, GN: tl.constexpr,
                 PRECISION: tl.constexpr, RESETS: tl.constexpr):  # fmt: skip
    """The chunk's tiles and its pairs' common factors: (base, mask_t, n, reads, writes, linked, qc, kc,
    vc, dc, dz, Wc, dP) with dP = dO V^T + dz (the gradient of every pair's score weight)."""
    offs_f = tl.arange(0, BF)
    offs_d = tl.arange(0, BD)
    base = token_base(b, h, start, seq_len, H)
    mask_t, n, reads, writes, _carry, linked = chunk_masks(docs, b, start, seq_len, BT, RESETS)
    qc = load_tile(q, base, H, F, offs_f, mask_t, BT)
    kc = load_tile(k, base, H, F, offs_f, mask_t, BT)
    vc = load_tile(v, base, H, DV, offs_d, mask_t, BT)
    dc = load_tile(d_out, base, H, DV, offs_d, mask_t, BT)
    dz = tl.load(d_z + base + tl.arange(0, BT) * H, mask=mask_t, other=0.0).to(tl.float32)
    _ll, cs = term_loads(log_lam, coef, base, h, H, S, 0, mask_t, GN, BT)
    wc = kernel_matrix(decay_table(log_lam, h, S, GN, BT), cs, linked, PRECISION, BT)
    d_p = tl.dot(dc, tl.trans(vc), input_precision=PRECISION) + dz[:, None]
    return base, mask_t, n, reads, writes, linked, qc, kc, vc, dc, dz, wc, d_p


@triton.jit
def chunk_query_grads_kernel(
    q, k, v, coef, log_lam, docs, reads, d_out, d_z, dq,
    seq_len, BH, S, C0, H: tl.constexpr, F: tl.constexpr, DV: tl.constexpr, W: tl.constexpr,
    BT: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr, GN: tl.constexpr, PRECISION: tl.constexpr,
    RESETS: tl.constexpr,
):  # fmt: skip
    """dq of one chunk c (C0 + program / BH, slot c - C0 of ``reads``) of one batch x head: (dP * Wc) K over the
    chunk's pairs, plus sum_s lam_s^(i+1) (dO_i G_s^T + dz_i b_s) for the tokens that read the state entering
    the chunk (slot c of ``reads``)."""
    pid = tl.program_id(0)
    c, bh = C0 + pid // BH, pid % BH
    b, h = bh // H, bh % H
    base, mask_t, _n, reads_in, _w, _l, _q, kc, _v, dc, dz, wc, d_p = _chunk_pairs(
        q, k, v, coef, log_lam, docs, d_out, d_z, b, h, c * BT, seq_len, H, S, F, DV, BT, BF, BD, GN, PRECISION,
        RESETS,
    )
    dq_c = tl.dot((d_p * wc).to(kc.dtype), kc, input_precision=PRECISION)
    offs_f = tl.arange(0, BF)
    offs_d = tl.arange(0, BD)
    g_offs = offs_f[None, :] * DV + offs_d[:, None]  # G_s^T: [BD, BF]
    g_mask = (offs_f < F)[None, :] & (offs_d < DV)[:, None]
    pos = tl.arange(0, BT).to(tl.float32) + 1.0
    for s in range(0, S):
        alpha = tl.where(reads_in, tl.exp(pos * tl.load(log_lam + h * S + s)), 0.0)
        here = (((c - C0) * BH + bh) * S + s).to(tl.int64) * W
        g_t = tl.load(reads + here + g_offs, mask=g_mask, other=0.0)
        dq_c += tl.dot(dc, g_t.to(dc.dtype), input_precision=PRECISION) * alpha[:, None]
    # the normalisers' share, dz_i sum_s lam_s^(i+1) b_s: one [BT, GN] @ [GN, BF] product, its left
    # operand formed in the operands' dtype (as a write's per-term operand is)
    n_offs, n_mask = norm_tile(reads, c - C0, bh, BH, S, F, DV, W, GN, BF)
    norms = tl.load(reads + n_offs, mask=n_mask, other=0.0).to(dc.dtype)
    alphas = read_decays(group_decays(log_lam, h, S, 0, GN), reads_in, BT) * dz[:, None]
    dq_c = tl.dot(alphas.to(dc.dtype), norms, acc=dq_c, input_precision=PRECISION)
    store_tile(dq, base, H, F, offs_f, mask_t, dq_c, BT)


@triton.jit
def chunk_key_value_grads_kernel(
    q, k, v, coef, log_lam, docs, d_reads, d_out, d_z, dk, dv, dcoef,
    seq_len, BH, S, C0, H: tl.constexpr, F: tl.constexpr, DV: tl.constexpr, W: tl.constexpr,
    BT: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr, GN: tl.constexpr, PRECISION: tl.constexpr,
    KEYS: tl.constexpr, VALUES: tl.constexpr, COEFS: tl.constexpr, RESETS: tl.constexpr,
):  # fmt: skip
    """dk (KEYS), dv (VALUES) or dcoef (COEFS) of one chunk c (C0 + program / BH, slot c - C0 of
    ``d_reads``) of one batch x head, a launch each (together the sm_80 compile spilled, and on sm_90
    they took 232 registers, one program an SM: kernels/soe/gpu/launches.py, Tiles). Pairs inside
    the chunk: dv = (QK^T * Wc)^T dO, dk = (dP * Wc)^T Q, dcoef[j, s] = sum_d lam_s^d (QK^T * dP)[j + d, j].
    Writes into the state leaving the chunk (slot c of ``d_reads`` holds its gradient dH_s, db_s), w_s(j) =
    lam_s^(n-1-j) coef[j, s]: dk_j += w_s(j) (dH_s v_j + db_s), dv_j += w_s(j) k_j dH_s, dcoef[j, s] +=
    lam_s^(n-1-j) (v_j . (k_j dH_s) + k_j . db_s)."""
    pid = tl.program_id(0)
    c, bh = C0 + pid // BH, pid % BH
    b, h = bh // H, bh % H
    base, mask_t, n, _r, writes, linked, qc, kc, vc, dc, _dz, wc, d_p = _chunk_pairs(
        q, k, v, coef, log_lam, docs, d_out, d_z, b, h, c * BT, seq_len, H, S, F, DV, BT, BF, BD, GN, PRECISION,
        RESETS,
    )
    scores = tl.dot(qc, tl.trans(kc), input_precision=PRECISION)
    terms = tl.arange(0, GN)
    offs_f = tl.arange(0, BF)
    offs_d = tl.arange(0, BD)
    dk_c = tl.zeros([BT, BF], dtype=tl.float32)
    dcoef_c = tl.zeros([BT, GN], dtype=tl.float32)
    dv_c = tl.zeros([BT, BD], dtype=tl.float32)
    if KEYS:
        dk_c = tl.dot(tl.trans((d_p * wc).to(qc.dtype)), qc, input_precision=PRECISION)
    if VALUES:
        dv_c = tl.dot(tl.trans((scores * wc).to(dc.dtype)), dc, input_precision=PRECISION)
    if COEFS:
        spread = tl.trans(by_distance(tl.where(linked, scores * d_p, 0.0), BT))  # [j, d]
        dcoef_c = tl.dot(spread, decay_table(log_lam, h, S, GN, BT), input_precision=PRECISION)
    g_offs = offs_f[:, None] * DV + offs_d[None, :]  # dH_s: [BF, BD]
    g_mask = (offs_f < F)[:, None] & (offs_d < DV)[None, :]
    steps = tl.maximum(n.to(tl.float32) - 1.0 - tl.arange(0, BT).to(tl.float32), 0.0)
    for s in range(0, S):
        lam_w = tl.where(writes, tl.exp(steps * tl.load(log_lam + h * S + s)), 0.0)
        here = (((c - C0) * BH + bh) * S + s).to(tl.int64) * W
        dh = tl.load(d_reads + here + g_offs, mask=g_mask, other=0.0).to(kc.dtype)
        if KEYS or VALUES:
            cs = tl.load(coef + (base + tl.arange(0, BT) * H) * S + s, mask=mask_t, other=0.0).to(tl.float32)
        if KEYS:
            db = tl.load(d_reads + here + F * DV + offs_f, mask=offs_f < F, other=0.0).to(tl.float32)
            t = tl.dot(vc, tl.trans(dh), input_precision=PRECISION) + db[None, :]  # [BT, BF]
            dk_c += t * (lam_w * cs)[:, None]
        if VALUES or COEFS:
            u = tl.dot(kc, dh, input_precision=PRECISION)  # [BT, BD]
            if VALUES:
                dv_c += u * (lam_w * cs)[:, None]
            if COEFS:  # v_j . (k_j dH_s), placed in column s by a one-hot factor (an FMA, not a select)
                kv = tl.sum(vc.to(tl.float32) * u, axis=1)
                dcoef_c += (lam_w * kv)[:, None] * (terms == s).to(tl.float32)[None, :]
    if COEFS:  # lam_s^(n-1-j) k_j . db_s for all terms: one [BT, F] @ [F, GN] product with their db_s
        n_offs, n_mask = norm_tile(d_reads, c - C0, bh, BH, S, F, DV, W, GN, BF)
        norms = tl.load(d_reads + n_offs, mask=n_mask, other=0.0).to(kc.dtype)
        lam_ws = write_decays(group_decays(log_lam, h, S, 0, GN), writes, n, BT)  # [BT, GN]
        dcoef_c += lam_ws * tl.dot(kc, tl.trans(norms), input_precision=PRECISION)
    if KEYS:
        store_tile(dk, base, H, F, offs_f, mask_t, dk_c, BT)
    if VALUES:
        store_tile(dv, base, H, DV, offs_d, mask_t, dv_c, BT)
    if COEFS:
        store_tile(dcoef, base, H, S, terms, mask_t, dcoef_c, BT)
