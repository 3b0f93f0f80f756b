"""Triton kernels for the SOE scan (the CUDA path; also runs under TRITON_INTERPRET=1 on CPU tensors).

The same chunked algorithm as kernels/soe/chunk.py, forward and backward, with each SOE term's state
kept in registers by its own program and the terms' outputs summed by atomic adds. The sequence is cut
into spans of whole chunks (kernels/span.py) so that a batch-1 step still launches enough programs:
per-span state contributions, one pass over the spans for the entering states (and, in reverse, their
gradients), then the per-span walks. States cross kernels packed as [n_spans + 1, B*H*S, F*D + F]
(each term's G_s row-major, then b_s). Every chunk kernel takes the tokens' document numbers (all zero
without resets) and cuts its decay tables at document starts (``_chunk_decays``), as the chunked path
does. docs/kernels.md, "SOE scan: the chunked algorithm", gives the
formulas, the program layout and the precision rules.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import Launch, check_triton_inputs, device_capability, document_numbers, triton_type
from kernels.span import chunk_documents, chunk_start, span_carry, span_chunks, span_pass_launch


@triton.jit
def _term_tile(H, S, F, DV, W, SPAN, seq_len, BF: tl.constexpr, BD: tl.constexpr):
    """This program's batch, head, term, value block and span [lo, hi) of tokens, and the offsets and mask
    of its state tile G_s [BF, BD] in one slot of a packed [B*H*S, W] state (W = F*DV + F: each term's
    G_s row-major, then its normaliser b_s)."""
    pid = tl.program_id(0)
    i_d = tl.program_id(1)
    lo = tl.program_id(2) * SPAN
    hi = tl.minimum(lo + SPAN, seq_len)
    s = pid % S
    bh = pid // S
    h = bh % H
    b = bh // H
    offs_f = tl.arange(0, BF)
    offs_d = i_d * BD + tl.arange(0, BD)
    st_off = pid * W + offs_f[:, None] * DV + offs_d[None, :]
    st_mask = (offs_f < F)[:, None] & (offs_d < DV)[None, :]
    return b, h, s, i_d, offs_f, offs_d, st_off, st_mask, lo, hi


@triton.jit
def _slot(states, i, W):
    """Slot ``i`` of a packed [n_spans + 1, B*H*S, W] state (64-bit offset)."""
    return states + i.to(tl.int64) * tl.num_programs(0) * W


@triton.jit
def _chunk_decays(ll, docs, b, start, seq_len, BT: tl.constexpr):
    """Positions and decay factors of the chunk starting at ``start`` (all exponents >= 0), cut at the
    document starts of batch row ``b`` (``docs``, kernels.span.chunk_documents): a token reads the
    entering state only if no reset is at or before it in the chunk (q_dec), only the chunk's last
    document writes the state it leaves (k_dec), the entering state passes through only if the chunk has
    no reset (chunk_dec), and ``intra`` is zero between tokens of different documents."""
    offs_t = tl.arange(0, BT)
    pos = offs_t.to(tl.float32)
    mask_t = start + offs_t < seq_len
    doc, entering, last = chunk_documents(docs, b, start, seq_len, BT)
    n = tl.minimum(seq_len - start, BT).to(tl.float32)
    q_dec = tl.where(doc == entering, tl.exp((pos + 1.0) * ll), 0.0)
    k_dec = tl.where(mask_t & (doc == last), tl.exp(tl.maximum(n - 1.0 - pos, 0.0) * ll), 0.0)
    chunk_dec = tl.where(last == entering, tl.exp(n * ll), 0.0)
    diff = pos[:, None] - pos[None, :]
    causal = diff >= 0
    linked = causal & (doc[:, None] == doc[None, :])
    intra = tl.where(linked, tl.exp(tl.where(causal, diff, 0.0) * ll), 0.0)
    return mask_t, q_dec, k_dec, chunk_dec, diff, intra


@triton.jit
def _tile(ptr, base, loc, width, offs):
    """Pointers to the [BT, len(offs)] tile at columns ``offs`` of rows ``base + loc`` of a [rows, width] array."""
    return ptr + base * width + (loc[:, None] * width + offs[None, :])


@triton.jit
def _load_chunk(
    q, k, v, coef, b, h, s, start, seq_len, H, S, F, DV, i_d, BT: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr
):
    """Rows of q, k [BT, BF], v [BT, BD] and coef[:, s] [BT] of one chunk (masked entries are zero), and
    where the chunk's rows are: row ``base + loc[i]`` of the [B*T*H, .] views, ``base`` an int64 scalar
    (base * F overflows int32 at long B*T*H) and ``loc`` int32 (32-bit offsets keep per-element addresses
    out of 64-bit registers)."""
    offs_t = start + tl.arange(0, BT)
    offs_f = tl.arange(0, BF)
    offs_d = i_d * BD + tl.arange(0, BD)
    mask_t = offs_t < seq_len
    base = ((b * seq_len + start) * H + h).to(tl.int64)
    loc = tl.arange(0, BT) * H
    mask_qk = mask_t[:, None] & (offs_f < F)[None, :]
    mask_v = mask_t[:, None] & (offs_d < DV)[None, :]
    qc = tl.load(_tile(q, base, loc, F, offs_f), mask=mask_qk, other=0.0)
    kc = tl.load(_tile(k, base, loc, F, offs_f), mask=mask_qk, other=0.0)
    vc = tl.load(_tile(v, base, loc, DV, offs_d), mask=mask_v, other=0.0)
    cc = tl.load(coef + base * S + (loc * S + s), mask=mask_t, other=0.0).to(tl.float32)
    return base, loc, mask_qk, mask_v, qc, kc, vc, cc


@triton.jit
def _normaliser_tile(F, DV, W, BT: tl.constexpr, BF: tl.constexpr):
    """The normaliser b_s [BF] of a term is carried by the first value block's program only: a [BT] mask
    that is all true there and all false elsewhere, and the offsets and mask of b_s in the packed state
    (the masks are built from block comparisons, which the interpreter also accepts)."""
    keep = (tl.program_id(1) == 0).to(tl.int32)
    offs_f = tl.arange(0, BF)
    return tl.arange(0, BT) < BT * keep, tl.program_id(0) * W + F * DV + offs_f, offs_f < F * keep


@triton.jit
def _soe_span_kernel(
    x,
    y,
    coef,
    y_norm,
    log_lam,
    docs,
    states,
    seq_len,
    SPAN,
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
    """One span's own contribution to the state, from a zero state, into slot ``span + 1`` (forward: x = k,
    y = v; the state its tokens leave at its end, sum_j lam^(hi-1-j) coef_j k_j v_j^T, and b_s with k
    alone) or, REVERSE, into slot ``span`` (x = q, y = d_out, y_norm = d_z: the gradient its reads give
    the state entering it, sum_t lam^(t-lo+1) q_t do_t^T, and b_s's with d_z)."""
    b, h, s, _i_d, offs_f, offs_d, st_off, st_mask, lo, hi = _term_tile(H, S, F, DV, W, SPAN, seq_len, BF, BD)
    first, nm_off, nm_mask = _normaliser_tile(F, DV, W, BT, BF)
    ll = tl.load(log_lam + h * S + s)
    acc = tl.zeros([BF, BD], dtype=tl.float32)
    acc_norm = tl.zeros([BF], dtype=tl.float32)
    n_chunks = tl.cdiv(hi - lo, BT)
    for i in range(0, n_chunks):
        start = chunk_start(lo, i, n_chunks, BT, REVERSE)
        base = ((b * seq_len + start) * H + h).to(tl.int64)
        loc = tl.arange(0, BT) * H
        mask_t, q_dec, k_dec, chunk_dec, _diff, _intra = _chunk_decays(ll, docs, b, start, seq_len, BT)
        xc = tl.load(_tile(x, base, loc, F, offs_f), mask=mask_t[:, None] & (offs_f < F)[None, :], other=0.0)
        yc = tl.load(_tile(y, base, loc, DV, offs_d), mask=mask_t[:, None] & (offs_d < DV)[None, :], other=0.0)
        if REVERSE:
            scaled = xc.to(tl.float32) * q_dec[:, None]
            weight = tl.load(y_norm + base + loc, mask=mask_t & first, other=0.0)
        else:
            cc = tl.load(coef + base * S + (loc * S + s), mask=mask_t, other=0.0)
            scaled = xc.to(tl.float32) * (k_dec * cc)[:, None]
            weight = tl.where(mask_t, 1.0, 0.0)
        acc = acc * chunk_dec + tl.dot(tl.trans(scaled.to(yc.dtype)), yc, input_precision=PRECISION)
        acc_norm = acc_norm * chunk_dec + tl.sum(scaled * weight[:, None], axis=0)
    if REVERSE:
        out = _slot(states, tl.program_id(2), W)
    else:
        out = _slot(states, tl.program_id(2) + 1, W)
    tl.store(out + st_off, acc, mask=st_mask)
    tl.store(out + nm_off, acc_norm, mask=nm_mask)


@triton.jit
def _soe_fwd_kernel(
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
    SPAN,
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
    """Outputs of one span, one term and one value block, from the state entering the span (slot
    ``span`` of ``states``), added into o and z by atomics (the S terms of a head share them)."""
    b, h, s, i_d, _offs_f, offs_d, st_off, st_mask, lo, hi = _term_tile(H, S, F, DV, W, SPAN, seq_len, BF, BD)
    first, nm_off, nm_mask = _normaliser_tile(F, DV, W, BT, BF)
    entering = _slot(states, tl.program_id(2), W)
    state = tl.load(entering + st_off, mask=st_mask, other=0.0)
    norm = tl.load(entering + nm_off, mask=nm_mask, other=0.0)
    ll = tl.load(log_lam + h * S + s)
    for start in range(lo, hi, BT):
        base, loc, _mask_qk, mask_v, qc, kc, vc, cc = _load_chunk(
            q, k, v, coef, b, h, s, start, seq_len, H, S, F, DV, i_d, BT, BF, BD
        )
        mask_t, q_dec, k_dec, chunk_dec, _diff, intra = _chunk_decays(ll, docs, b, start, seq_len, BT)
        scores = tl.dot(qc, tl.trans(kc), input_precision=PRECISION) * (intra * cc[None, :])
        qd = qc * q_dec[:, None]
        o = tl.dot(scores.to(vc.dtype), vc, input_precision=PRECISION)
        o += tl.dot(qd.to(vc.dtype), state.to(vc.dtype), input_precision=PRECISION)
        tl.atomic_add(_tile(out, base, loc, DV, offs_d), o, mask=mask_v)
        z_c = tl.sum(scores, axis=1) + tl.sum(qd.to(tl.float32) * norm[None, :], axis=1)
        tl.atomic_add(z + base + loc, z_c, mask=mask_t & first)
        keys = kc * (k_dec * cc)[:, None]
        state = state * chunk_dec + tl.dot(tl.trans(keys.to(vc.dtype)), vc, input_precision=PRECISION)
        norm = norm * chunk_dec + tl.sum(keys.to(tl.float32), axis=0)


@triton.jit
def _soe_bwd_forward_order_kernel(
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
    SPAN,
    centre,
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
    """One span in token order from its entering state: the query gradients of the cross-chunk reads, all
    intra-chunk gradients, and the reader half of d log_lam."""
    b, h, s, i_d, offs_f, offs_d, st_off, st_mask, lo, hi = _term_tile(H, S, F, DV, W, SPAN, seq_len, BF, BD)
    first, nm_off, nm_mask = _normaliser_tile(F, DV, W, BT, BF)
    entering = _slot(states, tl.program_id(2), W)
    state = tl.load(entering + st_off, mask=st_mask, other=0.0)
    norm = tl.load(entering + nm_off, mask=nm_mask, other=0.0)
    ll = tl.load(log_lam + h * S + s)
    acc_ll = tl.zeros([BT], dtype=tl.float32)
    for start in range(lo, hi, BT):
        base, loc, mask_qk, mask_v, qc, kc, vc, cc = _load_chunk(
            q, k, v, coef, b, h, s, start, seq_len, H, S, F, DV, i_d, BT, BF, BD
        )
        mask_t, q_dec, k_dec, chunk_dec, diff, intra = _chunk_decays(ll, docs, b, start, seq_len, BT)
        qf, kf, vf = qc.to(tl.float32), kc.to(tl.float32), vc.to(tl.float32)
        doc = tl.load(_tile(d_out, base, loc, DV, offs_d), mask=mask_v, other=0.0)
        dzc = tl.load(d_z + base + loc, mask=mask_t & first, other=0.0)  # zero outside the normaliser's program
        # Cross-chunk reads: o'_i += lam^(i+1) q_i G, z'_i += lam^(i+1) q_i . b.
        dq_inter = tl.dot(doc, tl.trans(state), input_precision=PRECISION) + dzc[:, None] * norm[None, :]
        dq_inter = dq_inter * q_dec[:, None]
        pos = (start + tl.arange(0, BT)).to(tl.float32) - centre
        acc_ll += tl.where(mask_t, tl.sum(dq_inter * qf, axis=1) * pos, 0.0)
        # Intra-chunk: P = (Q K^T) * W, W[i, j] = coef_j lam^(i-j); z reads P through a column of ones.
        scores = tl.dot(qf, tl.trans(kf), input_precision=PRECISION)
        w = intra * cc[None, :]
        d_p = tl.dot(doc, tl.trans(vf), input_precision=PRECISION) + dzc[:, None]
        d_a = d_p * w
        dq_c = dq_inter + tl.dot(d_a, kf, input_precision=PRECISION)
        dk_c = tl.dot(tl.trans(d_a), qf, input_precision=PRECISION)
        dv_c = tl.dot(tl.trans(scores * w), doc, input_precision=PRECISION)
        d_w = d_p * scores * intra
        acc_ll += tl.sum(d_w * cc[None, :] * diff, axis=1)
        tl.atomic_add(_tile(dq, base, loc, F, offs_f), dq_c, mask=mask_qk)
        tl.atomic_add(_tile(dk, base, loc, F, offs_f), dk_c, mask=mask_qk)
        tl.atomic_add(_tile(dv, base, loc, DV, offs_d), dv_c, mask=mask_v)
        tl.atomic_add(dcoef + base * S + (loc * S + s), tl.sum(d_w, axis=0), mask=mask_t)
        keys = kf * (k_dec * cc)[:, None]
        state = state * chunk_dec + tl.dot(tl.trans(keys), vf, input_precision=PRECISION)
        norm = norm * chunk_dec + tl.sum(keys, axis=0)
    tl.atomic_add(dll + h * S + s, tl.sum(acc_ll, axis=0))


@triton.jit
def _soe_bwd_reverse_order_kernel(
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
    dk,
    dv,
    dcoef,
    dll,
    seq_len,
    SPAN,
    centre,
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
    """One span in reverse token order from the gradient of the state leaving it (slot ``span + 1`` of
    ``d_states``): the key, value and coef gradients of the cross-chunk writes and the writer half of
    d log_lam."""
    b, h, s, i_d, offs_f, offs_d, st_off, st_mask, lo, hi = _term_tile(H, S, F, DV, W, SPAN, seq_len, BF, BD)
    first, nm_off, nm_mask = _normaliser_tile(F, DV, W, BT, BF)
    leaving = _slot(d_states, tl.program_id(2) + 1, W)
    d_state = tl.load(leaving + st_off, mask=st_mask, other=0.0)
    d_norm = tl.load(leaving + nm_off, mask=nm_mask, other=0.0)
    ll = tl.load(log_lam + h * S + s)
    acc_ll = tl.zeros([BT], dtype=tl.float32)
    n_chunks = tl.cdiv(hi - lo, BT)
    for rev in range(0, n_chunks):
        start = lo + (n_chunks - 1 - rev) * BT
        base, loc, mask_qk, mask_v, qc, kc, vc, cc = _load_chunk(
            q, k, v, coef, b, h, s, start, seq_len, H, S, F, DV, i_d, BT, BF, BD
        )
        mask_t, q_dec, k_dec, chunk_dec, _diff, _intra = _chunk_decays(ll, docs, b, start, seq_len, BT)
        qf, kf, vf = qc.to(tl.float32), kc.to(tl.float32), vc.to(tl.float32)
        doc = tl.load(_tile(d_out, base, loc, DV, offs_d), mask=mask_v, other=0.0)
        dzc = tl.load(d_z + base + loc, mask=mask_t & first, other=0.0)
        key_scale = k_dec * cc
        d_keys = tl.dot(vf, tl.trans(d_state), input_precision=PRECISION) + d_norm[None, :]
        d_coef_state = tl.sum(d_keys * kf, axis=1) * k_dec
        pos = (start + tl.arange(0, BT)).to(tl.float32) - centre
        acc_ll += tl.where(mask_t, d_coef_state * cc * pos, 0.0)
        tl.atomic_add(_tile(dk, base, loc, F, offs_f), d_keys * key_scale[:, None], mask=mask_qk)
        tl.atomic_add(dcoef + base * S + (loc * S + s), d_coef_state, mask=mask_t)
        tl.atomic_add(
            _tile(dv, base, loc, DV, offs_d),
            tl.dot(kf * key_scale[:, None], d_state, input_precision=PRECISION),
            mask=mask_v,
        )
        qd = qf * q_dec[:, None]
        d_state = d_state * chunk_dec + tl.dot(tl.trans(qd), doc, input_precision=PRECISION)
        d_norm = d_norm * chunk_dec + tl.sum(qd * dzc[:, None], axis=0)
    tl.atomic_add(dll + h * S + s, -tl.sum(acc_ll, axis=0))


@triton.jit
def _entering_rows(q, seq_len, H, F, DV, BT: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr):
    """This program's batch x head, head, rows (chunk ``program_id(1)``, value block ``program_id(2)``), the
    rows' queries [BT, BF] in fp32, their steps t + 1 into the piece, the masks, and ``first``: all true in
    the first value block's programs, which alone handle the normaliser z, all false elsewhere."""
    bh = tl.program_id(0)
    h = bh % H
    start = tl.program_id(1) * BT
    offs_t = start + tl.arange(0, BT)
    offs_f = tl.arange(0, BF)
    offs_d = tl.program_id(2) * BD + tl.arange(0, BD)
    mask_t = offs_t < seq_len
    base = (((bh // H) * seq_len + start) * H + h).to(tl.int64)
    loc = tl.arange(0, BT) * H
    mask_qk = mask_t[:, None] & (offs_f < F)[None, :]
    mask_v = mask_t[:, None] & (offs_d < DV)[None, :]
    qc = tl.load(_tile(q, base, loc, F, offs_f), mask=mask_qk, other=0.0).to(tl.float32)
    steps = (offs_t + 1).to(tl.float32)
    first = tl.arange(0, BT) < BT * (tl.program_id(2) == 0).to(tl.int32)
    st_mask = (offs_f < F)[:, None] & (offs_d < DV)[None, :]
    return bh, h, offs_f, offs_d, mask_t, base, loc, mask_qk, mask_v, qc, steps, first, st_mask


@triton.jit
def _entering_fwd_kernel(
    q,
    log_lam,
    g_in,
    b_in,
    out,
    z,
    seq_len,
    H,
    S,
    F,
    DV,
    BT: tl.constexpr,
    BF: tl.constexpr,
    BD: tl.constexpr,
    PRECISION: tl.constexpr,
):
    bh, h, offs_f, offs_d, mask_t, base, loc, _mask_qk, mask_v, qc, steps, first, st_mask = _entering_rows(
        q, seq_len, H, F, DV, BT, BF, BD
    )
    o = tl.zeros([BT, BD], dtype=tl.float32)
    zc = tl.zeros([BT], dtype=tl.float32)
    for s in range(0, S):
        qd = qc * tl.exp(steps * tl.load(log_lam + h * S + s))[:, None]
        g = tl.load(g_in + ((bh * S + s) * F + offs_f[:, None]) * DV + offs_d[None, :], mask=st_mask, other=0.0)
        o += tl.dot(qd, g, input_precision=PRECISION)
        bv = tl.load(b_in + (bh * S + s) * F + offs_f, mask=offs_f < F, other=0.0)
        zc += tl.sum(qd * bv[None, :], axis=1)
    tl.store(_tile(out, base, loc, DV, offs_d), o, mask=mask_v)
    tl.store(z + base + loc, zc, mask=mask_t & first)


@triton.jit
def _entering_bwd_kernel(
    q,
    log_lam,
    g_in,
    b_in,
    d_out,
    d_z,
    dq,
    dll,
    dg,
    db,
    seq_len,
    H,
    S,
    F,
    DV,
    BT: tl.constexpr,
    BF: tl.constexpr,
    BD: tl.constexpr,
    PRECISION: tl.constexpr,
):
    bh, h, offs_f, offs_d, mask_t, base, loc, mask_qk, mask_v, qc, steps, first, st_mask = _entering_rows(
        q, seq_len, H, F, DV, BT, BF, BD
    )
    doc = tl.load(_tile(d_out, base, loc, DV, offs_d), mask=mask_v, other=0.0)
    dzc = tl.load(d_z + base + loc, mask=mask_t & first, other=0.0)  # z's gradient: the first value block
    dq_acc = tl.zeros([BT, BF], dtype=tl.float32)
    for s in range(0, S):
        scale = tl.exp(steps * tl.load(log_lam + h * S + s))
        st_off = ((bh * S + s) * F + offs_f[:, None]) * DV + offs_d[None, :]
        g = tl.load(g_in + st_off, mask=st_mask, other=0.0)
        bv = tl.load(b_in + (bh * S + s) * F + offs_f, mask=offs_f < F, other=0.0)
        d_qd = tl.dot(doc, tl.trans(g), input_precision=PRECISION) + dzc[:, None] * bv[None, :]
        dq_acc += d_qd * scale[:, None]
        qd = qc * scale[:, None]
        tl.atomic_add(dg + st_off, tl.dot(tl.trans(qd), doc, input_precision=PRECISION), mask=st_mask)
        tl.atomic_add(db + (bh * S + s) * F + offs_f, tl.sum(qd * dzc[:, None], axis=0), mask=offs_f < F)
        # scale = lam^(t+1): d log_lam = sum_t (t + 1) scale_t (q_t . d qd_t)
        tl.atomic_add(dll + h * S + s, tl.sum(tl.sum(qd * d_qd, axis=1) * steps, axis=0))
    tl.atomic_add(_tile(dq, base, loc, F, offs_f), dq_acc, mask=mask_qk)


def _precision(dtype: torch.dtype) -> str:
    """tl.dot precision: full IEEE fp32 for fp32 inputs (TF32 would cost ~1e-3 relative error); 16-bit
    inputs are rounded already, so their fp32 intermediates may use TF32."""
    return "ieee" if dtype == torch.float32 else "tf32"


# Per target, input dtype and pass: (largest chunk block, largest value block, warps, pipeline stages).
# A chunk block smaller than the model's chunk size changes only how the work is split, not the result;
# small chunk and value blocks (value blocks divide the 64-wide heads) keep the tiles in registers. The
# compile gate (benchmarks/kernel_compile.py, tests/test_kernels_compile.py) checks every entry.
_TABLE: dict[tuple[bool, bool], dict[str, tuple[int, int, int, int]]] = {
    # (sm_90 or newer, fp32 inputs)
    (False, False): {"fwd": (16, 64, 8, 2), "bwd": (16, 16, 4, 2)},
    (False, True): {"fwd": (16, 64, 8, 2), "bwd": (16, 16, 4, 2)},
    (True, False): {"fwd": (32, 64, 8, 2), "bwd": (16, 64, 8, 2)},
    (True, True): {"fwd": (32, 64, 8, 2), "bwd": (16, 64, 8, 2)},
}


def soe_launches(
    batch: int,
    seq_len: int,
    heads: int,
    n_terms: int,
    feat: int,
    width: int,
    chunk_size: int,
    dtype: torch.dtype,
    capability: int,
) -> tuple[int, dict[str, Launch]]:
    """(span length, launches) of one scan for q, k, v of ``dtype`` and value width ``width`` on a GPU of
    compute capability ``capability``. Forward: "fwd_spans" (each span's state contribution), "fwd_pass"
    (the entering states), "fwd" (the outputs); backward: "bwd_spans", "bwd_pass" (the state gradients,
    in reverse), "bwd_forward_order", "bwd_reverse_order". Chunk and feature blocks are powers of two >=
    16 (tl.dot's minimum); the chunk size only changes how work is split, not the result. A value block
    never exceeds the value width rounded up to a power of two, so 64- and 16-wide heads are tiled
    without padding. Spans are whole chunks of both passes, as many as the smaller of the two grids (the
    one with the wider value blocks) needs to reach kernels.span.TARGET_PROGRAMS programs."""
    bf = max(16, triton.next_power_of_2(feat))
    table = _TABLE[(capability >= 90, dtype == torch.float32)]

    def blocks(kind: str) -> tuple[int, int, int, int]:
        """(chunk block, value block, warps, stages) of the forward ("fwd") or backward ("bwd") kernels."""
        bt_max, bd_max, warps, stages = table[kind]
        bt = min(bt_max, max(16, triton.next_power_of_2(chunk_size)))
        return bt, min(bd_max, max(16, triton.next_power_of_2(width))), warps, stages

    fwd, bwd = blocks("fwd"), blocks("bwd")
    step = max(fwd[0], bwd[0])
    per_span = batch * heads * n_terms * min(triton.cdiv(width, fwd[1]), triton.cdiv(width, bwd[1]))
    span = step * span_chunks(seq_len, step, per_span)
    n_spans = triton.cdiv(seq_len, span)
    ints = {"seq_len": "i32", "SPAN": "i32", "H": "i32", "S": "i32", "F": "i32", "DV": "i32", "W": "i32"}
    inputs = dict.fromkeys(("q", "k", "v"), triton_type(dtype)) | dict.fromkeys(("coef", "log_lam", "states"), "fp32")
    inputs["docs"] = "i32"
    grads = ("d_out", "d_z", "d_states")
    backward_ints = ints | {"centre": "fp32"}
    made = {
        "fwd": (_soe_fwd_kernel, inputs | dict.fromkeys(("out", "z"), "fp32"), ints, fwd, {}),
        "fwd_spans": (
            _soe_span_kernel,
            {"x": triton_type(dtype), "y": triton_type(dtype)}
            | dict.fromkeys(("coef", "y_norm", "log_lam", "states"), "fp32")
            | {"docs": "i32"},
            ints,
            fwd,
            {"REVERSE": False},
        ),
        "bwd_spans": (
            _soe_span_kernel,
            {"x": triton_type(dtype)}
            | dict.fromkeys(("y", "coef", "y_norm", "log_lam", "states"), "fp32")
            | {"docs": "i32"},
            ints,
            bwd,
            {"REVERSE": True},
        ),
        "bwd_forward_order": (
            _soe_bwd_forward_order_kernel,
            inputs | dict.fromkeys((*grads, "dq", "dk", "dv", "dcoef", "dll"), "fp32"),
            backward_ints,
            bwd,
            {},
        ),
        "bwd_reverse_order": (
            _soe_bwd_reverse_order_kernel,
            inputs | dict.fromkeys((*grads, "dk", "dv", "dcoef", "dll"), "fp32"),
            backward_ints,
            bwd,
            {},
        ),
    }
    launches = {}
    for name, (kernel, pointers, scalars, (bt, bd, warps, stages), extra) in made.items():
        constexprs = {"BT": bt, "BF": bf, "BD": bd} | extra | {"PRECISION": _precision(dtype)}
        grid = (batch * heads * n_terms, triton.cdiv(width, bd), n_spans)
        launches[name] = Launch(kernel, pointers, scalars, constexprs, grid, warps, stages)
    n_state = batch * heads * n_terms * feat * (width + 1)
    launches["fwd_pass"] = span_pass_launch(n_state, reverse=False, decay=True, wrap=False)
    launches["bwd_pass"] = span_pass_launch(n_state, reverse=True, decay=True, wrap=False)
    order = ("fwd_spans", "fwd_pass", "fwd", "bwd_spans", "bwd_pass", "bwd_forward_order", "bwd_reverse_order")
    return span, {name: launches[name] for name in order}  # in the order they run


# The entering-state read (sequence parallelism): per target and pass, (chunk block, largest value block,
# warps, stages).
_ENTERING_TABLE: dict[bool, dict[str, tuple[int, int, int, int]]] = {
    # sm_90 or newer
    False: {"fwd": (32, 64, 8, 2), "bwd": (16, 32, 8, 2)},
    True: {"fwd": (32, 64, 8, 2), "bwd": (16, 64, 8, 2)},
}


def entering_launches(
    batch: int, seq_len: int, heads: int, n_terms: int, feat: int, width: int, dtype: torch.dtype, capability: int
) -> dict[str, Launch]:
    """The launches of the entering-state read ("fwd", "bwd"): one program per (batch x head, chunk of BT
    tokens, value block), each summing over the S terms, so the grid grows with the piece length."""
    bf = max(16, triton.next_power_of_2(feat))
    ints = {"seq_len": "i32", "H": "i32", "S": "i32", "F": "i32", "DV": "i32"}
    inputs = {"q": triton_type(dtype)} | dict.fromkeys(("log_lam", "g_in", "b_in"), "fp32")
    outputs = {"fwd": ("out", "z"), "bwd": ("d_out", "d_z", "dq", "dll", "dg", "db")}
    kernels = {"fwd": _entering_fwd_kernel, "bwd": _entering_bwd_kernel}
    launches = {}
    for name, (bt, bd_max, warps, stages) in _ENTERING_TABLE[capability >= 90].items():
        bd = min(bd_max, max(16, triton.next_power_of_2(width)))
        launches[name] = Launch(
            kernels[name],
            inputs | dict.fromkeys(outputs[name], "fp32"),
            ints,
            {"BT": bt, "BF": bf, "BD": bd, "PRECISION": _precision(dtype)},
            (batch * heads, triton.cdiv(seq_len, bt), triton.cdiv(width, bd)),
            warps,
            stages,
        )
    return launches


class SoeEnteringTriton(torch.autograd.Function):
    """The (o, z) contributions of a state entering a piece: o_t = sum_s lam_s^(t+1) q_t^T G_s, z_t likewise
    with b_s; the Triton form of kernels.parallel's entering-state correction. Saves only the inputs."""

    @staticmethod
    def forward(ctx, q, log_lam, g_in, b_in):
        batch, seq_len, heads, feat = q.shape
        n_terms, width = log_lam.shape[-1], g_in.shape[-1]
        check_triton_inputs(q, _entering_fwd_kernel)
        q = q.contiguous()
        ll, g, b = log_lam.float().contiguous(), g_in.float().contiguous(), b_in.float().contiguous()
        out = torch.empty(batch, seq_len, heads, width, dtype=torch.float32, device=q.device)
        z = torch.empty(batch, seq_len, heads, dtype=torch.float32, device=q.device)
        launch = entering_launches(batch, seq_len, heads, n_terms, feat, width, q.dtype, device_capability(q))["fwd"]
        launch.run(q, ll, g, b, out, z, seq_len, heads, n_terms, feat, width)
        ctx.save_for_backward(q, ll, g, b)
        ctx.dtypes = (q.dtype, log_lam.dtype, g_in.dtype, b_in.dtype)
        ctx.set_materialize_grads(False)
        return out.to(g_in.dtype), z.to(g_in.dtype)

    @staticmethod
    def backward(ctx, d_o, d_z):
        q, ll, g, b = ctx.saved_tensors
        batch, seq_len, heads, feat = q.shape
        n_terms, width = ll.shape[-1], g.shape[-1]
        f32 = torch.float32
        d_out = torch.zeros((*q.shape[:3], width), dtype=f32, device=q.device) if d_o is None else d_o.to(f32)
        d_zz = torch.zeros(q.shape[:3], dtype=f32, device=q.device) if d_z is None else d_z.to(f32)
        dq = torch.zeros(q.shape, dtype=f32, device=q.device)
        dll, dg, db = torch.zeros_like(ll), torch.zeros_like(g), torch.zeros_like(b)
        launch = entering_launches(batch, seq_len, heads, n_terms, feat, width, q.dtype, device_capability(q))["bwd"]
        launch.run(
            q, ll, g, b, d_out.contiguous(), d_zz.contiguous(), dq, dll, dg, db, seq_len, heads, n_terms, feat, width
        )
        return tuple(x.to(d) for x, d in zip((dq, dll, dg, db), ctx.dtypes))


def _pack(g: torch.Tensor, b: torch.Tensor, n_spans: int, slot: int) -> torch.Tensor:
    """A zeroed fp32 [n_spans + 1, B*H*S, F*D + F] buffer of packed states with (g, b) in ``slot``."""
    rows, feat = g.shape[0] * g.shape[1] * g.shape[2], g.shape[3]
    out = torch.zeros(n_spans + 1, rows, feat * (g.shape[4] + 1), dtype=torch.float32, device=g.device)
    out[slot, :, : g[0, 0, 0].numel()] = g.reshape(rows, -1)
    out[slot, :, g[0, 0, 0].numel() :] = b.reshape(rows, feat)
    return out


def _pass_sizes(states: torch.Tensor, terms_per_row: int) -> tuple[int, int, int, int]:
    """The span pass's sizes for packed states [n_spans + 1, B*H*S, W]: elements per slot, W, H*S, and
    elements per batch row."""
    width = states.shape[-1]
    return states[0].numel(), width, terms_per_row, terms_per_row * width


def _unpack(packed: torch.Tensor, like_g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One slot [B*H*S, F*D + F] of a packed buffer as (G [B, H, S, F, D], b [B, H, S, F]), copies."""
    n = like_g[0, 0, 0].numel()
    return packed[:, :n].reshape(like_g.shape).clone(), packed[:, n:].reshape(like_g.shape[:4]).clone()


class SoeScanTriton(torch.autograd.Function):
    """Triton forward and backward in spans (kernels/span.py). Saves the inputs and the states entering
    the spans (a few MB: there are only as many spans as the grid needs); the backward recomputes the
    rest and derives the state gradients at the span boundaries with one reverse pass. ``reset`` (bool
    [B, T] or None) zeroes the state before each document's first token: the kernels get the document
    numbers and the span passes a per-span carry (kernels/span.py)."""

    @staticmethod
    def forward(ctx, q, k, v, coef, log_lam, g0, b0, chunk_size, reset=None):
        batch, seq_len, heads, feat = q.shape
        n_terms, width = log_lam.shape[-1], v.shape[-1]
        check_triton_inputs(q, _soe_fwd_kernel)
        q, k, v, coef = q.contiguous(), k.contiguous(), v.contiguous(), coef.contiguous()
        ll = log_lam.float().contiguous()
        span, launches = soe_launches(
            batch, seq_len, heads, n_terms, feat, width, chunk_size, q.dtype, device_capability(q)
        )
        n_spans = triton.cdiv(seq_len, span)
        docs = document_numbers(reset, batch, seq_len, q.device)
        carry = span_carry(docs, span)
        states = _pack(g0.float(), b0.float(), n_spans, 0)
        out = torch.zeros(batch, seq_len, heads, width, dtype=torch.float32, device=q.device)
        z = torch.zeros(batch, seq_len, heads, dtype=torch.float32, device=q.device)
        sizes = (heads, n_terms, feat, width, states.shape[-1])
        launches["fwd_spans"].run(k, v, coef, coef, ll, docs, states, seq_len, span, *sizes)
        launches["fwd_pass"].run(states, ll, carry, n_spans, seq_len, span, *_pass_sizes(states, heads * n_terms))
        launches["fwd"].run(q, k, v, coef, ll, docs, states, out, z, seq_len, span, *sizes)
        g_t, b_t = _unpack(states[n_spans], g0)
        ctx.save_for_backward(q, k, v, coef, ll, states, docs, carry)
        ctx.set_materialize_grads(False)
        ctx.meta = (chunk_size, [x.dtype for x in (q, k, v, coef, log_lam, g0, b0)])
        return out.to(q.dtype), z.to(q.dtype), g_t, b_t

    @staticmethod
    def backward(ctx, d_o, d_z, d_g, d_b):
        q, k, v, coef, ll, states, docs, carry = ctx.saved_tensors
        chunk_size, dtypes = ctx.meta
        batch, seq_len, heads, feat = q.shape
        n_terms, width = ll.shape[-1], v.shape[-1]
        f32 = torch.float32

        def fp32(grad: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
            return torch.zeros(shape, dtype=f32, device=q.device) if grad is None else grad.to(f32).contiguous()

        d_out, d_zz = fp32(d_o, v.shape), fp32(d_z, q.shape[:3])
        g_shape = (batch, heads, n_terms, feat, width)
        span, launches = soe_launches(
            batch, seq_len, heads, n_terms, feat, width, chunk_size, q.dtype, device_capability(q)
        )
        n_spans = triton.cdiv(seq_len, span)
        d_states = _pack(fp32(d_g, g_shape), fp32(d_b, g_shape[:4]), n_spans, n_spans)
        dq = torch.zeros(q.shape, dtype=f32, device=q.device)
        dk = torch.zeros_like(dq)
        dv = torch.zeros(v.shape, dtype=f32, device=q.device)
        dcoef = torch.zeros(coef.shape, dtype=f32, device=q.device)
        dll = torch.zeros_like(ll)
        centre = (seq_len - 1) / 2.0
        sizes = (heads, n_terms, feat, width, states.shape[-1])
        launches["bwd_spans"].run(q, d_out, coef, d_zz, ll, docs, d_states, seq_len, span, *sizes)
        launches["bwd_pass"].run(d_states, ll, carry, n_spans, seq_len, span, *_pass_sizes(states, heads * n_terms))
        common = (q, k, v, coef, ll, docs, states, d_out, d_zz, d_states)
        launches["bwd_forward_order"].run(*common, dq, dk, dv, dcoef, dll, seq_len, span, centre, *sizes)
        launches["bwd_reverse_order"].run(*common, dk, dv, dcoef, dll, seq_len, span, centre, *sizes)
        # The decay gradient's boundary terms: the final state is read at position T - 1 and the
        # initial state written at -1, each (position - centre) times <state, its gradient>.
        boundary = (states[-1] * d_states[-1] * centre + states[0] * d_states[0] * (centre + 1)).view(
            batch, heads * n_terms, -1
        )
        dll += boundary.sum((0, 2)).view_as(dll)
        dg0, db0 = _unpack(d_states[0], torch.empty(g_shape, device="meta"))
        grads = (dq, dk, dv, dcoef, dll, dg0, db0)
        return (*(g.to(d) for g, d in zip(grads, dtypes)), None, None)
