"""The SOE scan's span walks by value block: each span's own state (forward) or state gradient
(backward), and the forward's outputs.

Both keep one value block of every term's state on chip while they walk the chunks of a span
(kernels/soe/gpu/walk.py has the layout); only the state at a span's border is stored.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.soe.gpu.walk import (
    chunk_decay,
    chunk_masks,
    decay_table,
    group_decays,
    in_first_block,
    kernel_matrix,
    load_tile,
    norm_tile,
    over_terms,
    read_decays,
    read_state,
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
def _state_weights(ll, coef, base, H, S, g0, mask_t, reads, writes, n, GS: tl.constexpr, BT: tl.constexpr,
                   REVERSE: tl.constexpr):  # fmt: skip
    """[BT, GS] per-token weights of a state step: lam^(i+1) on the reads (REVERSE), lam^(n-1-j) coef on
    the writes (forward; the coefficients are loaded only then)."""
    if REVERSE:
        return read_decays(ll, reads, BT)
    s = g0 + tl.arange(0, GS)
    return write_decays(ll, writes, n, BT) * load_tile(coef, base, H, S, s, mask_t, BT).to(tl.float32)


@triton.jit
def span_states_kernel(
    x, y, y_norm, coef, log_lam, docs, states,
    seq_len, BH, H, S, F, DV, W, SPAN,
    BT: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr, GA: tl.constexpr, GB: tl.constexpr,
    HAS_B: tl.constexpr, GN: tl.constexpr, REVERSE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One span's own contribution to every term's state, from zero, for value block ``blk``.
    Forward (x = k, y = v): the state leaving the span, sum_j lam^(end - j) coef_j k_j v_j^T over its
    tokens, into slot span + 1. REVERSE (x = q, y = dO, y_norm = dz): the gradient its reads give the
    state entering it, sum_i lam^(i + 1 - start) q_i do_i^T, into slot span. Chunks are walked in the
    order the state flows, cut by the document masks; the normalisers b_s ride with value block 0."""
    p, bh, b, h, vb = span_program(BH, H, tl.cdiv(DV, BD))
    n_here = span_chunk_count(p, seq_len, SPAN, BT)
    offs_f = tl.arange(0, BF)
    offs_d = vb * BD + tl.arange(0, BD)
    xa = tl.zeros([GA * BD, BF], dtype=tl.float32)
    xb = tl.zeros([GB * BD, BF], dtype=tl.float32)
    xn = tl.zeros([GN, BF], dtype=tl.float32)
    for i in range(0, n_here):
        if REVERSE:
            start = (p * SPAN + n_here - 1 - i) * BT
        else:
            start = (p * SPAN + i) * BT
        base = token_base(b, h, start, seq_len, H)
        mask_t, n, reads, writes, carry, _linked = chunk_masks(docs, b, start, seq_len, BT)
        xc = load_tile(x, base, H, F, offs_f, mask_t, BT)
        yc = load_tile(y, base, H, DV, offs_d, mask_t, BT)
        if REVERSE:
            yn = tl.load(y_norm + base + tl.arange(0, BT) * H, mask=in_first_block(mask_t, vb), other=0.0)
            yn = yn.to(tl.float32)
        else:
            yn = tl.where(in_first_block(mask_t, vb), 1.0, 0.0)
        ll = group_decays(log_lam, h, S, 0, GA)
        beta = _state_weights(ll, coef, base, H, S, 0, mask_t, reads, writes, n, GA, BT, REVERSE)
        xa = write_state(xa, xc, beta, yc, chunk_decay(ll, n, carry, GA, BD), BT, GA, BD, PRECISION)
        if HAS_B:
            ll = group_decays(log_lam, h, S, GA, GB)
            beta = _state_weights(ll, coef, base, H, S, GA, mask_t, reads, writes, n, GB, BT, REVERSE)
            xb = write_state(xb, xc, beta, yc, chunk_decay(ll, n, carry, GB, BD), BT, GB, BD, PRECISION)
        ll = group_decays(log_lam, h, S, 0, GN)
        beta = _state_weights(ll, coef, base, H, S, 0, mask_t, reads, writes, n, GN, BT, REVERSE)
        xn = write_norms(xn, xc, beta, yn, chunk_decay(ll, n, carry, GN, 1), PRECISION)
    slot = p if REVERSE else p + 1
    offs, mask = state_tile(states, slot, bh, BH, S, F, DV, W, 0, vb, GA, BD, BF, True)
    tl.store(states + offs, xa, mask=mask)
    if HAS_B:
        offs, mask = state_tile(states, slot, bh, BH, S, F, DV, W, GA, vb, GB, BD, BF, True)
        tl.store(states + offs, xb, mask=mask)
    offs, mask = norm_tile(states, slot, bh, BH, S, F, DV, W, GN, BF)
    tl.store(states + offs, xn, mask=in_first_block(mask, vb))


