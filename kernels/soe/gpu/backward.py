"""The SOE scan's backward walks. Each input gradient comes out of one program whole, stored once in its
dtype, because each kernel tiles the state along the dimension its gradient keeps and sums over the
other inside the program (as flash-linear-attention tiles dq by key block):

- ``value_grads_kernel``: value blocks of the state gradient, walked in reverse from the gradient of the
  state leaving the span: dv (its sum runs over the features);
- ``key_grads_kernel``: feature blocks of the state gradient, walked in reverse: dk (sum over values)
  and the block's share of the coefficient gradient's cross-chunk part;
- ``query_grads_kernel``: feature blocks of the forward state, walked forward from the state entering
  the span: dq (sum over values) and, when the decays need a gradient, its reader sums;
- ``coef_grads_kernel``: chunk parallel, the coefficient gradient of the pairs inside a chunk plus the
  feature blocks' shares, summed in a fixed order and stored once; the decay gradient's writer and
  intra-chunk sums.

The coefficient gradient sums over features and values both, so no state tiling keeps it in one
program: the key walks store fp32 shares [NF, B*T*H, S] that the coefficient kernel adds. The decay
gradient (a parameter's) keeps per-span and per-chunk partials, summed by torch. The two term groups'
steps are written out in each walk rather than through a shared helper: the walks sit at the
255-register limit, and the same steps through a helper returning tuples spilled 456 bytes on sm_90
(the compile gate).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.soe.gpu.walk import (
    by_distance,
    chunk_decay,
    chunk_masks,
    decay_table,
    kernel_matrix,
    load_tile,
    norm_rows,
    over_terms,
    per_term,
    read_decays,
    read_state,
    scaled_rows,
    span_chunk_count,
    span_program,
    state_tile,
    store_tile,
    term_loads,
    token_base,
    write_decays,
    write_state,
)


@triton.jit
def _store_terms(ptr, part, rows_total, base, H, S, g0, x, mask_t, GS: tl.constexpr, BT: tl.constexpr):
    """Store x [BT, GS] at terms g0.. of the chunk's rows of partial ``part`` of a [parts, B*T*H, S] buffer."""
    s = g0 + tl.arange(0, GS)
    store_tile(ptr + part.to(tl.int64) * rows_total * S, base, H, S, s, mask_t, x, BT)


