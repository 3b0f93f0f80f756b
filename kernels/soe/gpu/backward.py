"""The SOE scan's backward walks. Each input gradient comes out of one program whole, stored once in its
dtype, because each kernel tiles the state along the dimension its gradient keeps and sums over the
other inside the program (as flash-linear-attention tiles dq by key block):

- ``state_grads_kernel``: each span's own share of the gradient of the state entering it (value blocks
  walked in reverse; a pass over the spans then makes the gradients entering every span);
- ``value_grads_kernel``: value blocks of the state gradient, walked in reverse from the gradient of the
  state leaving the span: dv (its sum runs over the features) and the block's share of the coefficient
  gradient's cross-chunk part;
- ``key_grads_kernel``: feature blocks of the state gradient, walked in reverse: dk (sum over values);
  one more program per span walks the normalisers' gradient for their share of the coefficient
  gradient and, when the decays need no gradient, the pairs inside each chunk;
- ``query_grads_kernel``: feature blocks of the forward state, walked forward from the state entering
  the span: dq (sum over values) and, when the decays need a gradient, its reader sums;
- ``coef_grads_kernel``: chunk parallel, the shares summed in a fixed order and stored once; when the
  decays need a gradient also the pairs inside the chunk and the decay gradient's writer and
  intra-chunk sums.

The coefficient gradient sums over features and values both, so no state tiling keeps it in one
program: the value walks store fp32 shares [value blocks + 1, B*T*H, S] that the coefficient kernel
adds (value blocks: 4 on an H100 against 8 feature blocks, so half the shares the key walks would
make). The decay gradient (a parameter's) keeps per-span and per-chunk partials, summed by torch. The
two term groups' steps are written out in each walk rather than through a shared helper: the walks sit
at the 255-register limit, and the same steps through a helper returning tuples spilled 456 bytes on
sm_90 (the compile gate).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.soe.gpu.walk import (
    by_distance,
    chunk_decay,
    chunk_masks,
    decay_table,
    group_decays,
    in_first_block,
    kernel_matrix,
    load_tile,
    norm_rows,
    norm_tile,
    over_terms,
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
    write_norms,
    write_state,
)


@triton.jit
def state_grads_kernel(
    q, d_out, d_z, log_lam, docs, states,
    seq_len, BH, H, S, F, DV, W, SPAN,
    BT: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr, GA: tl.constexpr, GB: tl.constexpr,
    HAS_B: tl.constexpr, GN: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One span's own share of the gradient of every term's state entering it, from zero, for value block
    ``vb``: sum_i lam^(i + 1 - start) q_i do_i^T over the span's reads (and q_i dz_i for the normalisers,
    with value block 0), into slot span. Chunks are walked in reverse, cut by the document masks."""
    p, bh, b, h, vb = span_program(BH, H, tl.cdiv(DV, BD))
    n_here = span_chunk_count(p, seq_len, SPAN, BT)
    offs_f = tl.arange(0, BF)
    offs_d = vb * BD + tl.arange(0, BD)
    xa = tl.zeros([GA * BD, BF], dtype=tl.float32)
    xb = tl.zeros([GB * BD, BF], dtype=tl.float32)
    xn = tl.zeros([GN, BF], dtype=tl.float32)
    for i in range(0, n_here):
        start = (p * SPAN + n_here - 1 - i) * BT
        base = token_base(b, h, start, seq_len, H)
        mask_t, n, reads, _writes, carry, _linked = chunk_masks(docs, b, start, seq_len, BT, True)
        qc = load_tile(q, base, H, F, offs_f, mask_t, BT)
        dc = load_tile(d_out, base, H, DV, offs_d, mask_t, BT)
        dz = tl.load(d_z + base + tl.arange(0, BT) * H, mask=in_first_block(mask_t, vb), other=0.0).to(tl.float32)
        ll = group_decays(log_lam, h, S, 0, GA)
        xa = write_state(xa, qc, read_decays(ll, reads, BT), dc, chunk_decay(ll, n, carry, GA, BD), BT, GA, BD,
                         PRECISION)  # fmt: skip
        if HAS_B:
            ll = group_decays(log_lam, h, S, GA, GB)
            xb = write_state(xb, qc, read_decays(ll, reads, BT), dc, chunk_decay(ll, n, carry, GB, BD), BT, GB, BD,
                             PRECISION)  # fmt: skip
        ll = group_decays(log_lam, h, S, 0, GN)
        xn = write_norms(xn, qc, read_decays(ll, reads, BT), dz, chunk_decay(ll, n, carry, GN, 1), PRECISION)
    offs, mask = state_tile(states, p, bh, BH, S, F, DV, W, 0, vb, GA, BD, BF, True)
    tl.store(states + offs, xa, mask=mask)
    if HAS_B:
        offs, mask = state_tile(states, p, bh, BH, S, F, DV, W, GA, vb, GB, BD, BF, True)
        tl.store(states + offs, xb, mask=mask)
    offs, mask = norm_tile(states, p, bh, BH, S, F, DV, W, GN, BF)
    tl.store(states + offs, xn, mask=in_first_block(mask, vb))