@triton.jit
def output_kernel(
    q, k, v, coef, log_lam, docs, states, out, z,
    seq_len, BH, H, S, F, DV, W, SPAN,
    BT: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr, GA: tl.constexpr, GB: tl.constexpr,
    HAS_B: tl.constexpr, GN: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The forward's outputs of one span: column blocks 0 .. NB - 1 (NB value blocks) walk o by value
    block, block NB walks z from the normalisers. One launch, so that the normalisers' walk reads its q
    and k tiles beside the value blocks of its span and head (from L2 after the first), and its own
    walk: the normalisers inside a value walk spilled on sm_90."""
    n_blocks = tl.cdiv(DV, BD)
    p, bh, b, h, blk = span_program(BH, H, n_blocks + 1)
    n_here = span_chunk_count(p, seq_len, SPAN, BT)
    if blk < n_blocks:
        _value_walk(q, k, v, coef, log_lam, docs, states, out, p, bh, b, h, blk, n_here, seq_len, BH, H, S, F, DV,
                    W, SPAN, BT, BF, BD, GA, GB, HAS_B, GN, PRECISION)  # fmt: skip
    else:
        _norm_walk(q, k, coef, log_lam, docs, states, z, p, bh, b, h, n_here, seq_len, BH, H, S, F, DV, W, SPAN,
                   BT, BF, GN, PRECISION)  # fmt: skip


@triton.jit
def _value_walk(
    q, k, v, coef, log_lam, docs, states, out, p, bh, b, h, vb, n_here,
    seq_len, BH, H, S, F, DV, W, SPAN,
    BT: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr, GA: tl.constexpr, GB: tl.constexpr,
    HAS_B: tl.constexpr, GN: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """o of one span and value block: from the state entering the span (slot span), chunk by chunk,
    o_i = sum_j (q_i . k_j) Wc[i, j] v_j + sum_s lam_s^(i+1) q_i G_s, then the chunk's writes update the
    on-chip state. Stored once, in its dtype. The order inside a chunk (intra-chunk part, then the small
    term group, then the large one) is the one that compiles without spills."""
    offs_f = tl.arange(0, BF)
    offs_d = vb * BD + tl.arange(0, BD)
    offs, mask = state_tile(states, p, bh, BH, S, F, DV, W, 0, vb, GA, BD, BF, True)
    xa = tl.load(states + offs, mask=mask, other=0.0)
    xb = tl.zeros([GB * BD, BF], dtype=tl.float32)
    if HAS_B:
        offs, mask = state_tile(states, p, bh, BH, S, F, DV, W, GA, vb, GB, BD, BF, True)
        xb = tl.load(states + offs, mask=mask, other=0.0)
    table = decay_table(log_lam, h, S, GN, BT)
    for i in range(0, n_here):
        start = (p * SPAN + i) * BT
        base = token_base(b, h, start, seq_len, H)
        mask_t, n, reads, writes, carry, linked = chunk_masks(docs, b, start, seq_len, BT)
        qc = load_tile(q, base, H, F, offs_f, mask_t, BT)
        kc = load_tile(k, base, H, F, offs_f, mask_t, BT)
        vc = load_tile(v, base, H, DV, offs_d, mask_t, BT)
        _ll, cs = term_loads(log_lam, coef, base, h, H, S, 0, mask_t, GN, BT)
        pm = tl.dot(qc, tl.trans(kc), input_precision=PRECISION) * kernel_matrix(table, cs, linked, PRECISION, BT)
        o = tl.dot(pm.to(vc.dtype), vc, input_precision=PRECISION)
        if HAS_B:
            ll, cs = term_loads(log_lam, coef, base, h, H, S, GA, mask_t, GB, BT)
            o += over_terms(read_state(xb, qc, PRECISION), read_decays(ll, reads, BT), BT, GB, BD)
            xb = write_state(xb, kc, write_decays(ll, writes, n, BT) * cs, vc, chunk_decay(ll, n, carry, GB, BD),
                             BT, GB, BD, PRECISION)  # fmt: skip
        ll, cs = term_loads(log_lam, coef, base, h, H, S, 0, mask_t, GA, BT)
        o += over_terms(read_state(xa, qc, PRECISION), read_decays(ll, reads, BT), BT, GA, BD)
        xa = write_state(xa, kc, write_decays(ll, writes, n, BT) * cs, vc, chunk_decay(ll, n, carry, GA, BD),
                         BT, GA, BD, PRECISION)  # fmt: skip
        store_tile(out, base, H, DV, offs_d, mask_t, o, BT)


@triton.jit
def _norm_walk(
    q, k, coef, log_lam, docs, states, z, p, bh, b, h, n_here,
    seq_len, BH, H, S, F, DV, W, SPAN,
    BT: tl.constexpr, BF: tl.constexpr, GN: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """z of one span: from the normalisers entering the span, chunk by chunk, z_i = sum_j (q_i . k_j)
    Wc[i, j] + sum_s lam_s^(i+1) q_i . b_s, then the writes update them. Stored once, in its dtype."""
    offs_f = tl.arange(0, BF)
    offs, mask = norm_tile(states, p, bh, BH, S, F, DV, W, GN, BF)
    xn = tl.load(states + offs, mask=mask, other=0.0)
    table = decay_table(log_lam, h, S, GN, BT)
    for i in range(0, n_here):
        start = (p * SPAN + i) * BT
        base = token_base(b, h, start, seq_len, H)
        mask_t, n, reads, writes, carry, linked = chunk_masks(docs, b, start, seq_len, BT)
        qc = load_tile(q, base, H, F, offs_f, mask_t, BT)
        kc = load_tile(k, base, H, F, offs_f, mask_t, BT)
        ll, cs = term_loads(log_lam, coef, base, h, H, S, 0, mask_t, GN, BT)
        pm = tl.dot(qc, tl.trans(kc), input_precision=PRECISION) * kernel_matrix(table, cs, linked, PRECISION, BT)
        zc = tl.sum(pm, axis=1) + tl.sum(read_state(xn, qc, PRECISION) * tl.trans(read_decays(ll, reads, BT)), axis=0)
        ones = tl.where(mask_t, 1.0, 0.0)
        xn = write_norms(xn, kc, write_decays(ll, writes, n, BT) * cs, ones, chunk_decay(ll, n, carry, GN, 1),
                         PRECISION)  # fmt: skip
        tl.store(z + base + tl.arange(0, BT) * H, zc, mask=mask_t)