@triton.jit
def _store_span_terms(ptr, part, p, bh, BH, S, g0, x, mask, NB, GS: tl.constexpr):
    """Store x [GS] at terms g0.. of (part, span p, bh) of a [parts, n_spans * BH, S] buffer (the grid has
    NB programs per span and batch x head)."""
    s = g0 + tl.arange(0, GS)
    row = (part * (tl.num_programs(0) // NB) + p * BH + bh).to(tl.int64) * S
    tl.store(ptr + row + s, x, mask=mask & (s < S))


@triton.jit
def value_grads_kernel(
    q, k, v, coef, log_lam, docs, d_states, d_out, dv,
    seq_len, BH, H, S, F, DV, W, SPAN,
    BT: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr, GA: tl.constexpr, GB: tl.constexpr,
    HAS_B: tl.constexpr, GN: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dv of one span and value block, chunks in reverse from the gradient of the state leaving the span
    (slot span + 1): with dG the gradient of the state leaving a chunk, dv_j = sum_i (q_i . k_j) Wc[i, j]
    do_i + sum_s w_js dG_s^T k_j; then dG steps to the chunk's start over its reads (q, dO). The order
    inside a chunk is the output kernel's."""
    p, bh, b, h, vb = span_program(BH, H, tl.cdiv(DV, BD))
    n_here = span_chunk_count(p, seq_len, SPAN, BT)
    offs_f = tl.arange(0, BF)
    offs_d = vb * BD + tl.arange(0, BD)
    offs, mask = state_tile(d_states, p + 1, bh, BH, S, F, DV, W, 0, vb, GA, BD, BF, True)
    xa = tl.load(d_states + offs, mask=mask, other=0.0)
    xb = tl.zeros([GB * BD, BF], dtype=tl.float32)
    if HAS_B:
        offs, mask = state_tile(d_states, p + 1, bh, BH, S, F, DV, W, GA, vb, GB, BD, BF, True)
        xb = tl.load(d_states + offs, mask=mask, other=0.0)
    table = decay_table(log_lam, h, S, GN, BT)
    for i in range(0, n_here):
        start = (p * SPAN + n_here - 1 - i) * BT
        base = token_base(b, h, start, seq_len, H)
        mask_t, n, reads, writes, carry, linked = chunk_masks(docs, b, start, seq_len, BT)
        qc = load_tile(q, base, H, F, offs_f, mask_t, BT)
        kc = load_tile(k, base, H, F, offs_f, mask_t, BT)
        doc = load_tile(d_out, base, H, DV, offs_d, mask_t, BT)
        _ll, cs = term_loads(log_lam, coef, base, h, H, S, 0, mask_t, GN, BT)
        pm = tl.dot(qc, tl.trans(kc), input_precision=PRECISION) * kernel_matrix(table, cs, linked, PRECISION, BT)
        dvc = tl.dot(tl.trans(pm).to(doc.dtype), doc, input_precision=PRECISION)
        ll, cs = term_loads(log_lam, coef, base, h, H, S, 0, mask_t, GA, BT)
        dvc += over_terms(read_state(xa, kc, PRECISION), write_decays(ll, writes, n, BT) * cs, BT, GA, BD)
        xa = write_state(xa, qc, read_decays(ll, reads, BT), doc, chunk_decay(ll, n, carry, GA, BD),
                         BT, GA, BD, PRECISION)  # fmt: skip
        if HAS_B:
            ll, cs = term_loads(log_lam, coef, base, h, H, S, GA, mask_t, GB, BT)
            dvc += over_terms(read_state(xb, kc, PRECISION), write_decays(ll, writes, n, BT) * cs, BT, GB, BD)
            xb = write_state(xb, qc, read_decays(ll, reads, BT), doc, chunk_decay(ll, n, carry, GB, BD),
                             BT, GB, BD, PRECISION)  # fmt: skip
        store_tile(dv, base, H, DV, offs_d, mask_t, dvc, BT)


@triton.jit
def key_grads_kernel(
    q, k, v, coef, log_lam, docs, d_states, d_out, d_z, dk, dcoef,
    seq_len, BH, H, S, F, DV, W, SPAN, SPAN0, PHASE_T,
    BT: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr, GA: tl.constexpr, GB: tl.constexpr,
    HAS_B: tl.constexpr, GN: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dk of one span (span SPAN0 + the program's) and feature block ``blk`` (BC features), chunks in
    reverse from the gradient of the state leaving the span, held as [terms x features, values]: with
    e_js = dG_s v_j + db_s, dk_j = sum_i (dO_i . v_j + dz_i) Wc[i, j] q_i + sum_s w_js e_js, and this
    block's share of dcoef_js = lam^(n-1-j) k_j . e_js (share ``blk`` of an [NF, B*PHASE_T*H, S] buffer
    holding the PHASE_T tokens from span SPAN0 on); then the state gradient steps back over the chunk's
    reads."""
    p, bh, b, h, fb = span_program(BH, H, tl.cdiv(F, BC))
    p += SPAN0
    n_here = span_chunk_count(p, seq_len, SPAN, BT)
    rows_total = PHASE_T * BH
    phase_start = SPAN0 * SPAN * BT
    offs_f = fb * BC + tl.arange(0, BC)
    offs_v = tl.arange(0, BV)
    offs, mask = state_tile(d_states, p + 1, bh, BH, S, F, DV, W, 0, fb, GA, BC, BV, False)
    xa = tl.load(d_states + offs, mask=mask, other=0.0)
    offs, mask = norm_rows(d_states, p + 1, bh, BH, S, F, DV, W, 0, fb, GA, BC)
    na = tl.load(d_states + offs, mask=mask, other=0.0)
    xb = tl.zeros([GB * BC, BV], dtype=tl.float32)
    nb = tl.zeros([GB * BC], dtype=tl.float32)
    if HAS_B:
        offs, mask = state_tile(d_states, p + 1, bh, BH, S, F, DV, W, GA, fb, GB, BC, BV, False)
        xb = tl.load(d_states + offs, mask=mask, other=0.0)
        offs, mask = norm_rows(d_states, p + 1, bh, BH, S, F, DV, W, GA, fb, GB, BC)
        nb = tl.load(d_states + offs, mask=mask, other=0.0)
    table = decay_table(log_lam, h, S, GN, BT)
    for i in range(0, n_here):
        start = (p * SPAN + n_here - 1 - i) * BT
        base = token_base(b, h, start, seq_len, H)
        share = token_base(b, h, start - phase_start, PHASE_T, H)
        mask_t, n, reads, writes, carry, linked = chunk_masks(docs, b, start, seq_len, BT)
        qc = load_tile(q, base, H, F, offs_f, mask_t, BT)
        kc = load_tile(k, base, H, F, offs_f, mask_t, BT)
        vc = load_tile(v, base, H, DV, offs_v, mask_t, BT)
        doc = load_tile(d_out, base, H, DV, offs_v, mask_t, BT)
        dzc = tl.load(d_z + base + tl.arange(0, BT) * H, mask=mask_t, other=0.0).to(tl.float32)
        dkc = tl.zeros([BT, BC], dtype=tl.float32)
        _ll, cs = term_loads(log_lam, coef, base, h, H, S, 0, mask_t, GN, BT)
        d_p = tl.dot(doc, tl.trans(vc), input_precision=PRECISION) + dzc[:, None]
        d_a = d_p * kernel_matrix(table, cs, linked, PRECISION, BT)
        dkc += tl.dot(tl.trans(d_a).to(qc.dtype), qc, input_precision=PRECISION)
        if HAS_B:
            ll, cs = term_loads(log_lam, coef, base, h, H, S, GA, mask_t, GB, BT)
            k_dec = write_decays(ll, writes, n, BT)
            back = read_state(xb, vc, PRECISION) + nb[:, None]
            dkc += over_terms(back, k_dec * cs, BT, GB, BC)
            d_coef = k_dec * per_term(back, kc, BT, GB, BC)
            _store_terms(dcoef, fb, rows_total, share, H, S, GA, d_coef, mask_t, GB, BT)
            q_dec = read_decays(ll, reads, BT)
            decay = chunk_decay(ll, n, carry, GB, BC)
            scaled = scaled_rows(q_dec.to(qc.dtype), qc, BT, GB, BC)
            xb = tl.dot(scaled, doc, acc=xb * decay[:, None], input_precision=PRECISION)
            nb = nb * decay + tl.sum(scaled.to(tl.float32) * dzc[None, :], axis=1)
        ll, cs = term_loads(log_lam, coef, base, h, H, S, 0, mask_t, GA, BT)
        k_dec = write_decays(ll, writes, n, BT)
        back = read_state(xa, vc, PRECISION) + na[:, None]
        dkc += over_terms(back, k_dec * cs, BT, GA, BC)
        d_coef = k_dec * per_term(back, kc, BT, GA, BC)
        _store_terms(dcoef, fb, rows_total, share, H, S, 0, d_coef, mask_t, GA, BT)
        q_dec = read_decays(ll, reads, BT)
        decay = chunk_decay(ll, n, carry, GA, BC)
        scaled = scaled_rows(q_dec.to(qc.dtype), qc, BT, GA, BC)
        xa = tl.dot(scaled, doc, acc=xa * decay[:, None], input_precision=PRECISION)
        na = na * decay + tl.sum(scaled.to(tl.float32) * dzc[None, :], axis=1)
        store_tile(dk, base, H, F, offs_f, mask_t, dkc, BT)


@triton.jit
def query_grads_kernel(
    q, k, v, coef, log_lam, docs, states, d_out, d_z, dq, dll,
    seq_len, BH, H, S, F, DV, W, SPAN, centre,
    BT: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr, GA: tl.constexpr, GB: tl.constexpr,
    HAS_B: tl.constexpr, GN: tl.constexpr, NEED_DLL: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dq of one span and feature block ``blk``, chunks in order from the state entering the span (slot
    span of the forward's span states), held as [terms x features, values]: dq_i = sum_j (dO_i . v_j +
    dz_i) Wc[i, j] k_j + sum_s lam_s^(i+1) (G_s do_i + dz_i b_s); with NEED_DLL also this block's reader
    sums (t - centre) lam^(i+1) q_i . (G_s do_i + dz_i b_s) of the decay gradient (row (block, span,
    batch x head) of an [NF, n_spans * B*H, S] buffer; VORT's decays are buffers and skip them). Then the
    state steps over the chunk's writes."""
    p, bh, b, h, fb = span_program(BH, H, tl.cdiv(F, BC))
    n_here = span_chunk_count(p, seq_len, SPAN, BT)
    offs_f = fb * BC + tl.arange(0, BC)
    offs_v = tl.arange(0, BV)
    offs, mask = state_tile(states, p, bh, BH, S, F, DV, W, 0, fb, GA, BC, BV, False)
    xa = tl.load(states + offs, mask=mask, other=0.0)
    offs, mask = norm_rows(states, p, bh, BH, S, F, DV, W, 0, fb, GA, BC)
    na = tl.load(states + offs, mask=mask, other=0.0)
    xb = tl.zeros([GB * BC, BV], dtype=tl.float32)
    nb = tl.zeros([GB * BC], dtype=tl.float32)
    if HAS_B:
        offs, mask = state_tile(states, p, bh, BH, S, F, DV, W, GA, fb, GB, BC, BV, False)
        xb = tl.load(states + offs, mask=mask, other=0.0)
        offs, mask = norm_rows(states, p, bh, BH, S, F, DV, W, GA, fb, GB, BC)
        nb = tl.load(states + offs, mask=mask, other=0.0)
    table = decay_table(log_lam, h, S, GN, BT)
    dll_a = tl.zeros([GA * BC], dtype=tl.float32)  # per state row, summed over the block's features at the end
    dll_b = tl.zeros([GB * BC], dtype=tl.float32)
    for i in range(0, n_here):
        start = (p * SPAN + i) * BT
        base = token_base(b, h, start, seq_len, H)
        mask_t, n, reads, writes, carry, linked = chunk_masks(docs, b, start, seq_len, BT)
        centred = (start + tl.arange(0, BT)).to(tl.float32) - centre
        qc = load_tile(q, base, H, F, offs_f, mask_t, BT)
        kc = load_tile(k, base, H, F, offs_f, mask_t, BT)
        vc = load_tile(v, base, H, DV, offs_v, mask_t, BT)
        doc = load_tile(d_out, base, H, DV, offs_v, mask_t, BT)
        dzc = tl.load(d_z + base + tl.arange(0, BT) * H, mask=mask_t, other=0.0).to(tl.float32)
        dqc = tl.zeros([BT, BC], dtype=tl.float32)
        _ll, cs = term_loads(log_lam, coef, base, h, H, S, 0, mask_t, GN, BT)
        d_p = tl.dot(doc, tl.trans(vc), input_precision=PRECISION) + dzc[:, None]
        d_a = d_p * kernel_matrix(table, cs, linked, PRECISION, BT)
        dqc += tl.dot(d_a.to(kc.dtype), kc, input_precision=PRECISION)
        if HAS_B:
            ll, cs = term_loads(log_lam, coef, base, h, H, S, GA, mask_t, GB, BT)
            q_dec = read_decays(ll, reads, BT)
            fwd = read_state(xb, doc, PRECISION) + nb[:, None] * dzc[None, :]
            dqc += over_terms(fwd, q_dec, BT, GB, BC)
            if NEED_DLL:
                dll_b += tl.sum(fwd * scaled_rows(q_dec * centred[:, None], qc.to(tl.float32), BT, GB, BC), axis=1)
            w = write_decays(ll, writes, n, BT) * cs
            decay = chunk_decay(ll, n, carry, GB, BC)
            scaled = scaled_rows(w.to(kc.dtype), kc, BT, GB, BC)
            xb = tl.dot(scaled, vc, acc=xb * decay[:, None], input_precision=PRECISION)
            nb = nb * decay + tl.sum(scaled.to(tl.float32), axis=1)
        ll, cs = term_loads(log_lam, coef, base, h, H, S, 0, mask_t, GA, BT)
        q_dec = read_decays(ll, reads, BT)
        fwd = read_state(xa, doc, PRECISION) + na[:, None] * dzc[None, :]
        dqc += over_terms(fwd, q_dec, BT, GA, BC)
        if NEED_DLL:
            dll_a += tl.sum(fwd * scaled_rows(q_dec * centred[:, None], qc.to(tl.float32), BT, GA, BC), axis=1)
        w = write_decays(ll, writes, n, BT) * cs
        decay = chunk_decay(ll, n, carry, GA, BC)
        scaled = scaled_rows(w.to(kc.dtype), kc, BT, GA, BC)
        xa = tl.dot(scaled, vc, acc=xa * decay[:, None], input_precision=PRECISION)
        na = na * decay + tl.sum(scaled.to(tl.float32), axis=1)
        store_tile(dq, base, H, F, offs_f, mask_t, dqc, BT)
    if NEED_DLL:
        dll_a = tl.sum(tl.reshape(dll_a, (GA, BC)), axis=1)
        _store_span_terms(dll, fb, p, bh, BH, S, 0, dll_a, tl.arange(0, GA) >= 0, tl.cdiv(F, BC), GA)
    if NEED_DLL and HAS_B:
        dll_b = tl.sum(tl.reshape(dll_b, (GB, BC)), axis=1)
        _store_span_terms(dll, fb, p, bh, BH, S, GA, dll_b, tl.arange(0, GB) >= 0, tl.cdiv(F, BC), GB)


@triton.jit
def coef_grads_kernel(
    q, k, v, coef, log_lam, docs, d_out, d_z, shares, dcoef, dll,
    seq_len, BH, H, S, F, DV, PARTS, C0, PHASE_T, centre,
    BT: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, GN: tl.constexpr, NEED_DLL: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """dcoef of one chunk (chunk C0 + grid axis 0's chunk x batch x head), stored once in its dtype: the
    PARTS feature-block shares of the key walks (the writes to the states leaving the chunk; the shares
    buffer holds the PHASE_T tokens from chunk C0 on), added in a fixed order, plus the pairs inside the
    chunk, sum_i (dO_i . v_j + dz_i)(q_i . k_j) lam_s^(i-j). With NEED_DLL also the chunk's
    decay-gradient row ([n_chunks * B*H, S]): the writer sums -(t - centre) coef dcoef of the shares and
    the intra-chunk sums of (i - j) times the pairs' terms."""
    pid = tl.program_id(0)
    c = pid // BH + C0
    bh = pid % BH
    b = bh // H
    h = bh % H
    start = c * BT
    base = token_base(b, h, start, seq_len, H)
    mask_t, _n, _reads, _writes, _carry, linked = chunk_masks(docs, b, start, seq_len, BT)
    terms = tl.arange(0, GN)
    share = token_base(b, h, start - C0 * BT, PHASE_T, H)
    rows_total = PHASE_T * BH
    cross = tl.zeros([BT, GN], dtype=tl.float32)
    for part in range(0, PARTS):
        cross += load_tile(shares + part * rows_total.to(tl.int64) * S, share, H, S, terms, mask_t, BT)
    offs_f = tl.arange(0, BF)
    offs_v = tl.arange(0, BV)
    qc = load_tile(q, base, H, F, offs_f, mask_t, BT)
    kc = load_tile(k, base, H, F, offs_f, mask_t, BT)
    vc = load_tile(v, base, H, DV, offs_v, mask_t, BT)
    doc = load_tile(d_out, base, H, DV, offs_v, mask_t, BT)
    dzc = tl.load(d_z + base + tl.arange(0, BT) * H, mask=mask_t, other=0.0).to(tl.float32)
    d_p = tl.dot(doc, tl.trans(vc), input_precision=PRECISION) + dzc[:, None]
    pairs = tl.where(linked, d_p * tl.dot(qc, tl.trans(kc), input_precision=PRECISION), 0.0)
    spread = tl.trans(by_distance(pairs, BT))  # [j, d]: pairs[j + d, j]
    table = decay_table(log_lam, h, S, GN, BT)
    store_tile(dcoef, base, H, S, terms, mask_t, cross + tl.dot(spread, table, input_precision=PRECISION), BT)
    if NEED_DLL:
        dist = tl.arange(0, BT).to(tl.float32)
        d_decay = tl.dot(spread, table * dist[:, None], input_precision=PRECISION)
        _ll, cs = term_loads(log_lam, coef, base, h, H, S, 0, mask_t, GN, BT)
        centred = (start + tl.arange(0, BT)).to(tl.float32) - centre
        d_ll = tl.sum((d_decay - cross * centred[:, None]) * cs, axis=0)
        tl.store(dll + (c * BH + bh).to(tl.int64) * S + terms, d_ll, mask=terms < S)