@triton.jit
def _store_span_terms(ptr, part, p, bh, BH, S, g0, x, mask, NB, GS: tl.constexpr):
    """Store x [GS] at terms g0.. of (part, span p, bh) of a [parts, n_spans * BH, S] buffer (the grid has
    NB programs per span and batch x head)."""
    s = g0 + tl.arange(0, GS)
    row = (part * (tl.num_programs(0) // NB) + p * BH + bh).to(tl.int64) * S
    tl.store(ptr + row + s, x, mask=mask & (s < S))


@triton.jit
def _by_term(ll, steps, on):
    """[GS, BT]: lam_s^steps_i where ``on``_i, else 0; decays laid out terms x tokens (the value walk's
    layout, see _value_grads_walk)."""
    return tl.where(on[None, :], tl.exp(steps[None, :] * ll[:, None]), 0.0)


@triton.jit
def _term_columns(ptr, base, H, S, g0, mask_t, GS: tl.constexpr, BT: tl.constexpr):
    """The offsets and mask of terms g0 .. g0 + GS - 1 of the chunk's rows of a [B*T*H, S] buffer, laid
    out terms x tokens [GS, BT]."""
    s = g0 + tl.arange(0, GS)
    rows = tl.arange(0, BT) * H
    return ptr + base * S + (rows[None, :] * S + s[:, None]), mask_t[None, :] & (s < S)[:, None]


@triton.jit
def value_grads_kernel(
    q, k, v, coef, log_lam, docs, d_states, d_out, dv, shares,
    seq_len, BH, H, S, F, DV, W, SPAN, SPAN0, PHASE_T,
    BT: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr, GA: tl.constexpr, GB: tl.constexpr,
    HAS_B: tl.constexpr, GN: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dv of one span (span SPAN0 + the program's) and value block, chunks in reverse from the gradient
    of the state leaving the span (slot span + 1): with dG the gradient of the state leaving a chunk and
    u_js = dG_s^T k_j, dv_j = sum_i (q_i . k_j) Wc[i, j] do_i + sum_s w_js u_js, and this block's share
    of the writes' part of dcoef_js = lam^(n-1-j) v_j . u_js; then dG steps to the chunk's start over its
    reads (q, dO). Share ``vb`` of an [NB + 1, B*PHASE_T*H, S] buffer (NB value blocks, then the key
    launch's normalisers' share) holds the PHASE_T tokens from span SPAN0 on. The order inside a chunk is
    the output kernel's. The per-term weights, the shares and the write's scaling are laid out terms x
    tokens, the layout of the reads' row groups: with the other walks' tokens x terms layout (and its
    transposes) this walk spilled 152 bytes on sm_90."""
    p, bh, b, h, vb = span_program(BH, H, tl.cdiv(DV, BD))
    p += SPAN0
    n_here = span_chunk_count(p, seq_len, SPAN, BT)
    shares += vb.to(tl.int64) * PHASE_T * BH * S
    phase_start = SPAN0 * SPAN * BT
    offs_f = tl.arange(0, BF)
    offs_d = vb * BD + tl.arange(0, BD)
    offs, mask = state_tile(d_states, p + 1, bh, BH, S, F, DV, W, 0, vb, GA, BD, BF, True)
    xa = tl.load(d_states + offs, mask=mask, other=0.0)
    xb = tl.zeros([GB * BD, BF], dtype=tl.float32)
    if HAS_B:
        offs, mask = state_tile(d_states, p + 1, bh, BH, S, F, DV, W, GA, vb, GB, BD, BF, True)
        xb = tl.load(d_states + offs, mask=mask, other=0.0)
    table = decay_table(log_lam, h, S, GN, BT)
    pos = tl.arange(0, BT).to(tl.float32)
    for i in range(0, n_here):
        start = (p * SPAN + n_here - 1 - i) * BT
        base = token_base(b, h, start, seq_len, H)
        share = token_base(b, h, start - phase_start, PHASE_T, H)
        mask_t, n, reads, writes, carry, linked = chunk_masks(docs, b, start, seq_len, BT, True)
        to_end = tl.maximum(n.to(tl.float32) - 1.0 - pos, 0.0)
        qc = load_tile(q, base, H, F, offs_f, mask_t, BT)
        kc = load_tile(k, base, H, F, offs_f, mask_t, BT)
        v_t = tl.trans(load_tile(v, base, H, DV, offs_d, mask_t, BT).to(tl.float32))
        doc = load_tile(d_out, base, H, DV, offs_d, mask_t, BT)
        _ll, cs = term_loads(log_lam, coef, base, h, H, S, 0, mask_t, GN, BT)
        pm = tl.dot(qc, tl.trans(kc), input_precision=PRECISION) * kernel_matrix(table, cs, linked, PRECISION, BT)
        dvc = tl.dot(tl.trans(pm).to(doc.dtype), doc, input_precision=PRECISION)
        if HAS_B:
            ll = group_decays(log_lam, h, S, GA, GB)
            k_dec = _by_term(ll, to_end, writes)
            at, live = _term_columns(coef, base, H, S, GA, mask_t, GB, BT)
            u = tl.reshape(read_state(xb, kc, PRECISION), (GB, BD, BT))
            dvc += tl.trans(tl.sum(u * (k_dec * tl.load(at, mask=live, other=0.0).to(tl.float32))[:, None, :], 0))
            at, live = _term_columns(shares, share, H, S, GA, mask_t, GB, BT)
            tl.store(at, k_dec * tl.sum(u * v_t[None, :, :], axis=1), mask=live)
            scaled = tl.reshape(_by_term(ll, pos + 1.0, reads).to(qc.dtype)[:, None, :] * tl.trans(doc)[None, :, :],
                                (GB * BD, BT))  # fmt: skip
            xb = tl.dot(scaled, qc, acc=xb * chunk_decay(ll, n, carry, GB, BD)[:, None], input_precision=PRECISION)
        ll = group_decays(log_lam, h, S, 0, GA)
        k_dec = _by_term(ll, to_end, writes)
        at, live = _term_columns(coef, base, H, S, 0, mask_t, GA, BT)
        u = tl.reshape(read_state(xa, kc, PRECISION), (GA, BD, BT))
        dvc += tl.trans(tl.sum(u * (k_dec * tl.load(at, mask=live, other=0.0).to(tl.float32))[:, None, :], 0))
        at, live = _term_columns(shares, share, H, S, 0, mask_t, GA, BT)
        tl.store(at, k_dec * tl.sum(u * v_t[None, :, :], axis=1), mask=live)
        scaled = tl.reshape(_by_term(ll, pos + 1.0, reads).to(qc.dtype)[:, None, :] * tl.trans(doc)[None, :, :],
                            (GA * BD, BT))  # fmt: skip
        xa = tl.dot(scaled, qc, acc=xa * chunk_decay(ll, n, carry, GA, BD)[:, None], input_precision=PRECISION)
        store_tile(dv, base, H, DV, offs_d, mask_t, dvc, BT)


@triton.jit
def _norm_grads_walk(
    q, k, v, log_lam, docs, d_states, d_out, d_z, shares, p, bh, b, h, part, n_here,
    seq_len, BH, H, S, F, DV, W, SPAN, SPAN0, PHASE_T,
    BT: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, GN: tl.constexpr, PAIRS: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Share ``part`` of the coefficient gradient of one span, chunks in reverse from the normalisers'
    gradient leaving the span, db [S, F]: the normalisers' part lam^(n-1-j) k_j . db_s and, with PAIRS,
    the pairs inside the chunk, sum_i (dO_i . v_j + dz_i)(q_i . k_j) lam_s^(i-j) (full rows of q, k, v and
    dO, read beside the key walks of its span); then db steps back over the chunk's reads (q, dz)."""
    shares += (PHASE_T * BH).to(tl.int64) * S * part
    phase_start = SPAN0 * SPAN * BT
    offs_f = tl.arange(0, BF)
    offs_v = tl.arange(0, BV)
    offs, mask = norm_tile(d_states, p + 1, bh, BH, S, F, DV, W, GN, BF)
    xn = tl.load(d_states + offs, mask=mask, other=0.0)
    table = decay_table(log_lam, h, S, GN, BT)
    ll = group_decays(log_lam, h, S, 0, GN)
    for i in range(0, n_here):
        start = (p * SPAN + n_here - 1 - i) * BT
        base = token_base(b, h, start, seq_len, H)
        share = token_base(b, h, start - phase_start, PHASE_T, H)
        mask_t, n, reads, writes, carry, linked = chunk_masks(docs, b, start, seq_len, BT, True)
        qc = load_tile(q, base, H, F, offs_f, mask_t, BT)
        kc = load_tile(k, base, H, F, offs_f, mask_t, BT)
        dzc = tl.load(d_z + base + tl.arange(0, BT) * H, mask=mask_t, other=0.0).to(tl.float32)
        d_coef = write_decays(ll, writes, n, BT) * tl.trans(read_state(xn, kc, PRECISION))
        if PAIRS:
            vc = load_tile(v, base, H, DV, offs_v, mask_t, BT)
            doc = load_tile(d_out, base, H, DV, offs_v, mask_t, BT)
            d_p = tl.dot(doc, tl.trans(vc), input_precision=PRECISION) + dzc[:, None]
            pairs = tl.where(linked, d_p * tl.dot(qc, tl.trans(kc), input_precision=PRECISION), 0.0)
            d_coef += tl.dot(tl.trans(by_distance(pairs, BT)), table, input_precision=PRECISION)
        store_tile(shares, share, H, S, tl.arange(0, GN), mask_t, d_coef, BT)
        xn = write_norms(xn, qc, read_decays(ll, reads, BT), dzc, chunk_decay(ll, n, carry, GN, 1), PRECISION)


@triton.jit
def key_grads_kernel(
    q, k, v, coef, log_lam, docs, d_states, d_out, d_z, dk, shares,
    seq_len, BH, H, S, F, DV, W, SPAN, SPAN0, PHASE_T, NORM_SHARE,
    BT: tl.constexpr, BF: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr, GA: tl.constexpr, GB: tl.constexpr,
    HAS_B: tl.constexpr, GN: tl.constexpr, PAIRS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The key launch's reverse walks of one span (span SPAN0 + the program's): column blocks 0 .. NF - 1
    (NF feature blocks) walk dk, block NF the normalisers' gradient for share NORM_SHARE of the coefficient
    gradient ([NORM_SHARE + 1, B*PHASE_T*H, S], after the value walks' shares) and, with PAIRS, the pairs
    inside each chunk. (In the value launch the same program made the value walks spill on sm_90.)"""
    n_blocks = tl.cdiv(F, BC)
    p, bh, b, h, blk = span_program(BH, H, n_blocks + 1)
    p += SPAN0
    n_here = span_chunk_count(p, seq_len, SPAN, BT)
    if blk == n_blocks:
        _norm_grads_walk(q, k, v, log_lam, docs, d_states, d_out, d_z, shares, p, bh, b, h, NORM_SHARE, n_here,
                         seq_len, BH, H, S, F, DV, W, SPAN, SPAN0, PHASE_T, BT, BF, BV, GN, PAIRS,
                         PRECISION)  # fmt: skip
    else:
        _key_grads_walk(q, v, coef, log_lam, docs, d_states, d_out, d_z, dk, p, bh, b, h, blk, n_here, seq_len, BH,
                        H, S, F, DV, W, SPAN, BT, BC, BV, GA, GB, HAS_B, GN, PRECISION)  # fmt: skip


@triton.jit
def _key_grads_walk(
    q, v, coef, log_lam, docs, d_states, d_out, d_z, dk, p, bh, b, h, fb, n_here,
    seq_len, BH, H, S, F, DV, W, SPAN,
    BT: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr, GA: tl.constexpr, GB: tl.constexpr,
    HAS_B: tl.constexpr, GN: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dk of one span and feature block ``blk`` (BC features), chunks in reverse from the gradient of the
    state leaving the span, held as [terms x features, values]: with e_js = dG_s v_j + db_s, dk_j =
    sum_i (dO_i . v_j + dz_i) Wc[i, j] q_i + sum_s w_js e_js; then the state gradient steps back over the
    chunk's reads."""
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
        mask_t, n, reads, writes, carry, linked = chunk_masks(docs, b, start, seq_len, BT, True)
        qc = load_tile(q, base, H, F, offs_f, mask_t, BT)
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
            q_dec = read_decays(ll, reads, BT)
            decay = chunk_decay(ll, n, carry, GB, BC)
            scaled = scaled_rows(q_dec.to(qc.dtype), qc, BT, GB, BC)
            xb = tl.dot(scaled, doc, acc=xb * decay[:, None], input_precision=PRECISION)
            nb = nb * decay + tl.sum(scaled.to(tl.float32) * dzc[None, :], axis=1)
        ll, cs = term_loads(log_lam, coef, base, h, H, S, 0, mask_t, GA, BT)
        k_dec = write_decays(ll, writes, n, BT)
        back = read_state(xa, vc, PRECISION) + na[:, None]
        dkc += over_terms(back, k_dec * cs, BT, GA, BC)
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
        mask_t, n, reads, writes, carry, linked = chunk_masks(docs, b, start, seq_len, BT, True)
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
    PARTS shares of the reverse walks (the buffer holds the PHASE_T tokens from chunk C0 on) added in a
    fixed order. They hold the pairs inside the chunk, sum_i (dO_i . v_j + dz_i)(q_i . k_j) lam_s^(i-j),
    unless NEED_DLL, when this kernel adds them itself: it needs them apart for the chunk's
    decay-gradient row ([n_chunks * B*H, S]), the writer sums -(t - centre) coef dcoef of the shares and
    the intra-chunk sums of (i - j) times the pairs' terms."""
    pid = tl.program_id(0)
    c = pid // BH + C0
    bh = pid % BH
    b = bh // H
    h = bh % H
    start = c * BT
    base = token_base(b, h, start, seq_len, H)
    mask_t, _n, _reads, _writes, _carry, linked = chunk_masks(docs, b, start, seq_len, BT, True)
    terms = tl.arange(0, GN)
    share = token_base(b, h, start - C0 * BT, PHASE_T, H)
    rows_total = PHASE_T * BH
    cross = tl.zeros([BT, GN], dtype=tl.float32)
    for part in range(0, PARTS):
        cross += load_tile(shares + part * rows_total.to(tl.int64) * S, share, H, S, terms, mask_t, BT)
    if NEED_DLL:
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
        dist = tl.arange(0, BT).to(tl.float32)
        d_decay = tl.dot(spread, table * dist[:, None], input_precision=PRECISION)
        _ll, cs = term_loads(log_lam, coef, base, h, H, S, 0, mask_t, GN, BT)
        centred = (start + tl.arange(0, BT)).to(tl.float32) - centre
        d_ll = tl.sum((d_decay - cross * centred[:, None]) * cs, axis=0)
        tl.store(dll + (c * BH + bh).to(tl.int64) * S + terms, d_ll, mask=terms < S)
    else:
        store_tile(dcoef, base, H, S, terms, mask_t, cross, BT)
